"""CUDA graphs of the decoder's pass for decode steps (vLLM's default, `enforce_eager=False`).

Run eagerly, a decode step of Qwen3-0.6B launches about 1,500 kernels, one per torch op
(RMSNorm alone is seven), and the host's time to launch them is the step's time whatever the
batch: 25 ms at batch 1 and 29 ms at batch 64 on an H200, a hundred times the time to read
the weights (docs/benchmarks.md, "On a GPU"). A graph launches them all at once.

A graph replays fixed kernels on fixed memory: it is captured per batch size (vLLM's capture
sizes: 1, 2, 4, then every multiple of 8 up to 512), on static input tensors the step's
inputs are copied into, and a batch is padded to the next captured size. A padding row reads
one token of block 0 and writes nothing to the cache (slot -1); its output is cut off. The
block table is as wide as the longest sequence the cache can hold, so one graph fits every
context. Each size is captured the first time a step needs it. What a graph cannot take
runs eagerly: prefill chunks and speculative drafts (more than one token a sequence), rows
with a LoRA adapter, a batch over the largest size.

The graphs read the weights and the KV cache where they were at capture: an update copies
into the same tensors, but sleep mode frees and reallocates them, so the runner drops the
graphs (`clear`) when it sleeps.
"""

from __future__ import annotations

import torch

from tokentape.engine.model.decoder import AttentionMetadata, CausalLM
from tokentape.engine.runners.input_batch import ForwardBatch

MAX_CAPTURE_SIZE = 512  # vLLM's max_cudagraph_capture_size default


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture (vLLM's default list), up to the first that holds
    max_num_seqs sequences."""
    every = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    wanted = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in every if s < wanted] + [next(s for s in every if s >= wanted)]


class CUDAGraphRunner:
    """Runs a decoder pass (CausalLM's forward without LoRA) through a captured graph, for a
    batch that `fits`; the caller runs any other batch eagerly."""

    def __init__(
        self, model: CausalLM, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        n = self.sizes[-1]
        # The static inputs every graph reads (a graph of size s reads their first s rows).
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states
        self._pool: object | None = None  # one memory pool for every graph: one replays at once

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `batch` can replay a graph: decodes only, no LoRA, within the sizes."""
        num_tokens = batch.input_ids.shape[0]
        return (
            batch.lora_slots is None
            and 0 < num_tokens <= self.sizes[-1]
            and num_tokens == batch.meta.seq_lens.shape[0]
            and batch.meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of `batch`, which `fits`: its rows of a graph's output,
        valid until the next graph replays (the caller reads them first, on the same stream)."""
        n = batch.input_ids.shape[0]
        size = self.capture_size(n)
        self._load_inputs(batch, n, size)
        graph = self._graphs.get(size)
        if graph is None:
            graph = self._capture(size, kv_caches)
        graph.replay()
        return self._outputs[size][:n]

    def capture_size(self, num_seqs: int) -> int:
        """The captured size a batch of `num_seqs` decodes is padded to."""
        return next(s for s in self.sizes if s >= num_seqs)

    def clear(self) -> None:
        """Drop every graph (the weights or the KV cache moved); sizes are captured again."""
        self._graphs.clear()
        self._outputs.clear()
        self._pool = None

    def padded_pass(
        self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The pass a graph of `size` captures: the model over the static inputs' first
        `size` rows."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
        )
        return self.model(self.input_ids[:size], self.positions[:size], kv_caches, meta)

    def _load_inputs(self, batch: ForwardBatch, n: int, size: int) -> None:
        meta = batch.meta
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past `width` keep older block ids: a row reads only its first seq_len slots.
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # padding rows: one token of block 0 attended to, nothing written
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()

    def _capture(
        self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.cuda.CUDAGraph:
        # An eager pass first: Triton compiles its kernels, and the allocator warms up,
        # outside the capture. It writes the real rows' K/V, which the replay then writes
        # again with the same values.
        self.padded_pass(size, kv_caches)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: the engine's other threads may use CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._outputs[size] = self.padded_pass(size, kv_caches)
        self._graphs[size] = graph
        return graph
