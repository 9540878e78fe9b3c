"""Stop strings, as vLLM checks them: in the detokenized output text, after each frame, once
the output is longer than min_tokens. The engine core does it (vLLM's front end does), so
that the tape records the finish: the scheduler asks `StopStringChecker.find` after each
frame and records a match as `RequestFinished(reason="stop", stop_reason=<the string>)`.

The checker is also where such a request's text comes from: it decodes each token once, with
the incremental detokenizer the output processor would use, and releases the text as the
client may see it (`take_text`, carried by `EngineCoreOutput.new_text`):
- while the request runs, the last `len(longest stop) - 1` characters are held back (none
  with include_stop_str_in_output: nothing after a match can have been released), since a
  later frame may complete a stop string that begins there;
- at a match, the text is cut before the string (after it, with include_stop_str_in_output);
  the token ids stay as delivered (every token up to the finish, as in vLLM);
- at any other finish, everything decoded is released.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tokentape.engine.detokenizer import ByteDetokenizer, IncrementalDetokenizer, detokenizer
from tokentape.engine.tokenizer import Tokenizer
from tokentape.events.schema import StopStreamSnapshot
from tokentape.events.state import RequestState


def _earliest_match(text: str, start: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string whose first occurrence ending after `start` ends earliest (ties: the
    first in `stops`), with the index where it begins."""
    best: tuple[str, int] | None = None
    best_end = sys.maxsize
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and i + len(stop) < best_end:
            best, best_end = (stop, i), i + len(stop)
    return best


class _Stream:
    """One request's text: what was decoded, released and not yet taken."""

    __slots__ = (
        "detok",
        "fed",
        "tail",
        "keep",
        "hold",
        "num_chars",
        "num_released",
        "outbox",
        "finished",
    )

    def __init__(
        self, detok: IncrementalDetokenizer | ByteDetokenizer, stops: Sequence[str], include: bool
    ) -> None:
        self.detok = detok
        self.fed = 0  # output tokens decoded
        # A match ending in new text begins at most len(stop) - 1 characters before it.
        self.keep = max(map(len, stops)) - 1
        self.hold = 0 if include else self.keep
        self.tail = ""  # the last `keep` characters decoded
        self.num_chars = 0  # characters decoded
        self.num_released = 0  # characters released to the client
        self.outbox = ""  # released, not yet taken
        self.finished = False  # the text is final (a match cut it, or the request finished)

    def push(self, piece: str, release_to: int | None = None) -> None:
        """Add decoded text; release up to `release_to` (default: all but the holdback)."""
        text = self.tail + piece
        base = self.num_chars - len(self.tail)  # where `text` begins in the whole text
        self.num_chars += len(piece)
        end = min(self.num_chars - self.hold if release_to is None else release_to, self.num_chars)
        if end > self.num_released:
            self.outbox += text[self.num_released - base : end - base]
            self.num_released = end
        self.tail = text[-self.keep :] if self.keep else ""


class StopStringChecker:
    """The engine core's stop-string matcher and the text of the requests it follows (see the
    module doc). One stream per request with stop strings, from its first frame to the
    `take_text` after its finish."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def _stream(self, req: RequestState) -> _Stream:
        st = self._streams.get(req.req_id)
        if st is None:
            params = req.params
            st = self._streams[req.req_id] = _Stream(
                detokenizer(self.tokenizer), params.stop, params.include_stop_str_in_output
            )
        return st

    def find(self, req: RequestState, end: int) -> str | None:
        """The stop string completed by the output tokens not decoded yet, up to `end` (the
        frame just applied, less what a stop the scheduler found cuts), or None. Text of the
        first min_tokens tokens cannot complete one."""
        st = self._stream(req)
        output, min_tokens = req.output_token_ids, req.params.min_tokens
        if st.fed < min_tokens < end:
            st.push(st.detok.add(output[st.fed : min_tokens], False))
            st.fed = min_tokens
        piece = st.detok.add(output[st.fed : end], False)
        st.fed = end
        if end <= min_tokens or not piece:
            st.push(piece)
            return None
        found = _earliest_match(st.tail + piece, len(st.tail), req.params.stop)
        if found is None:
            st.push(piece)
            return None
        stop, i = found
        cut = st.num_chars - len(st.tail) + i
        if req.params.include_stop_str_in_output:
            cut += len(stop)
        st.push(piece, release_to=cut)
        st.finished = True
        return stop

    def finish(self, req: RequestState) -> None:
        """The request finished (any reason, its output cut): release all of its text, the
        end of a character cut between tokens included, unless a match cut it already."""
        st = self._stream(req)
        if st.finished:
            return
        output = req.output_token_ids
        st.push(st.detok.add(output[st.fed :], True), release_to=sys.maxsize)
        st.fed = len(output)
        st.finished = True

    def has_streams(self) -> bool:
        """Whether any request's text is followed (a step without one takes no text)."""
        return bool(self._streams)

    def take_text(self, req_id: str) -> str | None:
        """The text released since the last take (None: a request not followed); a finished
        request's stream goes with it."""
        st = self._streams.get(req_id)
        if st is None:
            return None
        text, st.outbox = st.outbox, ""
        if st.finished:
            del self._streams[req_id]
        return text

    # -- snapshots (a segment of a segmented tape opens with one) -----------------------------

    def snapshot(self) -> list[StopStreamSnapshot]:
        snaps = []
        for req_id, st in self._streams.items():
            detok = st.detok
            if isinstance(detok, ByteDetokenizer):
                pending, _ = detok.utf8.getstate()
                offsets = (0, 0)
            else:
                pending, offsets = b"", (detok.prefix_offset, detok.read_offset)
            snaps.append(
                StopStreamSnapshot(
                    req_id,
                    st.fed,
                    st.tail,
                    st.num_chars,
                    st.num_released,
                    st.outbox,
                    st.finished,
                    detok.num_chars,
                    *offsets,
                    pending,
                )
            )
        return snaps

    def restore(self, snaps: list[StopStreamSnapshot], requests: dict[str, RequestState]) -> None:
        """Take the streams a snapshot holds; a detokenizer's tokens are the request's output
        up to what the stream decoded."""
        self._streams = {}
        for snap in snaps:
            req = requests.get(snap.req_id)
            if req is None:  # settled: its text was all taken
                continue
            st = self._stream(req)
            st.fed, st.tail, st.num_chars = snap.fed, snap.tail, snap.num_chars
            st.num_released, st.outbox, st.finished = snap.num_released, snap.outbox, snap.finished
            detok = st.detok
            detok.num_chars = snap.detok_chars
            if isinstance(detok, ByteDetokenizer):
                detok.utf8.setstate((snap.pending_bytes, 0))
            else:
                detok.tokens = list(req.output_token_ids[: snap.fed])
                detok.prefix_offset, detok.read_offset = snap.prefix_offset, snap.read_offset
