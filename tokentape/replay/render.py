"""Text for people: one-line event summaries, an output that uses rich on a terminal, and
the views of the derived state that `tokentape inspect` and the debugger share.

The debugger, `diff` and `replay whatif` print through `Output`, `inspect` through
`PlainView` or `RichView`: tables and colour with rich when the stream is a terminal, plain
text (what tests assert on) when it is piped.

Everything a tape holds (request ids, error messages, paths) is data from a file that may
have been crafted: `safe_text` is applied to all text on its way to a terminal or a plain-text
stream, by every renderer (Output, inspect's views, the postmortem's report, the CLI's error
line), so an escape sequence in a request id cannot drive the terminal. JSON output is not
passed through it: JSON escapes control characters itself and must stay exact.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, ClassVar, TextIO

from tokentape.events import schema as ev
from tokentape.events.discard import discard_count
from tokentape.progress import is_terminal

_MAX_TOKENS_SHOWN = 8
# C0 controls but tab and newline (ESC starts every terminal escape sequence), DEL, C1 controls
# (CSI and OSC have one-byte forms there), and invisible or direction-changing format
# characters (zero-width, bidirectional overrides and isolates, BOM) that make text read
# other than it is.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escaped(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def plural(n: int, noun: str) -> str:
    """'1 request', '2 requests', '0 warnings'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def safe_text(text: str) -> str:
    """`text` with every character that could control a terminal written as its escape
    (ESC as \\x1b, U+202E as \\u202e); tabs and newlines are kept."""
    return _UNSAFE.sub(_escaped, text)


def _tokens(ids: Sequence[int]) -> str:
    if len(ids) <= _MAX_TOKENS_SHOWN:
        return "[" + ", ".join(map(str, ids)) + "]"
    return "[" + ", ".join(map(str, ids[:_MAX_TOKENS_SHOWN])) + f", ... {len(ids)} tokens]"


class SafeWriter:
    """A text stream's `write`, through safe_text: for renderers that write piece by piece."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(safe_text(text))


def describe_event(event: ev.Event) -> str:
    """A one-line summary of an event: its kind, step and what it says per request."""
    kind = ev.kind_of(event)
    match event:
        case ev.RequestAdded(req_id=r, prompt_token_ids=p, params=params, lora_int_id=lora):
            body = f"req={r} prompt={len(p)} tokens max_tokens={params.max_tokens}"
            body += f" lora={lora}" if lora else ""
        case ev.RequestAborted(req_id=r):
            body = f"req={r}"
        case ev.RequestFinished(req_id=r, reason=reason):
            body = f"req={r} reason={reason}"
        case ev.RequestPreempted(req_id=r, reason=reason, in_flight=n):
            body = f"req={r} reason={reason} in_flight={n}"
        case ev.GenerationPaused(mode=mode, clear_cache=clear):
            body = f"mode={mode} clear_cache={clear}"
        case ev.PrefixCacheReset(reset_running_requests=running, ok=ok):
            body = f"reset_running_requests={running} ok={ok}"
        case ev.WeightsUpdated(weights_id=w, weight_version=version):
            body = f"weights_id={w}" + (f" weight_version={version}" if version else "")
        case ev.WeightChunkReceived(names=names):
            body = f"{len(names)} tensor(s): {', '.join(names[:4])}" + (
                ", ..." if len(names) > 4 else ""
            )
        case ev.EngineSlept(level=level, in_flight=in_flight, kept=kept):
            body = f"level={level} in_flight={in_flight} kept={len(kept)} requests"
        case ev.EngineWokeUp(tags=tags, weights_id=w):
            body = f"tags={'all' if tags is None else ','.join(tags)}" + (
                f" weights_id={w}" if w is not None else ""
            )
        case ev.StepScheduled(entries=entries):
            body = ", ".join(
                f"{e.req_id}: +{e.num_new_tokens}@{e.num_computed_before} e{e.epoch}"
                + (f" spec={e.num_spec_tokens}" if e.num_spec_tokens else "")
                for e in entries
            )
        case ev.FrameProduced(entries=entries):
            body = ", ".join(f"{e.req_id}: {_tokens(e.token_ids)}" for e in entries)
        case ev.OutputsEmitted(entries=entries):
            body = ", ".join(
                f"{e.req_id}: {_tokens(e.token_ids)}"
                + (f" finished={e.finish_reason}" if e.finished else "")
                for e in entries
            )
        case ev.LoRAAdded(lora_name=name, lora_int_id=i, rank=rank, adapter_id=sha):
            body = f"lora={i} name={name} rank={rank} adapter_id={sha[:16]}..."
        case ev.LoRARemoved(lora_int_id=i):
            body = f"lora={i}"
        case ev.CollectiveRPC(method=method, weights_id=w, error=error):
            body = f"method={method}" + (f" weights_id={w}" if w else "")
            body += f" error={error}" if error else ""
        case ev.EngineError(error_type=t, message=m):
            body = f"{t}: {m}"
        case ev.RecordingStopped(reason=reason):
            body = reason
        case _:
            body = ""
    return f"{kind}(step={event.step}) {body}".rstrip()


def event_requests(event: ev.Event) -> list[str]:
    """The requests an event names (empty for engine-wide events)."""
    req_id = getattr(event, "req_id", None)
    if req_id is not None:
        return [req_id]
    entries = getattr(event, "entries", None)
    if entries is not None:
        return [e.req_id for e in entries]
    return []


class Output:
    """Lines and tables to a stream: rich on a terminal (or when forced), plain otherwise."""

    def __init__(self, stream: TextIO | None = None, rich: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.rich = is_terminal(self.stream) if rich is None else rich
        self._console: Any = None
        if self.rich:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False, soft_wrap=True)

    def line(self, text: str = "", style: str | None = None) -> None:
        text = safe_text(text)
        if self._console is not None:
            self._console.print(text, style=style, markup=False)
        else:
            self.stream.write(text + "\n")

    def error(self, message: str) -> None:
        self.line(f"error: {' '.join(message.split())}", style="bold red")

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        title: str | None = None,
        numeric_from: int = 1,
    ) -> None:
        """A table; columns from `numeric_from` on are right-aligned when their cells are
        numbers."""
        cells = [[safe_text(str(v)) for v in row] for row in rows]
        columns = [safe_text(c) for c in columns]
        title = safe_text(title) if title is not None else None
        if self._console is not None:
            from rich import box
            from rich.table import Table

            table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
            for i, name in enumerate(columns):
                table.add_column(
                    name,
                    justify="right" if i >= numeric_from else "left",
                    style="bold" if i == 0 else None,
                    overflow="fold",
                )
            for row in cells:
                table.add_row(*row)
            self._console.print(table)
            return
        if title:
            self.stream.write(f"{title}\n")
        allc = [list(columns)] + cells
        widths = [max(len(r[i]) for r in allc) for i in range(len(columns))]
        for row in allc:
            text = "  ".join(
                v.rjust(w) if i >= numeric_from else v.ljust(w)
                for i, (v, w) in enumerate(zip(row, widths))
            )
            self.stream.write(f"  {text.rstrip()}\n")

    def flush(self) -> None:
        self.stream.flush()


# -- the derived state as tables (inspect, the debugger's `requests`) ------------------------

REQUEST_COLUMNS = (
    "id",
    "status",
    "prompt",
    "output",
    "computed",
    "placeholders",
    "epoch",
    "discard",
    "preemptions",
    "blocks",
    "dropped",
    "finish",
)


def request_row(state: Any, req: Any) -> tuple[Any, ...]:
    """One request's row of REQUEST_COLUMNS (an EngineState and one of its RequestStates)."""
    return (
        req.req_id,
        req.status.value,
        req.num_prompt_tokens,
        len(req.output_token_ids),
        req.num_computed_tokens,
        req.num_output_placeholders,
        req.epoch,
        discard_count(state, req),
        req.num_preemptions,
        len(req.block_ids),
        req.num_frames_dropped,
        req.finish_reason or "-",
    )


