"""tokentape's tokens equal vLLM's CPU engine's, on the same weights:
- greedy streams, token for token, on prompts and output lengths of many sizes;
- vLLM's sampling options: the three penalties, min_tokens, bad words (strings, encoded by
  tokentape and handed to vLLM as the ids it recorded); top-k logprobs agree within float32
  rounding.

Runs where vLLM is reachable (benchmarks/baselines/locate.py: `$TOKENTAPE_VLLM_PYTHON`,
`.venv-vllm` in the repository root, or an importable vllm; `benchmarks/setup_vllm_venv.sh`
makes the venv), else skips and says why. vLLM runs in its own Python as one side process for
the module (benchmarks/baselines/vllm_requests.py: its default settings) on the built-in tiny
model written as a Hugging Face folder; its start compiles for about a minute, so both tests
share it.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from baselines.client import SideProcess  # noqa: E402
from baselines.locate import find_vllm  # noqa: E402

from tokentape import LLM, SamplingParams  # noqa: E402
from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.engine.tokenizer import ByteTokenizer  # noqa: E402
from tokentape.events import schema as ev  # noqa: E402

FOUND, WHERE = find_vllm()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(FOUND is None, reason=WHERE)]

LOGPROB_TOL = 1e-3  # float32 logits from two different CPU kernels


def cases(
    greedy: list[list[int]], prompts: list[list[int]]
) -> list[tuple[list[int], dict[str, Any]]]:
    """Per prompt, options chosen so that each changes the unconstrained greedy stream."""
    tok = ByteTokenizer()
    out = []
    for prompt, g in zip(prompts, greedy):
        base: dict[str, Any] = {
            "max_tokens": 24,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 3,
        }
        out += [
            (prompt, {**base, "presence_penalty": 1.5}),
            (prompt, {**base, "frequency_penalty": 1.0}),
            (prompt, {**base, "repetition_penalty": 1.5}),
            (
                prompt,
                {
                    **base,
                    "presence_penalty": 0.5,
                    "frequency_penalty": 0.3,
                    "repetition_penalty": 1.2,
                },
            ),
            (
                prompt,
                {
                    **base,
                    "presence_penalty": -1.0,
                    "frequency_penalty": -0.5,
                    "repetition_penalty": 0.8,
                },
            ),
            # Its first greedy token is a stop id, held back until 6 tokens are out.
            (prompt, {**base, "stop_token_ids": [g[0]], "min_tokens": 6}),
            # The first greedy token banned, and the third after the second (both as text).
            (prompt, {**base, "bad_words": [tok.decode([g[0]]), tok.decode(g[1:3])]}),
        ]
    return out


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SideProcess]:
    """vLLM's LLM at its defaults on tokentape's tiny model (float32, seed 0)."""
    assert FOUND is not None
    work = tmp_path_factory.mktemp("vllm-tokens")
    folder = save_checkpoint(builtin_model("tiny", 0)[1], work / "tiny")
    spec = {"model": folder, "dtype": "float32", "seed": 0, "max_model_len": 128}
    with SideProcess(
        FOUND.python,
        "vllm_requests.py",
        spec,
        label="vllm",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        workdir=str(work),
    ) as side:
        side.start()
        yield side


def test_greedy_streams_equal_vllm(vllm: SideProcess) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 64))] for _ in range(16)]
    outputs = [rng.randint(24, 40) for _ in range(16)]
    params: list[dict[str, Any]] = [
        {"max_tokens": o, "temperature": 0.0, "ignore_eos": True} for o in outputs
    ]
    requests = [{"prompt": p, "params": kw} for p, kw in zip(prompts, params)]
    theirs = vllm.call("generate", requests=requests)["tokens"]

    llm = LLM(model="tiny", seed=0, tape=None)
    ours = [
        list(o.outputs[0].token_ids)
        for o in llm.generate(prompts, [SamplingParams(**kw) for kw in params], use_tqdm=False)
    ]
    llm.close()

    assert [len(t) for t in theirs] == outputs
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not differ, (
        f"{len(differ)}/{len(prompts)} streams differ; request {differ[0]}: "
        f"tokentape {ours[differ[0]]} vs vLLM {theirs[differ[0]]}"
    )


def test_sampling_options_equal_vllm(vllm: SideProcess) -> None:
    rng = random.Random(5)
    # Printable bytes, so every greedy token decodes back to itself (bad words as text).
    prompts = [[rng.randrange(35, 129) for _ in range(rng.randint(6, 30))] for _ in range(4)]
    llm = LLM(model="tiny", seed=0, tape=None)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, plain, use_tqdm=False)]
    todo = [
        (p, kw)
        for p, kw in cases(greedy, prompts)
        if all(35 <= t < 129 for t in greedy[prompts.index(p)][:3]) or "bad_words" not in kw
    ]
    ours = llm.generate(
        [p for p, _ in todo], [SamplingParams(**kw) for _, kw in todo], use_tqdm=False
    )
    recorded = {
        e.req_id: e.params
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.RequestAdded)
    }
    ids = [o.request_id for o in ours]
    llm.close()

    requests = []
    for (prompt, kw), req_id in zip(todo, ids):
        kw = dict(kw)
        words = kw.pop("bad_words", None)
        r: dict[str, Any] = {"prompt": prompt, "params": kw}
        if words:
            r["bad_words_ids"] = [list(w) for w in recorded[req_id].bad_words]
        requests.append(r)
    theirs = vllm.call("generate", requests=requests)

    for i, ((prompt, kw), out) in enumerate(zip(todo, ours)):
        c = out.outputs[0]
        assert list(c.token_ids) == theirs["tokens"][i], (i, kw)
        if "bad_words" in kw:
            assert c.token_ids[0] != greedy[prompts.index(prompt)][0]
        vllm_lps = theirs["logprobs"][i]
        assert len(vllm_lps) == len(c.token_ids) and c.top_logprobs is not None
        for pos, (tok, lp, top, their) in enumerate(
            zip(c.token_ids, c.logprobs, c.top_logprobs, vllm_lps)
        ):
            their_d = {t: v for t, v in their}
            assert their_d[tok] == pytest.approx(lp, abs=LOGPROB_TOL), (i, pos)
            # Both hold the sampled token and the top k (3), the same ids unless two tie.
            assert len(top) in (3, 4) and set(top) == set(their_d), (i, pos)
            assert [top[t] for t in sorted(top)] == pytest.approx(
                [their_d[t] for t in sorted(top)], abs=LOGPROB_TOL
            ), (i, pos)
    changed = sum(
        list(o.outputs[0].token_ids[:8]) != g
        for o, g in zip(ours, [greedy[prompts.index(p)] for p, _ in todo])
    )
    assert changed >= len(todo) // 2  # the options did act (else equality would say little)
