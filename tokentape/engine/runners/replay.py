"""The replay runner: returns the frames recorded on a tape, so no model is needed."""

from __future__ import annotations

from tokentape.engine.runners.base import ScheduledBatch
from tokentape.events.schema import FrameEntry, FrameProduced


class MissingFrameError(LookupError):
    """The replayed scheduler asked for a step the tape has no frame for."""


class ReplayRunner:
    def __init__(self, frames: dict[int, FrameProduced], model_id: str, eos_token_id: int | None,
                 vocab_size: int) -> None:
        self._frames = frames
        self.model_id = model_id
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def submit(self, batch: ScheduledBatch) -> None:
        pass

    def collect(self, step: int) -> list[FrameEntry]:
        try:
            return self._frames.pop(step).entries
        except KeyError:
            raise MissingFrameError(f"the tape holds no frame for step {step}") from None

    def close(self) -> None:
        pass