class PlainView:
    """Sections (key: value) and the request table as plain text, for pipes and files."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def section(self, title: str, pairs: dict[str, Any]) -> None:
        self.out.write(f"{safe_text(title)}\n")
        width = max((len(k) for k in pairs), default=0)
        for key, value in pairs.items():
            self.out.write(f"  {key:<{width}}  {safe_text(str(value))}\n")
        self.out.write("\n")

    def table(self, title: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        self.out.write(f"{safe_text(title)}\n")
        cells = [list(columns)] + [[safe_text(str(v)) for v in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        for r in cells:
            line = "  ".join(
                v.ljust(w) if i < 2 or i == len(columns) - 1 else v.rjust(w)
                for i, (v, w) in enumerate(zip(r, widths))
            )
            self.out.write(f"  {line.rstrip()}\n")
        if not rows:
            self.out.write("  (no requests)\n")


class RichView:
    """The same, drawn with rich for a terminal."""

    # Short headers (explained in the caption) keep the request table inside 80 columns.
    _HEADERS: ClassVar[dict[str, str]] = {
        "computed": "comp",
        "placeholders": "ph",
        "discard": "disc",
        "preemptions": "preempt",
    }
    _CAPTION = (
        "prompt/output: lengths, comp: num_computed_tokens, ph: num_output_placeholders, "
        "disc: discard count, dropped: frames dropped"
    )

    def __init__(self, out: TextIO) -> None:
        from rich.console import Console

        self.console = Console(file=out, highlight=False)

    def section(self, title: str, pairs: dict[str, Any]) -> None:
        from rich.table import Table
        from rich.text import Text

        self.console.print(safe_text(title), style="bold", markup=False)
        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in pairs.items():
            table.add_row(key, Text(safe_text(str(value))))
        self.console.print(table)
        self.console.print()

    def table(self, title: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        self.console.print(safe_text(title), style="bold", markup=False)
        table = Table(
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
            caption=self._CAPTION,
            caption_justify="left",
        )
        for i, name in enumerate(columns):
            numeric = 1 < i < len(columns) - 1
            table.add_column(
                self._HEADERS.get(name, name),
                justify="right" if numeric else "left",
                overflow="fold",
                style="bold" if i == 0 else None,
                no_wrap=i == 1,
            )
        for row in rows:
            # The finish column says why a request finished; "finished" is enough here.
            status = "finished" if str(row[1]).startswith("finished") else row[1]
            table.add_row(*(Text(safe_text(str(v))) for v in (row[0], status, *row[2:])))
        self.console.print(table)


def state_view(out: TextIO, rich: bool | None = None) -> PlainView | RichView:
    """RichView on a terminal (or when `rich` says so), PlainView otherwise."""
    return RichView(out) if (is_terminal(out) if rich is None else rich) else PlainView(out)
