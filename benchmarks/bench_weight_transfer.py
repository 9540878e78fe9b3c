"""A full weight update through the "shm" weight transfer engine against one from a checkpoint
folder, side by side in one run: AsyncLLM with the engine core in its own process, the
model's shapes (`--model`, default qwen3-0.6b: built in, random weights, float32).

Arms, each a whole update while paused:

- shm: `start_weight_update`, then `ShmWeightTransferEngine.trainer_send_weights` of the
  trainer's `named_parameters()` in buckets of `--bucket-size-bytes` (each a shared-memory
  block: the trainer copies the tensors in, the engine core views them, checks them, copies
  them into the transfer's stage and hashes them, each for the tape and on through the
  weights' hash), then `finish_weight_update` (loads the stage into the model, hashes the
  rest of the weights).
- folder: `update_weights(folder)` of a safetensors folder written before the rounds
  (`save_checkpoint`, in the temp folder; its time is reported, not counted): the engine
  core reads it, checks it, loads it and hashes the weights. Written just before, it is in
  the page cache: the file system's best case.
- folder-chunk: the same folder as one chunk of a transfer (`start_weight_update`,
  `update_weights(folder)`, `finish_weight_update`): the chunk path the shm buckets take
  (the stage's copy, a SHA-256 a tensor for the tape), fed from the file instead; shm
  against it is the transport alone.

All load the same weights (their SHA-256s are checked equal). Each round runs each
arm once, in an order reversed every other round, after a warm-up round of each
(`--warmup`). Reported per arm: seconds and GB/s (the parameters' bytes, 1e9 bytes a GB),
best and median of `--rounds` (default 3), the ratios shm / folder and shm / folder-chunk,
and for shm the split (medians): start and buckets, of which the engine's answers to the
buckets (the rest is the trainer's: writing the block, making and unlinking it), and finish.

    python benchmarks/bench_weight_transfer.py                       # qwen3-0.6b, 3 rounds
    python benchmarks/bench_weight_transfer.py --model tiny --rounds 5   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, md_table  # noqa: E402

from tokentape import AsyncLLM  # noqa: E402
from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.engine.weight_transfer import (  # noqa: E402
    DEFAULT_BUCKET_SIZE_BYTES,
    ShmTrainerSendWeightsArgs,
    ShmWeightTransferEngine,
    WeightTransferConfig,
)

ARMS = ("shm", "folder", "folder-chunk")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a built-in model (default qwen3-0.6b)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument(
        "--bucket-size-bytes",
        type=int,
        default=DEFAULT_BUCKET_SIZE_BYTES,
        help=f"the shm arm's bucket size (default {DEFAULT_BUCKET_SIZE_BYTES:,})",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p.parse_args(argv)


def run(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    _, model = builtin_model(args.model, seed=1)  # the trainer's weights
    weights = {name: p.detach() for name, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    t = time.perf_counter()
    folder = save_checkpoint(model, os.path.join(scratch, "ckpt"))
    save_s = time.perf_counter() - t
    del model
    gc.collect()
    engine = AsyncLLM(
        args.model,
        tape=os.path.join(scratch, "bench.tape"),
        multiprocess_mode=True,
        weight_transfer_config=WeightTransferConfig(backend="shm"),
        num_kv_blocks=64,
        max_model_len=1024,
    )

    async def shm_update() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        sent = []
        answered = []  # seconds the engine took to answer each bucket, as the trainer waited

        def deliver(info: dict[str, Any]) -> None:  # the trainer's thread: wait for the engine
            sent.append(info["shm_name"])
            t = time.perf_counter()
            asyncio.run_coroutine_threadsafe(engine.update_weights(info), loop).result()
            answered.append(time.perf_counter() - t)

        send_args = ShmTrainerSendWeightsArgs(deliver, bucket_size_bytes=args.bucket_size_bytes)
        send = ShmWeightTransferEngine.trainer_send_weights
        await engine.pause_generation(mode="keep")
        t0 = time.perf_counter()
        await engine.start_weight_update()
        await asyncio.to_thread(send, weights.items(), send_args)
        t1 = time.perf_counter()
        weights_id = await engine.finish_weight_update()
        t2 = time.perf_counter()
        await engine.resume_generation()
        return {
            "seconds": t2 - t0,
            "send_s": t1 - t0,
            "answers_s": sum(answered),
            "finish_s": t2 - t1,
            "buckets": len(sent),
            "weights_id": weights_id,
        }

    async def folder_update() -> dict[str, Any]:
        await engine.pause_generation(mode="keep")
        t0 = time.perf_counter()
        weights_id = await engine.update_weights(folder)
        t1 = time.perf_counter()
        await engine.resume_generation()
        return {"seconds": t1 - t0, "weights_id": weights_id}

    async def folder_chunk_update() -> dict[str, Any]:
        await engine.pause_generation(mode="keep")
        t0 = time.perf_counter()
        await engine.start_weight_update()
        await engine.update_weights(folder)
        weights_id = await engine.finish_weight_update()
        t1 = time.perf_counter()
        await engine.resume_generation()
        return {"seconds": t1 - t0, "weights_id": weights_id}

    arms = {"shm": shm_update, "folder": folder_update, "folder-chunk": folder_chunk_update}
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}

    async def rounds() -> None:
        await engine.init_weight_transfer_engine({"backend": "shm"})
        for r in range(args.warmup + args.rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in order:
                result = await arms[arm]()
                gc.collect()
                timed = r >= args.warmup
                if timed:
                    runs[arm].append(result)
                print(
                    f"round {r + 1 - args.warmup if timed else 'warm-up'}: {arm} "
                    f"{result['seconds']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )

    try:
        asyncio.run(rounds())
    finally:
        engine.shutdown()
    ids = {r["weights_id"] for rs in runs.values() for r in rs}
    if len(ids) != 1:
        raise SystemExit(f"the arms loaded different weights: {sorted(ids)}")
    out: dict[str, Any] = {
        "model": args.model,
        "bytes": nbytes,
        "tensors": len(weights),
        "bucket_size_bytes": args.bucket_size_bytes,
        "rounds": args.rounds,
        "save_checkpoint_s": save_s,
        "machine": machine_info(),
        "arms": {},
    }
    for arm, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        a = {
            "seconds_best": min(secs),
            "seconds_median": statistics.median(secs),
            "gb_s_best": nbytes / min(secs) / 1e9,
            "gb_s_median": nbytes / statistics.median(secs) / 1e9,
            "seconds": secs,
        }
        if arm == "shm":
            a["send_s_median"] = statistics.median(r["send_s"] for r in rs)
            a["answers_s_median"] = statistics.median(r["answers_s"] for r in rs)
            a["finish_s_median"] = statistics.median(r["finish_s"] for r in rs)
            a["buckets"] = rs[0]["buckets"]
        out["arms"][arm] = a
    shm = out["arms"]["shm"]
    for arm in ARMS[1:]:
        base = out["arms"][arm]
        out[f"ratio_{arm}"] = {
            "best": shm["gb_s_best"] / base["gb_s_best"],
            "median": shm["gb_s_median"] / base["gb_s_median"],
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    shm = result["arms"]["shm"]
    names = {
        "shm": "shm (start, buckets, finish)",
        "folder": "folder (update_weights(folder))",
        "folder-chunk": "folder-chunk (start, the folder as a chunk, finish)",
    }
    lines = [
        f"## bench_weight_transfer: a full weight update of {result['model']}, shm buckets "
        "against a safetensors folder (whole, and as a chunk)",
        "",
        f"- machine: {m['cpu']}; {m['os']}; {m['python']}; tokentape {m['tokentape']}",
        f"- {result['tensors']} tensors, {result['bytes']:,} bytes; shm buckets of "
        f"{result['bucket_size_bytes']:,} bytes ({shm['buckets']} a transfer); best and median "
        f"of {result['rounds']} rounds, the engine core in its own process",
        "",
        md_table(
            ["arm", "s best", "s median", "GB/s best", "GB/s median"],
            [
                [
                    name,
                    f"{a['seconds_best']:.2f}",
                    f"{a['seconds_median']:.2f}",
                    f"{a['gb_s_best']:.2f}",
                    f"{a['gb_s_median']:.2f}",
                ]
                for name, a in ((names[arm], result["arms"][arm]) for arm in ARMS)
            ],
        ),
        "",
        *(
            f"- shm / {arm}: **{result[f'ratio_{arm}']['best']:.2f}x** by the best rounds, "
            f"{result[f'ratio_{arm}']['median']:.2f}x by the medians"
            for arm in ARMS[1:]
        ),
        f"- shm split (medians): start + buckets {shm['send_s_median']:.2f} s (the engine's "
        f"answers to the buckets {shm['answers_s_median']:.2f} s, the rest the trainer's), "
        f"finish {shm['finish_s_median']:.2f} s",
        f"- the folder, written once before the rounds (save_checkpoint, not counted): "
        f"{result['save_checkpoint_s']:.2f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="tokentape-bench-wt-")
    try:
        result = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result, markdown=text), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
