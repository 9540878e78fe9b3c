"""vLLM's sampling options on the tiny model: each changes the stream as vLLM's does, is
recorded on the tape, and replays (verify) from the tape alone."""

from __future__ import annotations

import msgspec
import pytest
import torch
from dense_reference import dense_logits

from tokentape import LLM, SamplingParams
from tokentape.engine.model.loader import builtin_model
from tokentape.events import schema as ev
from tokentape.replay import verify
from tokentape.replay.tape import load_tape

PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tiny_llm(**kw: object) -> LLM:
    args: dict[str, object] = {
        "model": "tiny",
        "device": "cpu",
        "tape": None,
        "block_size": 4,
        "num_kv_blocks": 128,
    }
    args.update(kw)
    return LLM(**args)  # type: ignore[arg-type]


def tokens(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def reference_penalised_greedy(
    prompt: list[int], n: int, rep: float, freq: float, pres: float
) -> list[int]:
    """The penalties written out per token in float64, independently of the engine's code."""
    _, model = builtin_model("tiny", 0)
    out: list[int] = []
    for _ in range(n):
        logits = dense_logits(model, prompt + out)[-1].double()
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=1.5),
        dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4),
    ],
)
def test_penalties_change_greedy_and_equal_a_reference(penalties: dict[str, float]) -> None:
    llm = tiny_llm(max_num_batched_tokens=8, num_speculative_tokens=2)  # chunks and drafts too
    plain = tokens(llm, GREEDY)
    got = tokens(llm, msgspec.structs.replace(GREEDY, **penalties))
    assert got != plain
    want = reference_penalised_greedy(
        PROMPT,
        10,
        penalties.get("repetition_penalty", 1.0),
        penalties.get("frequency_penalty", 0.0),
        penalties.get("presence_penalty", 0.0),
    )
    assert got == want


def test_min_tokens_holds_back_the_stop_token() -> None:
    llm = tiny_llm()
    first = tokens(llm, GREEDY)[0]
    stop_at_first = msgspec.structs.replace(GREEDY, stop_token_ids=(first,))
    assert tokens(llm, stop_at_first) == [first]
    out = llm.generate(
        [PROMPT], msgspec.structs.replace(stop_at_first, min_tokens=4), use_tqdm=False
    )[0]
    got = out.outputs[0].token_ids
    assert len(got) >= 4 and first not in got[:3]  # masked for the first min_tokens - 1 positions
    assert out.outputs[0].finish_reason == ("stop" if got[-1] == first else "length")


def test_bad_words_never_appear() -> None:
    llm = tiny_llm(num_speculative_tokens=2)
    plain = tokens(llm, GREEDY)
    one = plain[1]
    got = tokens(llm, msgspec.structs.replace(GREEDY, bad_words=[[one]]))
    assert one not in got and got[0] == plain[0]
    # A two-token word: its last token is banned only right after its first.
    a, b = plain[0], plain[1]
    got = tokens(llm, msgspec.structs.replace(GREEDY, bad_words=[[a, b]]))
    assert all(not (x == a and y == b) for x, y in zip([PROMPT[-1], *got], got))
    assert got != plain


def test_n_gives_n_seeded_streams_equal_to_separate_requests() -> None:
    llm = tiny_llm()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    out = llm.generate([PROMPT], msgspec.structs.replace(params, n=3), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    streams = [c.token_ids for c in out[0].outputs]
    assert len({tuple(s) for s in streams}) == 3
    # vLLM's children: "{i}_{id}" with seed + i, each recorded as an ordinary request.
    parent = out[0].request_id
    added = [
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.RequestAdded)
    ]
    assert [(e.req_id, e.params.seed, e.params.n) for e in added] == [
        (f"{i}_{parent}", 11 + i, 1) for i in range(3)
    ]
    alone = [tokens(llm, msgspec.structs.replace(params, seed=11 + i)) for i in range(3)]
    assert alone == streams


