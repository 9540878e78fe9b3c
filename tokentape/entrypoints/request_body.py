"""A request's JSON body, decoded into its schema (protocol.py) with errors a client can act on.

Malformed JSON is a 400 that says what is wrong (a lone UTF-16 surrogate, which msgspec
reports as "Input data was truncated", is named as such); a body of the wrong shape is a 422
naming the field. Depth is bounded: every field of the schema is typed at most two levels
deep, so a deeper value is refused as it is decoded, and an unknown field (skipped, never
kept) nested past the interpreter's recursion limit is a 400 instead of a RecursionError.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from tokentape.entrypoints.refusals import APIError

T = TypeVar("T")

# A \\uD800-\\uDBFF escape not followed by a \\uDC00-\\uDFFF one, or the latter alone.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)
_KEY_BEFORE = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]*)"\s*:')


def decode_body(data: bytes, body_type: type[T]) -> T:
    """The JSON body as `body_type`: malformed JSON is a 400, a body of the wrong shape a 422."""
    try:
        return msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as exc:
        raise APIError(
            422, f"invalid request body: {exc}", param=param_of_validation(str(exc))
        ) from None
    except msgspec.DecodeError as exc:
        lone = _LONE_SURROGATE.search(data)
        if lone is not None:
            raise APIError(
                400,
                lone_surrogate_message(data, lone.start()),
                param=key_before(data, lone.start()),
            ) from None
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(
            400,
            "the request body is nested too deeply (JSON arrays and objects "
            "inside each other past the server's recursion limit)",
        ) from None


def lone_surrogate_message(data: bytes, at: int) -> str:
    escape = data[at : at + 6].decode("ascii")
    return (
        f"the request body holds a lone UTF-16 surrogate ({escape} at byte {at}): a string "
        "must be valid Unicode text, and half of a surrogate pair is not"
    )


def key_before(data: bytes, at: int) -> str | None:
    """The name of the last key before byte `at`: the field holding the bad string, mostly."""
    keys = _KEY_BEFORE.findall(data, 0, at)
    return keys[-1].decode("ascii") if keys else None


def param_of_validation(message: str) -> str | None:
    """msgspec names the bad field as `$.field`; OpenAI's `param` is the field's name."""
    at = message.rfind("`$.")
    if at >= 0:
        return message[at + 3 : message.index("`", at + 1)].split("[")[0].split(".")[0]
    missing = message.find("missing required field `")
    if missing >= 0:
        start = missing + len("missing required field `")
        return message[start : message.index("`", start)]
    return None
