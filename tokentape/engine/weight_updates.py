"""Weight updates for RL loops, on `LLMEngine`: whole (`update_weights(weights)`) or chunked
as vLLM's native transfer (RFC #31848, #39212: `start_weight_update()`, `update_weights(chunk)`
per chunk, `finish_weight_update()`), each named by a weight version (vLLM #49040's
`weight_version`: given, or the update's number).

Every call is checked before anything is recorded, and a refused one changes nothing: the
engine must be paused with nothing in flight (a transfer spans the pause), a chunk's tensors
must be the model's by name and shape (the runner checks them and holds them, loading nothing
until the finish, so the old weights serve until then), and a transfer left open is refused
at `resume_generation`. On the tape: `WeightUpdateStarted`, a `WeightChunkReceived` per chunk
(names, shapes and SHA-256s; not the tensors) and `WeightsUpdated` with the final SHA-256 and
the version, from which the reducer derives the version every later token was computed with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokentape.errors import EngineDeadError
from tokentape.events import schema as ev
from tokentape.events.validation import check_str, short_repr, shown

if TYPE_CHECKING:
    from tokentape.engine.runners.base import ModelRunner, UpdatesWeights
    from tokentape.events.state import EngineState

MAX_VERSION_CHARS = 256  # a version is a label (a trainer's step), not a payload


def resolve_version(weight_version: object, number: int) -> str:
    """The version an update records: `weight_version` as a string (an int, a trainer's step,
    is taken as its decimal), or the update's number when None. "" is kept as it is (a
    version-3 tape's unnamed update, which the reducer also numbers)."""
    if weight_version is None:
        return str(number)
    if isinstance(weight_version, int) and not isinstance(weight_version, bool):
        return str(weight_version)
    if not isinstance(weight_version, str):
        raise TypeError(
            f"weight_version must be a string, an integer or None, got {shown(weight_version)}"
        )
    check_str("weight_version", weight_version)
    if len(weight_version) > MAX_VERSION_CHARS:
        raise ValueError(
            f"weight_version must be at most {MAX_VERSION_CHARS} characters, "
            f"got {len(weight_version)}: {short_repr(weight_version)}"
        )
    return weight_version


class WeightUpdates:
    """The weight-update calls of LLMEngine (a mixin: the engine's state changes only through
    its `_emit`, as every other call's)."""

    if TYPE_CHECKING:
        state: EngineState
        runner: ModelRunner
        weights_updater: UpdatesWeights | None
        _dead: str | None
        _emit: Callable[[ev.Event], None]

        def _recorded(self) -> contextlib.AbstractContextManager[None]: ...

    def get_weight_version(self) -> str:
        """The version of the weights serving now (vLLM #49040): "default" until an update."""
        return self.state.weight_version

    def update_weights(
        self, weights: object, weight_version: str | int | None = None
    ) -> str | None:
        """Load new weights (a state_dict or a checkpoint folder), for RL loops; or, inside a
        transfer (`start_weight_update`), check and hold one chunk of them.

        Allowed only while generation is paused with nothing in flight (after
        `pause_generation`); every tensor is checked before anything changes, so a refused
        update leaves the old weights serving. A whole update is recorded as WeightsUpdated
        with the new weights' SHA-256, which it returns, and `weight_version` (default: the
        update's number); a chunk as WeightChunkReceived (it returns None; its version is
        `finish_weight_update`'s). K/V already cached were computed with the old weights:
        pause with `clear_cache=True` to recompute them.
        """
        updater = self._check_can_update("update_weights")
        if self.state.weight_update_chunks is not None:
            if weight_version is not None:
                raise ValueError(
                    "update_weights: a chunk of a transfer takes no weight_version; "
                    "give it to finish_weight_update"
                )
            chunk = updater.stage_weights(weights)  # raises before anything is held
            with self._recorded():
                self._emit(
                    ev.WeightChunkReceived(self.state.step, chunk.names, chunk.shapes, chunk.hashes)
                )
            return None
        version = resolve_version(weight_version, self.state.num_weight_updates + 1)
        weights_id = updater.update_weights(weights)  # raises before any change on bad input
        with self._recorded():
            self._emit(ev.WeightsUpdated(self.state.step, weights_id, version))
        return weights_id

    def start_weight_update(self) -> None:
        """Open a chunked transfer (vLLM RFC #31848): `update_weights(chunk)` as many times as
        needed, then `finish_weight_update()`. The old weights serve until the finish."""
        self._check_can_update("start_weight_update")
        open_chunks = self.state.weight_update_chunks
        if open_chunks is not None:
            raise RuntimeError(
                "start_weight_update: a weight update is already open "
                f"({open_chunks} chunk(s) received); call finish_weight_update first"
            )
        with self._recorded():
            self._emit(ev.WeightUpdateStarted(self.state.step))

    def finish_weight_update(self, weight_version: str | int | None = None) -> str:
        """Load every chunk of the open transfer at once and publish `weight_version`
        (default: the update's number); returns the new weights' SHA-256."""
        updater = self._check_can_update("finish_weight_update")
        if self.state.weight_update_chunks is None:
            raise RuntimeError(
                "finish_weight_update: no weight update is open (start_weight_update)"
            )
        version = resolve_version(weight_version, self.state.num_weight_updates + 1)
        weights_id = updater.load_staged_weights()
        with self._recorded():
            self._emit(ev.WeightsUpdated(self.state.step, weights_id, version))
        return weights_id

    def check_no_open_transfer(self, call: str) -> None:
        """Refuse `call` (resume_generation) while a chunked transfer is open: the model holds
        the old weights and the chunks wait for the finish."""
        chunks = self.state.weight_update_chunks
        if chunks is not None:
            raise RuntimeError(
                f"{call}: a weight update is open (start_weight_update, {chunks} chunk(s) "
                "received); call finish_weight_update first"
            )

    def _check_can_update(self, call: str) -> UpdatesWeights:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier and cannot continue: {self._dead}")
        if self.state.paused is None:
            raise RuntimeError(f"{call}: pause generation first (pause_generation(mode='keep'))")
        if self.state.in_flight_steps:
            raise RuntimeError(f"{call}: {len(self.state.in_flight_steps)} step(s) still in flight")
        if "weights" in self.state.sleeping_tags:  # offloaded or dropped (rl_calls.sleep)
            raise RuntimeError(f"{call}: the weights sleep; call wake_up(['weights']) first")
        if self.weights_updater is None:
            raise RuntimeError(f"{call}: model {self.runner.model_id!r} has no weights to update")
        return self.weights_updater
