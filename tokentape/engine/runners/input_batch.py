"""A step's inputs for the model: what each scheduled entry computes, the tensors of one
forward pass over some of them, and the split of a step over the CPU lanes.

The runner turns every scheduled entry into an `EntryInputs` (its tokens, their positions,
its draft tokens, whether it samples). A forward pass takes any subset of them: on the CPU a
step is shared out over lanes, threads that each run a forward pass over their share of the
sequences (data parallelism over the batch; see `split_over_lanes`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from tokentape.engine.model.decoder import AttentionMetadata
from tokentape.events.schema import SamplingParams

# What a CPU core does per byte it reads from memory, in float32 flops: about 100 GFLOP/s of
# matmul against about 12 GB/s. Only used to balance the lanes' shares of a step.
FLOPS_PER_BYTE = 8

# Lanes pay off while the weights stay in the caches: each lane's forward pass reads every
# weight, so a model that must stream its weights from memory reads them once per lane. Above
# this size a step runs as one lane whose matmuls share the threads (intra-op), each thread
# reading its part of every weight (measured: docs/benchmarks-history.md, "Measurements that
# shaped the code").
LANES_MAX_WEIGHT_BYTES = 64 << 20

# A lane's forward pass costs a fixed part whatever its share: its Python and the dispatch of
# its ops, which every lane runs under the one GIL (about 3 ms a pass with the tiny model on
# an AVX2 core with oneDNN's matmuls, most of a small step's time). So a step is shared out
# only as far as each lane gets this much work (in split_over_lanes' units: about 18 decodes
# of tiny at a context of 250, so two lanes from about 36); with less, a second lane made the
# step slower (tiny, 1 lane against 2 at 4, 16 and 32 sequences: 6.1 vs 9.7, 8.5 vs 11.5,
# 11.8 vs 12.3 ms per step; docs/benchmarks-history.md).
MIN_LANE_WORK = 1 << 28

# Where the matmuls are MKL's packed GEMM, a step on one lane runs its layers in one C call
# and the runner's helper thread (cpu_native.Helper) takes half of each matmul and some of the
# decode attention: one lane then beats two until each lane would get about 96 decodes of
# tiny at a context of 320 (two lanes from about 192). Measured on 2 cores, tiny, 256-token
# prompts -> 128 tokens, tok/s of two lanes against one with the helper: 16 sequences 3,275
# vs 6,064; 64: 5,884 vs 6,890; 128: 6,965 vs 7,159; 192: 7,544 vs 7,605; 256: 8,021 vs 7,475.
MIN_LANE_WORK_SPLIT_MATMULS = 3 << 29


def choose_lanes(weight_bytes: int, num_threads: int) -> tuple[int, int]:
    """(lanes, threads per lane) for a CPU model of `weight_bytes` on `num_threads` threads."""
    if num_threads <= 1 or weight_bytes > LANES_MAX_WEIGHT_BYTES:
        return 1, max(num_threads, 1)
    return num_threads, 1


@dataclass(slots=True)
class SeqState:
    """The runner's copy of a sequence: its tokens, how many have K/V in the cache, its blocks."""

    params: SamplingParams
    seed: int
    tokens: list[int]
    block_ids: list[int]
    num_computed: int = 0
    num_prompt: int = 0  # the prompt's length: tokens after it are output (penalties, min_tokens)
    lora_slot: int = -1  # its LoRA adapter's slot in the runner's table (-1: none)


@dataclass(slots=True)
class EntryInputs:
    """One scheduled entry's share of a step."""

    req_id: str
    seq: SeqState
    inputs: list[int]  # token ids to compute, drafts included
    start: int  # the position of inputs[0]
    drafts: list[int]  # n-gram draft tokens at the end of inputs
    samples: bool  # False for a prefill chunk short of the sequence's end
    entering: bool = False  # it (re)enters the batch: its cached prefix may be shared blocks
    # With prompt logprobs: the prompt tokens its first inputs' logits score (token p + 1 at
    # position p; runners/prompt_logprobs.py).
    prompt_targets: list[int] = field(default_factory=list)

    @property
    def num_sample_rows(self) -> int:
        """Logits rows it needs: the last real input's and every draft's."""
        return 1 + len(self.drafts) if self.samples else 0


