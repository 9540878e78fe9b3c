"""Shrinking a storm spec that fails into the smallest one that still fails the same way:
delta debugging (Zeller's ddmin) over its requests and its commands, then each number made as
small as it can be (Hypothesis shrinks integers so): a request's max_tokens, prompt length
and arrival step, a command's step, the draft count. Every pass keeps only changes that still
fail, and the passes repeat until none helps.

    minimal = shrink_spec(spec, still_fails, deadline=time.perf_counter() + 60)

`still_fails(candidate)` runs a candidate and says whether it gives the finding being
shrunk; it is called at most once per distinct candidate. Past `deadline` (perf_counter
seconds) no more candidates are tried and the smallest so far is returned.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any

Spec = dict[str, Any]
COMMAND_KEYS = ("reset_at", "pause_at", "abort_at", "sleep_at", "wake_at")


class _Tester:
    def __init__(self, still_fails: Callable[[Spec], bool], deadline: float) -> None:
        self.still_fails, self.deadline = still_fails, deadline
        self.seen: dict[str, bool] = {}

    def __call__(self, spec: Spec) -> bool:
        key = json.dumps(spec, sort_keys=True)
        if key not in self.seen:
            if time.perf_counter() > self.deadline:
                return False
            self.seen[key] = self.still_fails(spec)
        return self.seen[key]


def _ddmin(items: list[Any], fails: Callable[[list[Any]], bool], keep_one: bool) -> list[Any]:
    """A 1-minimal sublist of `items` that still fails (one that fails with any single item
    removed no longer does); `keep_one`: never the empty list."""
    if not keep_one and items and fails([]):
        return []
    n = 2
    while len(items) >= 2:
        size = -(-len(items) // n)
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        for i in range(len(chunks)):
            rest = [x for j, c in enumerate(chunks) if j != i for x in c]
            if fails(rest):
                items, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    if len(items) == 1 and not keep_one and fails([]):
        return []
    return items


def _smallest(current: int, lowest: int, fails: Callable[[int], bool]) -> int:
    """The smallest value in [lowest, current] that still fails, found by bisection (as if
    failing were monotone; `current` is known to fail)."""
    if current <= lowest or fails(lowest):
        return lowest if current > lowest else current
    bad, good = lowest, current
    while good - bad > 1:
        mid = (bad + good) // 2
        if fails(mid):
            good = mid
        else:
            bad = mid
    return good


def _commands(spec: Spec) -> list[tuple[str, Any]]:
    return [(k, item) for k in COMMAND_KEYS for item in spec.get(k, ())]


def _with_commands(spec: Spec, commands: list[tuple[str, Any]]) -> Spec:
    out = {**spec, **{k: [] for k in COMMAND_KEYS if k in spec}}  # a spec keeps its keys
    for k, item in commands:
        out[k].append(item)
    return out


def _with_requests(spec: Spec, requests: list[Spec]) -> Spec:
    ids = {r["id"] for r in requests}
    out = {**spec, "requests": requests}
    out["abort_at"] = [a for a in spec.get("abort_at", ()) if a[1] in ids]
    return out


def _step_of(item: Any) -> int:
    return int(item if isinstance(item, int) else item[0])


def _with_step(item: Any, step: int) -> Any:
    return step if isinstance(item, int) else [step, *item[1:]]


def shrink_spec(
    spec: Spec, still_fails: Callable[[Spec], bool], deadline: float = float("inf")
) -> Spec:
    """The smallest spec found that still fails (see the module); `spec` must fail."""
    test = _Tester(still_fails, deadline)
    best = copy.deepcopy(spec)
    while True:
        before = json.dumps(best, sort_keys=True)
        best = _with_requests(
            best,
            _ddmin(best["requests"], lambda rs, b=best: test(_with_requests(b, rs)), True),
        )
        best = _with_commands(
            best,
            _ddmin(_commands(best), lambda cs, b=best: test(_with_commands(b, cs)), False),
        )
        best = _shrink_numbers(best, test)
        if json.dumps(best, sort_keys=True) == before or time.perf_counter() > deadline:
            return best


def _set_request(spec: Spec, i: int, name: str, value: Any) -> Spec:
    requests = list(spec["requests"])
    requests[i] = {**requests[i], name: value}
    return {**spec, "requests": requests}


def _set_command(spec: Spec, key: str, i: int, item: Any) -> Spec:
    items = list(spec[key])
    items[i] = item
    return {**spec, key: items}


def _shrink_numbers(best: Spec, test: Callable[[Spec], bool]) -> Spec:
    """Each request's and command's numbers, and the drafts, as small as still fails."""
    for i in range(len(best["requests"])):
        for name, lowest in (("add_at", 0), ("max_tokens", 1)):
            value = _smallest(
                best["requests"][i].get(name, 0),
                lowest,
                lambda v, b=best, i=i, name=name: test(_set_request(b, i, name, v)),
            )
            best = _set_request(best, i, name, value)
        prompt = best["requests"][i]["prompt"]
        length = _smallest(
            len(prompt),
            1,
            lambda n, b=best, i=i, p=prompt: test(_set_request(b, i, "prompt", p[:n])),
        )
        best = _set_request(best, i, "prompt", prompt[:length])
    for key in COMMAND_KEYS:
        for i in range(len(best.get(key, ()))):
            item = best[key][i]
            step = _smallest(
                _step_of(item),
                0,
                lambda s, b=best, k=key, i=i, it=item: test(
                    _set_command(b, k, i, _with_step(it, s))
                ),
            )
            best = _set_command(best, key, i, _with_step(item, step))
            quiet = [step, item[1], False]  # a pause without clear_cache, if that still fails
            if key == "pause_at" and item[2] and test(_set_command(best, key, i, quiet)):
                best = _set_command(best, key, i, quiet)
    k = best.get("num_speculative_tokens", 0)
    k = _smallest(k, 0, lambda v, b=best: test({**b, "num_speculative_tokens": v}))
    return {**best, "num_speculative_tokens": k}
