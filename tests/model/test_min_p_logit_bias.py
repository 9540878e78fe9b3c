"""vLLM's min_p and logit_bias on the tiny model: each changes the stream as vLLM's does, is
refused where it cannot be honoured, is recorded on the tape and replays from it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tokentape import LLM, SamplingParams
from tokentape.engine.model.sampler import _mask_min_p
from tokentape.events import schema as ev
from tokentape.replay import verify
from tokentape.replay.tape import load_tape

PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tiny_llm(**kw: object) -> LLM:
    args: dict[str, object] = {"model": "tiny", "device": "cpu", "tape": None}
    args.update(kw)
    return LLM(**args, block_size=4, num_kv_blocks=128)  # type: ignore[arg-type]


def tokens(llm: LLM, params: SamplingParams) -> list[int]:
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def test_logit_bias_moves_greedy_tokens() -> None:
    llm = tiny_llm()
    plain = tokens(llm, GREEDY)
    forced = tokens(llm, msgspec.structs.replace(GREEDY, logit_bias={42: 100.0}))
    assert forced == [42] * 8 and plain != forced
    # A -100 bias on the first greedy token moves the first position to another token.
    banned = tokens(llm, msgspec.structs.replace(GREEDY, logit_bias={plain[0]: -100}))
    assert banned[0] != plain[0] and plain[0] not in banned


def test_min_p_keeps_the_tokens_near_the_best() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -5.0], [0.0, 0.0, 0.0, 0.0]])
    probs = x.softmax(-1)
    out = _mask_min_p(x, [0.3, 0.5])
    keep = probs >= torch.tensor([[0.3], [0.5]]) * probs.amax(-1, keepdim=True)
    assert torch.equal(out.isfinite(), keep)
    assert keep[0].tolist() == [True, True, False, False] and keep[1].all()
    # min_p=1 keeps only the most likely token: a random draw is then the greedy one.
    llm = tiny_llm()
    hot = SamplingParams(max_tokens=8, temperature=3.0, seed=1, ignore_eos=True)
    assert tokens(llm, msgspec.structs.replace(hot, min_p=1.0)) == tokens(llm, GREEDY)
    assert tokens(llm, hot) != tokens(llm, GREEDY)


@pytest.mark.parametrize(
    ("kw", "error", "text"),
    [
        ({"min_p": 1.5}, ValueError, "min_p must be a number in [0.0, 1.0]"),
        ({"min_p": True}, TypeError, "min_p must be a number"),
        ({"logit_bias": {3: float("nan")}}, ValueError, "logit_bias[3] must be"),
        ({"logit_bias": {"3": 1.0}}, TypeError, "logit_bias key '3' must be an integer"),
        ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias key -1 must be"),
        ({"logit_bias": [1, 2]}, TypeError, "logit_bias must map token ids to biases"),
    ],
)
def test_bad_values_are_refused_when_built(kw: dict[str, object], error: type, text: str) -> None:
    with pytest.raises(error, match=text.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_out_of_vocab_bias_and_the_oracle_refuse_before_recording() -> None:
    llm = tiny_llm()
    with pytest.raises(ValueError, match=r"token_id\(s\) \[259\] in logit_bias contain"):
        tokens(llm, msgspec.structs.replace(GREEDY, logit_bias={259: 1.0, 3: 1.0}))
    assert len(llm.llm_engine.engine_core.tape) == 0
    oracle = LLM(model="oracle", tape=None)
    for kw in ({"min_p": 0.5}, {"logit_bias": {3: 1.0}}):
        with pytest.raises(ValueError, match=f"cannot honour {next(iter(kw))}"):
            oracle.generate([PROMPT], SamplingParams(max_tokens=4, **kw), use_tqdm=False)  # type: ignore[arg-type]
    assert len(oracle.llm_engine.engine_core.tape) == 0


def test_both_are_on_the_tape_and_replay(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "run.tape"
    llm = tiny_llm(tape=str(path))
    params = [
        msgspec.structs.replace(GREEDY, logit_bias={42: 3.0, 7: -1.0}),
        SamplingParams(max_tokens=8, temperature=2.0, seed=3, min_p=0.2, ignore_eos=True),
    ]
    llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    llm.close()
    tape = load_tape(str(path))
    assert tape.header.format_version == ev.FORMAT_VERSION >= 3  # format 3 added them
    added = [e for _, e in tape.events() if isinstance(e, ev.RequestAdded)]
    assert added[0].params.logit_bias == ((7, -1.0), (42, 3.0))
    assert added[1].params.min_p == 0.2
    result = verify(tape)
    assert result.ok, result.first_divergence
