"""How close a generate run comes to the machine's float32 matmul peak (issue 26's figure).

The run's FLOPs are counted from the model's shapes: every token fed to the model (each
prompt token, each generated token but the last) goes through every layer's weight GEMMs
(q/k/v, o, gate/up, down: 2 FLOPs per multiply-add), and every sampled token through the LM
head. The peak, per GEMM shape, is the fastest float32 matmul on the engine's thread count,
measured in this process: `torch.mm` (MKL's sgemm, or whatever BLAS torch has), and every
backend the engine can choose (engine/model/cpu_matmul.py: MKL's packed GEMM, oneDNN's
linear on its packed weight, where torch has them), each on its packed weight, at the
prefill's row count (the tokens of one step) for the prompt tokens' FLOPs and at the
decode's (the batch) for the rest. The fraction is the time these FLOPs would take at that
peak over the run's wall time; attention, sampling and the engine's own work count against
it, as they are part of the run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokentape.engine.model import cpu_matmul
from tokentape.engine.model.config import ModelConfig


@dataclass
class PeakFigure:
    gemm_gflop: float  # the run's weight-GEMM and LM-head FLOPs, in GFLOP
    peak_gflop_s: float  # the faster matmul at each of the run's shapes, FLOP-weighted
    seconds_at_peak: float

    def fraction(self, wall_s: float) -> float:
        return self.seconds_at_peak / wall_s

    def describe(self, wall_s: float) -> str:
        return (
            f"{self.gemm_gflop:,.0f} GFLOP of weight GEMMs in {wall_s:.1f} s = "
            f"{self.gemm_gflop / wall_s:.0f} GFLOP/s, against the "
            f"{self.peak_gflop_s:.0f} GFLOP/s of the fastest of torch.mm, MKL's packed GEMM "
            f"and oneDNN's linear at the model's shapes: "
            f"{100 * self.fraction(wall_s):.0f}% of the peak"
        )


def layer_gemms(config: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of each weight GEMM of one decoder layer."""
    d, h = config.head_dim, config.hidden_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    inter = config.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]


def _best_gflop_s(flop: float, matmul: Callable[[], object], min_seconds: float) -> float:
    matmul()
    best, spent = float("inf"), 0.0
    while spent < min_seconds:
        t0 = time.perf_counter()
        matmul()
        elapsed = time.perf_counter() - t0
        best, spent = min(best, elapsed), spent + elapsed
    return flop / best / 1e9


def mm_gflop_s(rows: int, k: int, n: int, threads: int, min_seconds: float = 0.3) -> float:
    """The fastest of torch.mm and the engine's CPU matmul backends (each on its packed
    weight) for [rows, k] x [k, n] in float32 on `threads` threads, each the best of its
    repeats."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(rows, k), torch.randn(k, n)
        flop = 2.0 * rows * k * n
        rates = [_best_gflop_s(flop, lambda: torch.mm(a, b), min_seconds)]
        weight = b.t().contiguous()
        for backend in cpu_matmul.available().values():
            if backend.pack is not None:
                call = functools.partial(backend.linear, a, backend.pack(weight), None)
                rates.append(_best_gflop_s(flop, call, min_seconds))
        return max(rates)
    finally:
        torch.set_num_threads(before)


def peak_figure(
    config: ModelConfig,
    prompts: list[list[int]],
    outputs: list[int],
    prefill_rows: int,
    threads: int,
) -> PeakFigure:
    """The run's GEMM FLOPs and the seconds they take at the peak rate (see the module doc)."""
    prompt_tokens = sum(map(len, prompts))
    decode_tokens = sum(max(0, o - 1) for o in outputs)
    decode_rows = len(prompts)
    layers = config.num_hidden_layers
    flop, seconds = 0.0, 0.0
    for k, n in layer_gemms(config):
        for tokens, rows in ((prompt_tokens, prefill_rows), (decode_tokens, decode_rows)):
            f = 2.0 * tokens * k * n * layers
            flop += f
            seconds += f / (mm_gflop_s(rows, k, n, threads) * 1e9)
    head = 2.0 * sum(outputs) * config.hidden_size * config.vocab_size
    flop += head
    head_rate = mm_gflop_s(decode_rows, config.hidden_size, config.vocab_size, threads)
    seconds += head / (head_rate * 1e9)
    return PeakFigure(flop / 1e9, flop / seconds / 1e9, seconds)