@dataclass(slots=True)
class ForwardBatch:
    """The tensors of one forward pass over some entries, in their order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states whose logits are sampled
    # The LoRA adapter slot of every row (int32), None when no entry runs with an adapter.
    lora_slots: torch.Tensor | None = None


def build_forward_batch(
    entries: list[EntryInputs], block_size: int, device: torch.device
) -> ForwardBatch:
    """The tensors of one forward pass over `entries`. Runs in a lane's Python (with two
    lanes, under the GIL the other lane also needs), so the common entry, a decode of one
    token, takes no loop of its own, and the lists become tensors through `array` (a C loop
    over the ints; torch.tensor of a list took 110 us for the block tables of 128 decodes)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    width = max(len(e.seq.block_ids) for e in entries)
    tables: list[int] = []
    lora_slots: list[int] | None = None
    if any(e.seq.lora_slot >= 0 for e in entries):
        lora_slots = []
        for e in entries:
            lora_slots += [e.seq.lora_slot] * len(e.inputs)
    rows = 0
    for e in entries:
        blocks, inputs, start = e.seq.block_ids, e.inputs, e.start
        n = len(inputs)
        if n == 1:
            input_ids.append(inputs[0])
            positions.append(start)
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        else:
            input_ids += inputs
            positions += range(start, start + n)
            slots += [
                blocks[p // block_size] * block_size + p % block_size
                for p in range(start, start + n)
            ]
        rows += n
        cu_seqlens.append(rows)
        seq_lens.append(start + n)
        tables += blocks
        if len(blocks) < width:
            tables += [0] * (width - len(blocks))
        samples = e.num_sample_rows
        if samples == 1:
            sample_rows.append(rows - 1)
        elif samples:
            sample_rows += range(rows - samples, rows)

    def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        code = "q" if dtype == torch.int64 else "i"
        # frombuffer keeps the array alive; an empty one has no buffer to point into.
        cpu = (
            torch.frombuffer(array(code, values), dtype=dtype)
            if values
            else torch.empty(0, dtype=dtype)
        )
        return cpu.to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        meta=AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32).view(len(entries), width),
        ),
        sample_rows=tensor(sample_rows, torch.int64),
        lora_slots=None if lora_slots is None else tensor(lora_slots, torch.int32),
    )


def split_over_lanes(
    entries: list[EntryInputs],
    num_lanes: int,
    block_size: int,
    flops_per_token: int,
    kv_bytes_per_token: int,
    min_lane_work: int = MIN_LANE_WORK,
) -> list[list[EntryInputs]]:
    """The entries shared out over at most `num_lanes` lanes of about equal work, each share
    in the step's order; every share holds at least one entry, and there are no more shares
    than the step holds `min_lane_work` of work.

    An entry's work is its tokens' matmuls plus the K/V it reads (its whole context), weighed
    by FLOPS_PER_BYTE. Any split gives every sequence the same bits: a sequence's attention
    reads only its own context, and the matmuls are batch-invariant on the CPU. The one
    dependency between sequences is a prefix-cache hit on blocks another entry computes in
    this same step: the reader goes in the writer's lane, where every layer writes the
    step's K/V before it attends.
    """
    if num_lanes <= 1:
        return [entries]
    works = [
        len(e.inputs) * flops_per_token
        + (e.start + len(e.inputs)) * kv_bytes_per_token * FLOPS_PER_BYTE
        for e in entries
    ]
    bundles = _bundles(entries, block_size)  # None: every entry on its own
    units = works if bundles is None else [sum(works[i] for i in b) for b in bundles]
    total = sum(works)
    num_lanes = min(num_lanes, len(units), max(total // max(min_lane_work, 1), 1))
    if num_lanes <= 1:
        return [entries]
    bounds = _equal_runs(units, total, num_lanes)
    if bundles is None:  # a step of decodes: the runs are the shares
        return [entries[a:b] for a, b in zip(bounds, bounds[1:])]
    lane_of: dict[int, int] = {}
    for lane, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for bundle in bundles[a:b]:
            for i in bundle:
                lane_of[i] = lane
    shares: list[list[EntryInputs]] = [[] for _ in range(num_lanes)]
    for i, e in enumerate(entries):
        shares[lane_of[i]].append(e)
    return shares


def _equal_runs(works: list[int], total: int, num_lanes: int) -> list[int]:
    """Where to cut items of `works` (in order) into `num_lanes` runs of about equal work,
    none empty, as the runs' bounds: an item goes to the run its middle falls in. Two C
    loops (accumulate, bisect) where a greedy Python loop cost ~0.3 ms a step of 256 decodes,
    with both lanes waiting."""
    middles = [2 * end - w for end, w in zip(accumulate(works), works)]  # twice each middle
    bounds = [0]
    for lane in range(1, num_lanes):
        cut = bisect_right(middles, 2 * total * lane // num_lanes)
        bounds.append(min(max(cut, bounds[-1] + 1), len(works) - (num_lanes - lane)))
    bounds.append(len(works))
    return bounds


def _bundles(entries: list[EntryInputs], block_size: int) -> list[list[int]] | None:
    """Indices of the entries in groups that must share a lane (most groups are one entry):
    an entering entry whose cached prefix holds a block that another entry writes in this
    step joins that entry's group. None when every group is one entry (no entry enters with
    a cached prefix: a step of decodes)."""
    entering = [i for i, e in enumerate(entries) if e.entering and e.start >= block_size]
    if not entering:
        return None
    group = list(range(len(entries)))

    def root(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    writer: dict[int, int] = {}
    for i, e in enumerate(entries):
        first, last = e.start // block_size, (e.start + len(e.inputs) - 1) // block_size
        for block in e.seq.block_ids[first : last + 1]:
            writer[block] = i
    for i in entering:
        e = entries[i]
        for block in e.seq.block_ids[: e.start // block_size]:
            w = writer.get(block)
            if w is not None and w != i:
                group[root(i)] = root(w)
    bundles: dict[int, list[int]] = {}  # in the order of their first entries
    for i in range(len(entries)):
        bundles.setdefault(root(i), []).append(i)
    return list(bundles.values())
