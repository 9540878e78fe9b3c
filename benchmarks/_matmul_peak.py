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

What the share can reach on a machine is measured too (`ceiling_figure`): the run's weight
GEMMs alone, replayed in the engine's order through its backend, each layer with its own
weights (so that a model larger than the caches streams them from memory, as the run does),
plus the K/V its decode attention must read at the machine's streaming read rate. A run
whose passes attend between their GEMMs, as this engine's and vLLM's do, cannot take less than
that sum, so the peak's seconds over it bound such a run's share from above. (A schedule that
overlapped one core's attention with the other's GEMMs could in principle do better.)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokentape.engine.model import cpu_matmul
from tokentape.engine.model.layers import MLP_ROW_CHUNK
from tokentape.engine.model.model_config import ModelConfig


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
            f"{100 * self.fraction(wall_s):.1f}% of the peak"
        )


def layer_gemms(config: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of each weight GEMM of one decoder layer."""
    d, h = config.head_dim, config.hidden_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    inter = config.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]


def _best_seconds(call: Callable[[], object], min_seconds: float) -> float:
    """The fastest of repeated calls (after one to warm up), repeated for `min_seconds`."""
    call()
    best, spent = float("inf"), 0.0
    while spent < min_seconds:
        t0 = time.perf_counter()
        call()
        elapsed = time.perf_counter() - t0
        best, spent = min(best, elapsed), spent + elapsed
    return best


def _best_gflop_s(flop: float, matmul: Callable[[], object], min_seconds: float) -> float:
    return flop / _best_seconds(matmul, min_seconds) / 1e9


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


@dataclass
class CeilingFigure:
    gemm_seconds: float  # the run's weight GEMMs and LM head alone, replayed
    kv_gb: float  # the K/V the run's decodes read, at least (each context once per step)
    read_gb_s: float  # the machine's streaming read rate on the run's threads

    @property
    def seconds(self) -> float:
        return self.gemm_seconds + self.kv_gb / self.read_gb_s

    def share(self, peak: PeakFigure) -> float:
        """The highest share of the peak a run whose passes attend between their GEMMs reaches."""
        return peak.seconds_at_peak / self.seconds

    def describe(self, peak: PeakFigure) -> str:
        return (
            f"the weight GEMMs alone, replayed in the engine's order with a weight per layer, "
            f"take {self.gemm_seconds:.1f} s, and the decodes read {self.kv_gb:,.0f} GB of K/V: "
            f"{self.kv_gb / self.read_gb_s:.1f} s at this machine's {self.read_gb_s:.1f} GB/s; "
            f"a run whose passes attend between their GEMMs (this engine's, vLLM's) takes at "
            f"least {self.seconds:.1f} s, so its share is at most "
            f"{100 * self.share(peak):.1f}% here"
        )


def _replay_pass_seconds(
    config: ModelConfig, rows: int, weights: list[dict[str, object]], repeats: int
) -> float:
    """The fastest of `repeats` replays of one forward pass's weight GEMMs at `rows` rows:
    q, k, v and o, then the MLP in the engine's row chunks (layers.MLP.forward_fused)."""
    linear = cpu_matmul.BACKEND.linear
    q_width = config.num_attention_heads * config.head_dim
    x = torch.randn(rows, config.hidden_size)
    attn = torch.randn(rows, q_width)
    middle = torch.randn(min(rows, MLP_ROW_CHUNK), config.intermediate_size)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            for name in ("q", "k", "v"):
                linear(x, w[name], None)
            linear(attn, w["o"], None)
            for start in range(0, rows, MLP_ROW_CHUNK):
                chunk = x[start : start + MLP_ROW_CHUNK]
                linear(chunk, w["gate"], None)
                linear(chunk, w["up"], None)
                linear(middle[: chunk.shape[0]], w["down"], None)
        best = min(best, time.perf_counter() - t0)
    return best


def _read_gb_s(nbytes: int = 1 << 30) -> float:
    """Streaming read rate on torch's threads: the best of a few sums over a float32 tensor
    larger than any cache."""
    big = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def ceiling_figure(
    config: ModelConfig,
    prompts: list[list[int]],
    outputs: list[int],
    prefill_rows: int,
    threads: int,
) -> CeilingFigure:
    """What no run of this workload can beat on this machine (see the module doc). Prompt
    passes are timed at up to 2,048 rows and scaled by their tokens (a GEMM's time is linear
    in its rows there); decode passes at the batch, the LM head at the batch per sampled row."""
    backend = cpu_matmul.BACKEND
    if backend.pack is None:
        raise RuntimeError(f"the {backend.name} matmul has no packed weights to replay")
    d, h = config.head_dim, config.hidden_size
    q, kv, inter = (
        config.num_attention_heads * d,
        config.num_key_value_heads * d,
        config.intermediate_size,
    )
    shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}
    shapes |= {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weights = [
            {name: backend.pack(torch.randn(shape)) for name, shape in shapes.items()}
            for _ in range(config.num_hidden_layers)
        ]
        head = backend.pack(torch.randn(config.vocab_size, h))
        prompt_tokens = sum(map(len, prompts))
        decode_tokens = sum(max(0, o - 1) for o in outputs)
        decode_rows = len(prompts)
        rows = min(prefill_rows, 2048)
        seconds = _replay_pass_seconds(config, rows, weights, 2) * prompt_tokens / rows
        seconds += (
            _replay_pass_seconds(config, decode_rows, weights, 3) * decode_tokens / decode_rows
        )
        x = torch.randn(decode_rows, h)
        head_call = functools.partial(backend.linear, x, head, None)
        seconds += _best_seconds(head_call, 0.3) * sum(outputs) / decode_rows
        read_gb_s = _read_gb_s()
    finally:
        torch.set_num_threads(before)
    per_token = 2 * config.num_hidden_layers * kv * 4  # K and V of every layer, float32
    contexts = sum(len(p) * max(0, o - 1) + o * (o - 1) // 2 for p, o in zip(prompts, outputs))
    return CeilingFigure(seconds, contexts * per_token / 1e9, read_gb_s)
