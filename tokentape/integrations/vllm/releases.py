"""The vLLM releases the recorder was taught, and what differs between them.

vLLM's scheduler kept its shape from 0.20 to 0.33; what changed is how its AsyncScheduler
throws away output that was in flight when a request was preempted, which is what a tape's
reducer must re-apply (its discard policy, in the tape's header):

- 0.20-0.21, before PR #42117: `Request.discard_latest_async_tokens`, a bool set by
  `reset_prefix_cache(reset_running_requests=True)` on every request it preempts; the next
  frame is dropped, stale or not (#42043). Policy `vllm-flag`.
- 0.22-0.26, #42117 until #48245: `Request.async_tokens_to_discard`, set to the output
  placeholders by the same reset and drained one frame at a time. Policy `vllm-counter`
  (0.22-0.24) and, once #46066 stopped a frame the counter drops from giving its rejected
  drafts back, `vllm-counter-guarded` (0.25-0.26).
- 0.27-0.33, since #48245: `_preempt_request(..., drop_stale_output)`; stale output is
  delivered uncounted, a reset's dropped. Policy `deliver`.

Preemption under KV pressure never touched the discard state before #48245; its stale frame
was applied, which vLLM's batch queue of depth 2 always does before the request can be
scheduled again (the policies say so). A taught release is recognised by its version, and
its code must agree: one whose scheduler does not look as its range says is refused by name
rather than recorded under the wrong semantics. A release outside the taught ranges (the
next one, or an older one) is recognised by its code alone: when its scheduler has a
mechanism the recorder knows, it is recorded under that mechanism's policy as an untaught
release (the recorder says so on stderr and in the tape's header, and checks every event
live against the fold of the tape); with none it is refused by name.

One bug of the engine core rather than the scheduler is a release's semantics too: before
#44483 (0.24), `EngineCore.wake_up(tags=["weights"])` resumed scheduling while the KV cache
still slept (#44395). A tape of such a release names the fault `resume_on_partial_wake` in
its config (`shipped_faults`, read from the code), so the reducer follows what vLLM did and
the postmortem names the steps scheduled on the sleeping KV cache.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass

from tokentape.integrations.vllm.mapping import UnsupportedByRecorder


@dataclass(frozen=True, slots=True)
class Release:
    """A range of vLLM releases with one discard mechanism."""

    first: tuple[int, int]  # (major, minor) of the first release, inclusive
    last: tuple[int, int]  # of the last release taught, inclusive (every patch release)
    discard_policy: str  # the reducer's policy that re-applies it
    mechanism: str  # what the recorder looks for in vLLM's code (mechanism_in)
    taught: bool = True  # False: a release outside the ranges, recognised by its code alone


_FLAG = "Request.discard_latest_async_tokens"
_COUNTER = "Request.async_tokens_to_discard"
_GUARDED = f"{_COUNTER}, with #46066's guard on rejected drafts"
_DELIVER = "Scheduler._preempt_request(..., drop_stale_output)"
RELEASES = (
    Release((0, 20), (0, 21), "vllm-flag", _FLAG),
    Release((0, 22), (0, 24), "vllm-counter", _COUNTER),
    Release((0, 25), (0, 26), "vllm-counter-guarded", _GUARDED),
    Release((0, 27), (0, 34), "deliver", _DELIVER),
)
TAUGHT = "{}.{}.0 to {}.{}.x".format(*RELEASES[0].first, *RELEASES[-1].last)

_VERSION = re.compile(r"(\d+)\.(\d+)")


def _minor(version: str) -> tuple[int, int]:
    match = _VERSION.match(version)
    if match is None:
        raise UnsupportedByRecorder(f"vLLM {version!r}: the recorder cannot read this version")
    return int(match.group(1)), int(match.group(2))


def release_of(version: str) -> Release | None:
    """The taught range holding `version` (e.g. "0.20.0", "0.32.0+cpu", "0.33.1rc1"); None
    for a release outside them."""
    minor = _minor(version)
    return next((r for r in RELEASES if r.first <= minor <= r.last), None)


def mechanism_in(scheduler_cls: type, request_cls: type) -> str | None:
    """The discard mechanism vLLM's code has, named as in RELEASES (None: none known)."""
    preempt = getattr(scheduler_cls, "_preempt_request", None)
    if preempt is not None and "drop_stale_output" in inspect.signature(preempt).parameters:
        return _DELIVER
    request_init = inspect.getsource(request_cls.__init__)
    if "self.discard_latest_async_tokens =" in request_init:
        return _FLAG
    if "self.async_tokens_to_discard =" in request_init:
        # #46066: the rejected-draft give-back in update_from_output waits for the counter.
        update = inspect.getsource(scheduler_cls.update_from_output)
        return _GUARDED if "async_tokens_to_discard == 0" in update else _COUNTER
    return None


def check_release(version: str, scheduler_cls: type, request_cls: type) -> Release:
    """The release the running vLLM is: a taught one whose code agrees with its version, or
    an untaught one (taught=False) whose code has a mechanism the recorder knows; refused
    otherwise."""
    release = release_of(version)
    found = mechanism_in(scheduler_cls, request_cls)
    if release is None:
        known = next((r for r in RELEASES if r.mechanism == found), None)
        if known is None:
            raise UnsupportedByRecorder(
                f"vLLM {version} is not a release the tokentape recorder was taught (it "
                f"records vLLM {TAUGHT}), and its scheduler has no discard mechanism the "
                "recorder knows"
            )
        return dataclasses.replace(known, taught=False)
    if found != release.mechanism:
        raise UnsupportedByRecorder(
            f"vLLM {version}: the recorder expects {release.mechanism} in this release, but its "
            f"scheduler has {found or 'no discard mechanism the recorder knows'}"
        )
    return release


def untaught_note(version: str, release: Release) -> str:
    """What the stderr line and the tape's header say of an untaught release."""
    return (
        f"untaught release: vLLM {version} is outside the releases the tokentape recorder was "
        f"taught ({TAUGHT}); its scheduler has {release.mechanism}, recorded under discard "
        f"policy {release.discard_policy}, every event checked live against the tape"
    )


def shipped_faults(engine_core_cls: type) -> list[str]:
    """The bugs of this release's engine core that its tapes' reducer must follow
    (tokentape.events.faults): `resume_on_partial_wake` where EngineCore.wake_up resumes
    scheduling whatever still sleeps (#44395, until #44483 made it wait for the executor to
    be fully awake: 0.24 on)."""
    wake_up = getattr(engine_core_cls, "wake_up", None)
    if wake_up is None or "is_sleeping" in inspect.getsource(wake_up):
        return []
    return ["resume_on_partial_wake"]
