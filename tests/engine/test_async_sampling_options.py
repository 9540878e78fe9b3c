"""AsyncLLM with n > 1: cancelling or aborting the request aborts every child on the tape, and
a refused one records nothing. (That its outputs equal LLM's and the server's, every output
kind, is tests/engine/test_output_parity.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokentape import SamplingParams
from tokentape.engine.async_llm import AsyncLLM
from tokentape.events import schema as ev

PROMPT = [5, 6, 7]


@pytest.mark.parametrize("how", ["cancel", "abort"])
def test_cancel_or_abort_of_n_above_one_aborts_every_child(how: str) -> None:
    params = SamplingParams(max_tokens=400, n=3, seed=1, ignore_eos=True)

    async def main() -> tuple[list[Any], Any]:
        engine = AsyncLLM(model="oracle", tape=None, multiprocess_mode=False)
        gen = engine.generate(PROMPT, params, "r")
        got = [await gen.__anext__()]
        if how == "cancel":
            await gen.aclose()
        else:
            await engine.abort("r")
            got += [o async for o in gen]
        assert engine.num_unfinished_requests == 0
        core = engine.engine_core.core  # type: ignore[attr-defined]
        for _ in range(200):  # the core loop takes the abort at its next turn
            if not core.engine_core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        events = [e for _, e in core.engine_core.tape.iter_events()]
        engine.shutdown()
        return got, events

    got, events = asyncio.run(main())
    aborted = sorted(e.req_id for e in events if isinstance(e, ev.RequestAborted))
    assert aborted == ["0_r", "1_r", "2_r"]
    if how == "abort":
        assert got[-1].finished
        reasons = {c.index: c.finish_reason for o in got for c in o.outputs}
        assert reasons == {0: "abort", 1: "abort", 2: "abort"}


def test_a_refused_n_above_one_records_nothing() -> None:
    async def main() -> None:
        with AsyncLLM(model="oracle", tape=None, multiprocess_mode=False) as engine:
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), "1_r"):
                pass
            core = engine.engine_core.core  # type: ignore[attr-defined]
            before = len(core.engine_core.tape)
            with pytest.raises(ValueError, match="child id '1_r'"):
                async for _ in engine.generate(PROMPT, SamplingParams(n=2), "r"):
                    pass
            assert len(core.engine_core.tape) == before
            with pytest.raises(ValueError, match="cannot honour min_tokens"):
                async for _ in engine.generate(PROMPT, SamplingParams(n=2, min_tokens=1), "s"):
                    pass
            assert len(core.engine_core.tape) == before and engine.num_unfinished_requests == 0

    asyncio.run(main())
