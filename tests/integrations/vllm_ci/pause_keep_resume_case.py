# A scheduler test in vLLM's own style, for vLLM's tests/v1/core/ (copied there as
# test_tokentape_pause_keep_resume.py by tests/integrations/vllm_ci.py; the file name here
# keeps tokentape's own pytest from collecting it): a pause(mode="keep", clear_cache=True)
# and a resume under async scheduling must lose no token. vLLM 0.20-0.21 fail it (#42043):
# the reset's discard flag drops the first token after resume.
from collections import deque

import pytest
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test

PROMPT_LEN = 10
MAX_TOKENS = 24


def _token(req_id: str, position: int) -> int:
    """The fake model: the token it samples at a position of a request (no EOS)."""
    return 100 + (int(req_id) * 37 + position * 11) % 900


class _BatchQueueEngine:
    """EngineCore.step_with_batch_queue with a queue of 2 (async scheduling), its pause
    (keep, clear_cache) and resume, and the outputs each client was given."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.delivered: dict[str, list[int]] = {}

    def _run_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            end = before[req_id] + out.num_scheduled_tokens[req_id]
            is_chunk = self.scheduler.requests[req_id].is_prefill_chunk
            sampled.append([] if is_chunk else [_token(req_id, end)])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )

    def step(self) -> None:
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            self.queue.append((out, self._run_model(out)))
            if len(self.queue) < 2:
                return
        elif not self.queue:
            return
        out, model_output = self.queue.popleft()
        for eco in self.scheduler.update_from_output(out, model_output).values():
            for o in eco.outputs:
                self.delivered.setdefault(o.request_id, []).extend(o.new_token_ids)

    def pause_keep_and_clear_cache(self) -> None:
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL)
        while self.queue:  # drained: every step in flight is delivered
            self.step()
        self.scheduler.reset_prefix_cache(reset_running_requests=True)

    def resume(self) -> None:
        self.scheduler.set_pause_state(PauseState.UNPAUSED)


@pytest.mark.parametrize("pause_after_steps", [4, 9])
def test_pause_keep_resume_loses_no_token(pause_after_steps: int):
    scheduler = create_scheduler(async_scheduling=True)
    requests = create_requests(
        num_requests=2, num_tokens=PROMPT_LEN, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    for request in requests:
        scheduler.add_request(request)
    engine = _BatchQueueEngine(scheduler)
    for _ in range(pause_after_steps):
        engine.step()
    assert all(0 < len(engine.delivered.get(r.request_id, [])) < MAX_TOKENS for r in requests)

    engine.pause_keep_and_clear_cache()
    engine.resume()
    while scheduler.has_requests() or engine.queue:
        engine.step()

    for request in requests:
        expected = [_token(request.request_id, PROMPT_LEN + i) for i in range(MAX_TOKENS)]
        assert engine.delivered[request.request_id] == expected
