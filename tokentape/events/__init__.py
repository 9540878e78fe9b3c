"""Events, tape stores and the reducer: the event-sourced core of tokentape."""

from tokentape.events.fold_errors import ReducerError
from tokentape.events.reducer import evolve, fold_events, initial_state
from tokentape.events.schema import FORMAT_VERSION, SamplingParams, TapeHeader
from tokentape.events.state import EngineState, RequestState, RequestStatus
from tokentape.events.store import MemoryTape, NullTape, TapeError, TapeFormatError

__all__ = [
    "FORMAT_VERSION",
    "EngineState",
    "MemoryTape",
    "NullTape",
    "ReducerError",
    "RequestState",
    "RequestStatus",
    "SamplingParams",
    "TapeError",
    "TapeFormatError",
    "TapeHeader",
    "evolve",
    "fold_events",
    "initial_state",
]