def test_n_without_a_seed_still_gives_distinct_streams() -> None:
    out = tiny_llm().generate(
        [PROMPT], SamplingParams(max_tokens=8, n=2, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids != out[0].outputs[1].token_ids


def test_top_k_logprobs_are_sorted_and_hold_the_sampled_token() -> None:
    _, model = builtin_model("tiny", 0)
    llm = tiny_llm()
    c = llm.generate(
        [PROMPT],
        msgspec.structs.replace(GREEDY, temperature=1.0, seed=2, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
    for i, (tok, d) in enumerate(zip(c.token_ids, c.top_logprobs)):
        # vLLM's dict: the sampled token first, then the top 3 (it may be one of them).
        assert next(iter(d)) == tok and d[tok] == pytest.approx(c.logprobs[i])
        want = dense_logits(model, PROMPT + c.token_ids[:i])[-1].log_softmax(-1).topk(3)
        assert set(d) == {tok, *want.indices.tolist()}
    frames = [
        f
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.FrameProduced)
        for f in e.entries
    ]
    for f in frames:  # on the tape: per token, the k best ids and logprobs, best first
        assert f.top_token_ids is not None and f.top_logprobs is not None
        for ids, lps in zip(f.top_token_ids, f.top_logprobs):
            assert len(ids) == 3 and lps == sorted(lps, reverse=True)


def first_new_pair(llm: LLM, toks: list[int]) -> tuple[int, str]:
    """(j, text of toks[j:j+2]) for the first two tokens of one byte each whose text does not
    occur earlier in the stream's text."""
    text = llm.tokenizer.decode(toks)
    for j in range(len(toks) - 1):
        if all(35 <= t < 130 for t in toks[: j + 2]):
            pair = llm.tokenizer.decode(toks[j : j + 2])
            if text.find(pair) == j:
                return j, pair
    raise AssertionError(f"no printable pair in {toks}")


def test_stop_strings_cut_the_text_and_are_recorded() -> None:
    llm = tiny_llm()
    plain = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    j, stop = first_new_pair(llm, plain.token_ids)
    for include in (False, True):
        p = msgspec.structs.replace(GREEDY, stop=[stop], include_stop_str_in_output=include)
        c = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == plain.token_ids[: j + 2]  # every token up to the one completing it
        head = llm.tokenizer.decode(plain.token_ids[:j])
        assert c.text == (head + stop if include else head)
    finished = [
        e
        for _, e in llm.llm_engine.engine_core.tape.iter_events()
        if isinstance(e, ev.RequestFinished)
    ]
    assert finished[-1].stop_reason == stop and finished[-1].reason == "stop"
    assert llm.llm_engine.engine_core.state.requests[finished[-1].req_id].stop_reason == stop


def test_a_tape_with_every_option_verifies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "options.tape"
    llm = tiny_llm(tape=str(path), num_speculative_tokens=2, max_num_batched_tokens=8)
    plain = tokens(llm, GREEDY)
    stop = first_new_pair(llm, plain)[1]
    params = [
        msgspec.structs.replace(
            GREEDY, repetition_penalty=1.2, frequency_penalty=0.2, presence_penalty=0.1
        ),
        msgspec.structs.replace(
            GREEDY, stop=[stop], min_tokens=2, bad_words=[[plain[0], plain[1]]]
        ),
        SamplingParams(max_tokens=6, temperature=0.8, seed=4, n=3, logprobs=2, ignore_eos=True),
        msgspec.structs.replace(GREEDY, stop=[stop], include_stop_str_in_output=True),
    ]
    llm.generate([PROMPT, PROMPT, [40, 41, 42], PROMPT], params, use_tqdm=False)
    llm.close()
    tape = load_tape(str(path))
    assert tape.header.format_version == ev.FORMAT_VERSION >= 3  # format 3 added them
    result = verify(tape)
    assert result.ok, result.first_divergence
    state = tape.fold()
    assert state.requests["4"].stop_reason == stop
    assert all(
        len(r.output_top_logprobs) == len(r.output_token_ids)
        for i, r in state.requests.items()
        if i.endswith("_3")
    )


def test_a_tampered_stop_finish_fails_verify(tmp_path) -> None:  # type: ignore[no-untyped-def]
    llm = tiny_llm()
    stop = first_new_pair(llm, tokens(llm, GREEDY))[1]
    llm.generate([PROMPT], msgspec.structs.replace(GREEDY, stop=[stop, "zz"]), use_tqdm=False)
    from tokentape.events.store import MemoryTape

    events = [e for _, e in llm.llm_engine.engine_core.tape.iter_events()]
    i = next(i for i, e in enumerate(events) if isinstance(e, ev.RequestFinished) and e.stop_reason)
    events[i] = msgspec.structs.replace(events[i], stop_reason="zz")  # a string the text lacks
    forged = MemoryTape(llm.llm_engine.engine_core.tape.header)
    for e in events:
        forged.append(e)
    assert not verify(forged).ok


def test_batched_processors_give_each_row_the_bits_it_gets_alone() -> None:
    """The penalties run as torch ops over the batch; a row's result must not depend on the
    other rows (batch invariance: a recomputed position is adjusted the same way)."""
    import random

    from tokentape.engine.model.logits_processors import RowContext, apply_logits_processors

    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 259, generator=gen) * 4
    rows: list[RowContext | None] = []
    for i in range(9):
        params = SamplingParams(
            presence_penalty=rng.uniform(-2, 2),
            frequency_penalty=rng.uniform(-2, 2),
            repetition_penalty=rng.uniform(0.5, 2),
            min_tokens=rng.choice([0, 50]),
            max_tokens=64,
            bad_words=[[7], [8, 9]] if i % 2 else [],
        )
        toks = [rng.randrange(3, 40) for _ in range(rng.randint(2, 30))]
        rows.append(
            None if i == 4 else RowContext(params, (1, 12), toks, rng.randint(1, len(toks)))
        )
    batched = apply_logits_processors(logits, rows)
    assert torch.equal(batched[4], logits[4])
    for i, ctx in enumerate(rows):
        alone = apply_logits_processors(logits[i : i + 1], [ctx])
        assert torch.equal(batched[i], alone[0]), i
