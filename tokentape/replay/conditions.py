"""Expressions over the derived state, for the debugger's `break`, `watch` and `print`.

A small, safe subset of Python: names, constants, comparisons, `and`/`or`/`not`, arithmetic
and `in` over tuples or lists; no calls, attributes or subscripts. What an expression may
build is bounded (MAX_TEXT, MAX_LENGTH, MAX_INT_BITS), so it cannot exhaust memory or time.
Names are either engine-level (one value) or request-level; an expression that names a
request-level field is evaluated once per request, and as a condition it holds when it holds
for any request.

Request-level names: req, status, discard, placeholders, computed, epoch, preemptions,
output, prompt, emitted, dropped, in_flight, stale, fresh, partial, blocks, finished,
finish_reason, arrival.
Engine-level names: step, paused, waiting, running, steps_in_flight, resets, weights,
events, error, requests.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

from tokentape.events.discard import discard_count
from tokentape.events.state import EngineState, RequestState

REQUEST_NAMES: dict[str, Callable[[EngineState, RequestState], Any]] = {
    "req": lambda s, r: r.req_id,
    "status": lambda s, r: r.status.value,
    "discard": lambda s, r: discard_count(s, r),
    "placeholders": lambda s, r: r.num_output_placeholders,
    "computed": lambda s, r: r.num_computed_tokens,
    "epoch": lambda s, r: r.epoch,
    "preemptions": lambda s, r: r.num_preemptions,
    "output": lambda s, r: len(r.output_token_ids),
    "prompt": lambda s, r: r.num_prompt_tokens,
    "emitted": lambda s, r: r.num_emitted,
    "dropped": lambda s, r: r.num_frames_dropped,
    "in_flight": lambda s, r: r.num_in_flight,
    "stale": lambda s, r: r.num_stale_in_flight,
    "fresh": lambda s, r: r.num_fresh_in_flight,
    "partial": lambda s, r: r.num_partial_in_flight,
    "blocks": lambda s, r: len(r.block_ids),
    "finished": lambda s, r: r.is_finished,
    "finish_reason": lambda s, r: r.finish_reason,
    "arrival": lambda s, r: r.arrival_step,
}

ENGINE_NAMES: dict[str, Callable[[EngineState], Any]] = {
    "step": lambda s: s.step,
    "paused": lambda s: s.paused,
    "waiting": lambda s: len(s.waiting),
    "running": lambda s: len(s.running),
    "steps_in_flight": lambda s: len(s.in_flight_steps),
    "resets": lambda s: s.num_prefix_cache_resets,
    "weights": lambda s: s.weights_id,
    "events": lambda s: s.num_events,
    "error": lambda s: s.error,
    "requests": lambda s: len(s.requests),
}

ALL_NAMES = sorted({*REQUEST_NAMES, *ENGINE_NAMES, "True", "False", "None"})

_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.In,
    ast.NotIn,
    ast.Is,
    ast.IsNot,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Tuple,
    ast.List,
)


# What an expression may build: its own text is bounded, and every arithmetic operation is
# checked before it runs (an expression has no loops, so these also bound its time).
MAX_TEXT = 1000  # characters
MAX_LENGTH = 1 << 16  # elements of a string, list or tuple
MAX_INT_BITS = 1024


class ExpressionError(ValueError):
    """An expression that cannot be parsed, uses a construct or name it may not, or fails."""


def _size(value: Any) -> int | None:
    """The length of a sequence an operation may grow, or None for a number."""
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _too_big(what: str) -> ExpressionError:
    return ExpressionError(
        f"{what}: an expression may build at most {MAX_LENGTH} elements and "
        f"integers of at most {MAX_INT_BITS} bits"
    )


def _mult(a: Any, b: Any) -> Any:
    sa, sb = _size(a), _size(b)
    if sa is not None or sb is not None:  # repetition: the result's length is known up front
        n = b if sa is not None else a
        if isinstance(n, int) and (sa if sa is not None else sb or 0) * max(n, 0) > MAX_LENGTH:
            raise _too_big(f"repeating a sequence {n} times")
    elif (
        isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS
    ):
        raise _too_big("a product this large")
    return a * b


def _add(a: Any, b: Any) -> Any:
    sa, sb = _size(a), _size(b)
    if sa is not None and sb is not None and sa + sb > MAX_LENGTH:
        raise _too_big("joining these sequences")
    return a + b


def _mod(a: Any, b: Any) -> Any:
    if isinstance(a, (str, bytes)):  # '%0999999999d' % 1 builds a gigabyte
        raise ExpressionError("string formatting with % is not allowed in an expression")
    return a % b


# BinOp nodes become calls of these checked operations; the others cannot grow a value.
_CHECKED = {ast.Mult: "__mult__", ast.Add: "__add__", ast.Mod: "__mod__"}
_GLOBALS: dict[str, Any] = {"__builtins__": {}, "__mult__": _mult, "__add__": _add, "__mod__": _mod}


class _Checked(ast.NodeTransformer):
    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        name = _CHECKED.get(type(node.op))
        if name is None:
            return node
        return ast.copy_location(
            ast.Call(ast.Name(name, ast.Load()), [node.left, node.right], []), node
        )


class StateExpression:
    """A compiled expression; `per_request` when it names a request-level field."""

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        if not self.text:
            raise ExpressionError("empty expression")
        if len(self.text) > MAX_TEXT:
            raise ExpressionError(
                f"the expression is {len(self.text)} characters long; at most "
                f"{MAX_TEXT} are allowed"
            )
        try:
            tree = ast.parse(self.text, mode="eval")
        except SyntaxError as exc:
            raise ExpressionError(f"cannot parse {self.text!r}: {exc.msg}") from None
        names: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, _ALLOWED):
                raise ExpressionError(
                    f"{type(node).__name__} is not allowed in {self.text!r} "
                    "(only names, constants, comparisons, and/or/not and arithmetic)"
                )
            if isinstance(node, ast.Name) and node.id not in ("True", "False", "None"):
                if node.id not in REQUEST_NAMES and node.id not in ENGINE_NAMES:
                    raise ExpressionError(
                        f"unknown name {node.id!r} in {self.text!r} (strings need quotes; names: "
                        f"{', '.join(n for n in ALL_NAMES if n not in ('True', 'False', 'None'))})"
                    )
                names.add(node.id)
        checked = ast.fix_missing_locations(_Checked().visit(tree))
        self._code = compile(checked, "<expression>", "eval")
        self.request_names = sorted(names & REQUEST_NAMES.keys())
        self.engine_names = sorted(names & ENGINE_NAMES.keys())
        self.per_request = bool(self.request_names)

    def _eval(self, scope: dict[str, Any]) -> Any:
        try:
            return eval(self._code, _GLOBALS, scope)
        except ExpressionError:
            raise
        except (
            TypeError,
            ValueError,
            ArithmeticError,
            MemoryError,
            RecursionError,
        ) as exc:  # e.g. None > 0, 1 / 0
            raise ExpressionError(f"{self.text!r} failed: {type(exc).__name__}: {exc}") from None

    def _engine_scope(self, state: EngineState) -> dict[str, Any]:
        return {name: ENGINE_NAMES[name](state) for name in self.engine_names}

    def value(self, state: EngineState) -> Any:
        """The value: one for an engine-level expression, {req_id: value} per request."""
        scope = self._engine_scope(state)
        if not self.per_request:
            return self._eval(scope)
        return {r.req_id: self.value_for(state, r, scope) for r in state.requests.values()}

    def value_for(
        self, state: EngineState, req: RequestState, scope: dict[str, Any] | None = None
    ) -> Any:
        scope = dict(scope if scope is not None else self._engine_scope(state))
        for name in self.request_names:
            scope[name] = REQUEST_NAMES[name](state, req)
        return self._eval(scope)

    def holds_for(self, state: EngineState, req_ids: list[str] | None = None) -> set[str]:
        """Requests (among `req_ids`, default all) for which the condition holds; for an
        engine-level condition, {""} when it holds."""
        scope = self._engine_scope(state)
        if not self.per_request:
            return {""} if self._eval(scope) else set()
        requests = state.requests
        ids = req_ids if req_ids is not None else list(requests)
        return {r for r in ids if r in requests and self.value_for(state, requests[r], scope)}
