"""The WAL and close() while another process holds a read transaction on a live tape.

A run of ~100k events (oracle, `max_num_seqs=1`: three small events per step) while a reader
process runs `BEGIN; SELECT COUNT(*) FROM events` at its start and holds that snapshot; a
thread samples the size of `TAPE-wal` every 10 ms. With `--hold`, the reader still holds it
when the engine closes the tape; without, it lets go first. Prints the WAL's peak, the time
`close()` took, and how many events a copy of the `.tape` file alone holds after `close()`
(docs/tape-format.md, "Checkpoints").

    python benchmarks/tape_wal_reader.py [--hold] [--requests 256] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from tokentape import LLM, SamplingParams

_READER = r"""
import os, sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN")
print("pinned", conn.execute("SELECT COUNT(*) FROM events").fetchone()[0], flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
conn.execute("COMMIT")
conn.close()
"""


def measure(hold: bool, requests: int, max_tokens: int, folder: str) -> str:
    path, release = os.path.join(folder, "run.tape"), os.path.join(folder, "release")
    llm = LLM(model="oracle", tape=path, max_num_seqs=1)
    llm.llm_engine.engine_core.tape.flush()
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, path, release], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout is not None and reader.stdout.readline().startswith("pinned")
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], os.path.getsize(f"{path}-wal"))
            except FileNotFoundError:
                pass
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.monotonic()
    llm.generate(
        [[3 + i % 200, 5 + i % 100, 7] for i in range(requests)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    run_s = time.monotonic() - t0
    n = len(llm.llm_engine.engine_core.tape)
    if not hold:
        open(release, "w").close()
        reader.wait()
    t1 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.close()
    close_s = time.monotonic() - t1
    stop.set()
    sampler.join()
    alone = os.path.join(folder, "alone.tape")
    shutil.copy(path, alone)
    conn = sqlite3.connect(f"file:{alone}?mode=ro", uri=True)
    try:
        in_copy = conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    finally:
        conn.close()
    open(release, "w").close()
    reader.wait()
    warned = "; warned" if caught else ""
    return (
        f"reader {'holds through close' if hold else 'gone before close'}: {n} events in "
        f"{run_s:.2f} s, tape {os.path.getsize(path) / 1e6:.1f} MB, WAL peak "
        f"{peak[0] / 1e6:.1f} MB, close() {close_s:.2f} s{warned}, events in the .tape "
        f"copied alone {in_copy}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--hold", action="store_true", help="the reader holds its snapshot through close()"
    )
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tape-wal-") as folder:
        print(measure(args.hold, args.requests, args.max_tokens, folder))


if __name__ == "__main__":
    main()
