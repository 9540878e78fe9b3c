"""The model runner: runs the decoder over the paged KV cache and samples a frame per step.

Like the oracle it keeps its own copy of every sequence (ahead of the scheduler by the steps
in flight) and the block table the scheduler recorded for it. The steps run on a worker thread
(runners/worker.py), in submission order, on the engine's CPU thread count; with a pipeline
(depth > 1) the engine plans the next step meanwhile (torch and the compiled attention release
the GIL inside their kernels, so the overlap is real). On CUDA the worker issues its work on
its own stream.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from tokentape import kernels
from tokentape.engine.model import cpu_matmul
from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.layers import calibrate_batch_invariant_rows
from tokentape.engine.model.loader import (
    WeightsHashStream,
    WeightsSource,
    prepare_update,
    weights_hash,
)
from tokentape.engine.model.weight_checks import apply_update
from tokentape.engine.ngram import propose_ngram_drafts
from tokentape.engine.runners.base import LoadedLoRA, ScheduledBatch, WeightChunk, prompt_seed
from tokentape.engine.runners.cuda_graphs import CUDAGraphRunner
from tokentape.engine.runners.input_batch import (
    MIN_LANE_WORK,
    MIN_LANE_WORK_SPLIT_MATMULS,
    EntryInputs,
    SeqState,
    build_forward_batch,
    choose_lanes,
    split_over_lanes,
)
from tokentape.engine.runners.prompt_logprobs import (
    PromptLogprobsTracker,
    ScoredRows,
    score_prompts,
)
from tokentape.engine.runners.sample_frames import sample_frames
from tokentape.engine.runners.sleep_memory import RunnerMemory, release
from tokentape.engine.runners.staged_weights import StagedWeights
from tokentape.engine.runners.worker import ModelWorker
from tokentape.engine.tokenizer import ByteTokenizer, Tokenizer
from tokentape.errors import LoRAError
from tokentape.events.schema import NO_DRAFTS, FrameEntry, LoRAAdded, SamplingParams
from tokentape.kernels import cpu_native
from tokentape.kernels.scratch import ThreadScratch
from tokentape.lora.layers import LoRABatch
from tokentape.lora.model_manager import LoRAModelManager
from tokentape.lora.peft_adapter import PeftAdapter, check_recorded_adapter, load_peft_adapter
from tokentape.progress import LOUD_BYTES, gigabytes, say


class TorchModelRunner(StagedWeights):
    """The real model's runner: owns the model's weights (and `update_weights`, which
    validates and swaps them), its KV cache tensors, its own copy of every running sequence
    (so a decode's input is the token it sampled last step, as vLLM fills placeholders on the
    GPU), the worker thread that runs submitted steps in order, the sampler and, on the CPU,
    the lanes that share out a step's sequences. It turns each ScheduledBatch into a frame;
    it decides nothing about scheduling."""

    def __init__(
        self,
        model: CausalLM,
        model_id: str,
        *,
        num_kv_blocks: int,
        block_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        batch_invariant: bool | None = None,
        prompt_lookup: tuple[int, int] = (3, 1),
        eos_token_id: int | None = None,
        tokenizer: Tokenizer | None = None,
        logprobs_mode: str = "raw_logprobs",
        lora_capacity: int = 0,
        max_num_seqs: int = 256,
        cuda_graphs: bool = True,
    ) -> None:
        # A checkpoint's own tokenizer (runners.base.HasTokenizer); the built-in models' is
        # the byte tokenizer.
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.logprobs_mode = logprobs_mode  # EngineConfig.logprobs_mode
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        # Exact and cheap on the CPU in float32 (measured: docs/benchmarks-history.md).
        if batch_invariant is None:
            batch_invariant = self.device.type == "cpu" and dtype == torch.float32
        if batch_invariant and self.device.type != "cpu":
            # Padded matmuls alone would not do: the Triton attention path is not batch-invariant
            # (see tokentape/kernels/triton_decode.py).
            raise ValueError("batch_invariant=True is supported on the CPU only")
        # On the CPU, a small model runs `num_threads` lanes of one thread each that share out
        # every step's sequences (input_batch.split_over_lanes): a decode step's attention is
        # bound by memory and its matmuls by compute, and lanes in different phases overlap
        # them, where one pool of threads would run each phase in turn. A model too big for the
        # caches runs one lane on all the threads (input_batch.choose_lanes). The worker is
        # the first lane.
        lanes, lane_threads = 1, None
        if self.device.type == "cpu":
            weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            lanes, lane_threads = choose_lanes(weight_bytes, num_threads or 1)
            if kernels.resolve_backend(self.device, None, dtype) == "triton":
                lanes = 1  # Triton's CPU interpreter (a debugging mode) keeps global state
        self._worker = ModelWorker(lane_threads)
        self._lanes = [ModelWorker(1, f"tokentape-model-lane-{i}") for i in range(1, lanes)]
        # A step too small to share out runs on the first lane alone; a helper thread then
        # lends it a second core for its matmuls and decode attention (kernels/cpu/helper.c).
        self._helper = cpu_native.Helper() if self._lanes and cpu_native.load() else None
        # The least work a step shares out to another lane: more where the helper takes half
        # of one lane's matmuls (their weights packed in parts, below).
        helped = self._helper is not None and cpu_matmul.BACKEND.pack_split is not None
        self.min_lane_work = MIN_LANE_WORK_SPLIT_MATMULS if helped else MIN_LANE_WORK
        self.pad_rows_to = 0
        loud = sum(p.numel() * p.element_size() for p in self.model.parameters()) >= LOUD_BYTES
        if loud and self.device.type == "cpu":
            say(
                f"preparing the weights for the CPU's matmuls ({cpu_matmul.BACKEND.name} "
                "layout, batch invariance)"
            )
        if self.device.type == "cpu":
            # The matmul's weight layout once, not at every call; in parts for the helper.
            self.model.prepack(split=self._helper is not None)
        if batch_invariant:
            weights = self.model.matmul_weights()  # the packed copies, where there are
            # Measured where the steps run: the answer depends on the thread count.
            rows = self._worker.run(lambda: calibrate_batch_invariant_rows(weights))
            if rows is None:
                raise RuntimeError(
                    "batch_invariant: this machine's matmuls give different results for "
                    "the same row in different batch sizes, whatever the padding; "
                    "pass batch_invariant=False"
                )
            self.pad_rows_to = rows
        self.model.set_batch_invariant(self.pad_rows_to)
        self.config = model.config
        self.model_id = model_id
        self.vocab_size = self.config.vocab_size
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.config.eos_token_id
        self.extra_eos_token_ids = tuple(
            i for i in self.config.extra_eos_token_ids if i != self.eos_token_id
        )
        self.seed = seed
        self.block_size = block_size
        self.lookup = prompt_lookup
        self.num_kv_blocks = num_kv_blocks
        shape = (num_kv_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        _check_kv_cache_fits(shape, dtype, self.config.num_hidden_layers, self.device)
        kv_bytes = 2 * self.config.num_hidden_layers * math.prod(shape) * dtype.itemsize
        if loud or (kv_bytes >= 1 << 30 and self.device.type != "cpu"):
            # (On the CPU the pool is an anonymous mapping: nothing is written, nothing slow.)
            say(
                f"allocating the KV cache: {num_kv_blocks} blocks of {block_size} tokens "
                f"({gigabytes(kv_bytes)}; the KV cache memory budget or num_kv_blocks sets it)"
            )
        self.kv_caches = self.new_kv_caches()
        # No position is past the model's context length (a longer max_model_len is refused).
        self.model.rope.extend(min(num_kv_blocks * block_size, self.config.derived_max_model_len))
        self._weights_id: str | None = None  # hashed on first use: a pass over every weight
        self._staged: dict[str, torch.Tensor] = {}  # chunks of an open weight transfer
        self._stage_memory: dict[str, torch.Tensor] = {}  # the next transfer's (staged_weights)
        self._seqs: dict[str, SeqState] = {}
        self._prompt_lps = PromptLogprobsTracker()  # prompt logprobs of chunked prefills
        self.scratch = ThreadScratch()  # the logits' buffers, by thread (_logits_buffer)
        cfg = self.config
        # Per token of context, in bytes: K and V of every layer (for balancing the lanes).
        self._kv_bytes_per_token = (
            2
            * cfg.num_hidden_layers
            * cfg.num_key_value_heads
            * cfg.head_dim
            * torch.finfo(dtype).bits
            // 8
        )
        self._flops_per_token = 2 * sum(p.numel() for p in self.model.parameters())
        self.memory = RunnerMemory()  # sleep mode (sleep_memory.py)
        # LoRA adapters (enable_lora): a table of `lora_capacity` slots on the target layers.
        self._lora = LoRAModelManager(self.model, lora_capacity) if lora_capacity else None
        self._stream = None
        self._graphs: CUDAGraphRunner | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
            if cuda_graphs:
                # As wide a block table as the longest sequence the cache can hold.
                longest = min(num_kv_blocks * block_size, self.config.derived_max_model_len)
                self._graphs = CUDAGraphRunner(
                    self.model, max_num_seqs, -(-longest // block_size), self.device
                )
            # The weights and the zeroed caches were written on the default stream; the
            # steps run on this one, so nothing may still be in flight there.
            torch.cuda.synchronize(self.device)

    # -- the runner protocol -------------------------------------------------------------------

    def submit(self, batch: ScheduledBatch) -> None:
        self._worker.submit(lambda: (batch.step, self._run_on_stream(batch)))

    def collect(self, step: int) -> list[FrameEntry]:
        if not self._worker.num_outstanding:
            raise RuntimeError(f"collect({step}): no step was submitted")
        done, frame = self._worker.result()  # the worker runs the steps in submission order
        if done != step:
            raise RuntimeError(f"collect({step}): the oldest step submitted is {done}")
        return frame

    def close(self) -> None:
        self._worker.close()
        for lane in self._lanes:
            lane.close()
        if self._helper is not None:
            self._helper.close()
        if self._graphs is not None:
            self._graphs.clear()
        self._seqs.clear()
        self._prompt_lps.clear()
        # Closed, it serves nothing: its memory goes now, not when the collector gets to the
        # engine's reference cycles (a next engine in the process needs it).
        release(self)

    @property
    def num_steps_outstanding(self) -> int:
        return self._worker.num_outstanding

    def new_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V tensors for every layer (built, and woken after a sleep)."""
        cfg, dtype, device = self.config, self.dtype, self.device
        shape = (self.num_kv_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        return [
            (_kv_zeros(shape, dtype, device), _kv_zeros(shape, dtype, device))
            for _ in range(cfg.num_hidden_layers)
        ]

    # -- sleep mode (runners.base.SleepsMemory; sleep_memory.py) --------------------------------

    def check_sleep(self, level: int) -> None:
        self.memory.check_sleep(self, level)

    # Sleeping, waking and the weight updates run on the worker, after the steps submitted
    # before them: their torch ops are parallel, and another thread's OpenMP team would slow
    # the worker's (worker.py).

    def sleep(self, level: int) -> None:
        def job() -> None:
            if self._graphs is not None:  # they point into the memory sleep frees, and hold some
                self._graphs.clear()
            self.memory.sleep(self, level)

        self._worker.call(job)

    def wake_up(self, tags: Sequence[str]) -> str | None:
        return cast("str | None", self._worker.call(lambda: self.memory.wake_up(self, tags)))

    # -- weight updates ------------------------------------------------------------------------

    def update_weights(self, weights: WeightsSource) -> str:
        """Validate everything first, then load; returns the new weights' content hash.
        The caller guarantees that no step is in flight."""
        return cast(str, self._worker.call(lambda: self._load(self._checked(weights), None)))

    def stage_weights(self, weights: object) -> WeightChunk:
        return cast(
            WeightChunk, self._worker.call(lambda: StagedWeights.stage_weights(self, weights))
        )

    def load_staged_weights(self) -> str:
        return cast(str, self._worker.call(lambda: StagedWeights.load_staged_weights(self)))

    def _checked(self, weights: object) -> dict[str, torch.Tensor]:
        return prepare_update(self.model, cast(WeightsSource, weights))

    def _hash_stream(self) -> WeightsHashStream:
        return WeightsHashStream(name for name, _ in self.model.named_parameters())

    def _load(self, tensors: dict[str, torch.Tensor], hashing: WeightsHashStream | None) -> str:
        if self._worker.num_outstanding:
            raise RuntimeError("update_weights: steps are still in flight in the runner")
        apply_update(self.model, tensors)
        if self.device.type == "cuda":  # the worker's stream must see the copies
            torch.cuda.synchronize(self.device)
        params = dict(self.model.named_parameters())
        # The parameters hold what the chunks hashed: the rest is hashed from them.
        if hashing is None:
            hashing = self._hash_stream()
        self._weights_id = hashing.hexdigest(params)
        return self._weights_id

    @property
    def weights_id(self) -> str:
        """The content hash of the weights being served (as recorded by WeightsUpdated)."""
        if self._weights_id is None:
            self._weights_id = weights_hash(self.model)
        return self._weights_id

    def _forget_weights_id(self) -> None:
        self._weights_id = None

    def run_worker_call(
        self, call: Callable[[], Any], timeout: float | None
    ) -> tuple[Any, BaseException | None, str | None]:
        """collective_rpc's call, on the worker thread that runs the steps, in their order."""

        def job() -> tuple[Any, BaseException | None, str | None]:
            result, error, changed = self.call_and_rehash(call)
            if changed is not None and self.device.type == "cpu":
                # Written through `.data` (vLLM's weight loaders do), no version counter
                # moved: the matmul's packed copies are made again.
                self.model.prepack()
            return result, error, changed

        return self._worker.call(job, timeout)  # type: ignore[no-any-return]

    # -- LoRA adapters (runners.base.ServesLoRA) -----------------------------------------------

    def add_lora(self, lora_int_id: int, lora_path: str, max_rank: int) -> LoadedLoRA:
        return self._install(lora_int_id, load_peft_adapter(lora_path, max_rank))

    def remove_lora(self, lora_int_id: int) -> None:
        manager = self._lora_manager()
        self._worker.call(lambda: manager.remove(lora_int_id))

    def restore_lora(self, record: LoRAAdded) -> None:
        adapter = load_peft_adapter(record.lora_path, record.rank)
        check_recorded_adapter(
            record.lora_name, record.lora_path, record.adapter_id, adapter.adapter_id
        )
        self._install(record.lora_int_id, adapter)

    def _install(self, lora_int_id: int, adapter: PeftAdapter) -> LoadedLoRA:
        manager = self._lora_manager()
        manager.check(adapter)  # before the step order: a refused one waits for nothing
        self._worker.call(lambda: manager.add(lora_int_id, adapter))
        return LoadedLoRA(
            adapter.adapter_id, adapter.rank, adapter.scaling, list(adapter.target_modules)
        )

    def _lora_manager(self) -> LoRAModelManager:
        if self._lora is None:
            raise LoRAError("LoRA is not enabled: build the engine with enable_lora=True")
        return self._lora

    # -- execution -----------------------------------------------------------------------------

    def _run_on_stream(self, batch: ScheduledBatch) -> list[FrameEntry]:
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                return self._run(batch)
        return self._run(batch)

    def _request_seed(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's seed, or one derived from the engine seed and the prompt."""
        return params.seed if params.seed is not None else prompt_seed(self.seed, prompt)

    def _plan(self, batch: ScheduledBatch) -> list[EntryInputs]:
        """What each entry computes; advances the runner's copies of the sequences."""
        prompt_lps = self._prompt_lps
        for req_id in batch.finished_req_ids:
            self._seqs.pop(req_id, None)
            prompt_lps.drop(req_id)
        plan = []
        for e in batch.entries:
            req_id = e.req_id
            known = batch.token_ids.get(req_id)
            new = batch.new_requests.get(req_id)
            if new is not None:  # (re)entering: rebuild the copy; its blocks are all in the entry
                seq = self._seqs[req_id] = SeqState(
                    new.params,
                    self._request_seed(new.prompt_token_ids, new.params),
                    list(known or ()),
                    list(e.new_block_ids),
                    e.num_computed_before,
                    len(new.prompt_token_ids),
                    self._lora.slot(new.lora_int_id) if self._lora is not None else -1,
                )
                prompt_lps.enter(req_id, new)
            else:
                seq = self._seqs[req_id]
                seq.block_ids += e.new_block_ids
                if known:
                    seq.tokens[e.num_computed_before :] = known
                    seq.num_computed = e.num_computed_before
            drafts = NO_DRAFTS  # shared and never mutated: the common step has none
            if known:
                inputs = known[e.num_computed_before :] if new is not None else known
            else:  # a decode: its input is our own last sample, plus n-gram drafts
                inputs = seq.tokens[seq.num_computed :]
                if e.num_spec_tokens:
                    drafts = propose_ngram_drafts(seq.tokens, e.num_spec_tokens, *self.lookup)
                    inputs = inputs + drafts
            if not inputs:
                raise RuntimeError(
                    f"step {batch.step}: request {req_id!r} was scheduled with no token to compute"
                )
            start = seq.num_computed
            plan.append(
                EntryInputs(
                    req_id,
                    seq,
                    inputs,
                    start,
                    drafts,
                    samples=req_id not in batch.partial_prefills,
                    entering=new is not None,
                    prompt_targets=prompt_lps.targets(req_id, start, len(inputs)),
                )
            )
            # K/V are now cached up to the inputs before the drafts; accepted drafts add to it.
            seq.num_computed = start + len(inputs) - len(drafts)
        return plan

    @torch.inference_mode()
    def _logits(
        self, entries: list[EntryInputs]
    ) -> tuple[torch.Tensor, list[tuple[str, ScoredRows]]]:
        """One forward pass over `entries`: float32 logits of their sample rows, in order,
        and the scored rows of those computing prompt logprobs."""
        batch = build_forward_batch(entries, self.block_size, self.device)
        lora = None
        if batch.lora_slots is not None:
            lora = LoRABatch(batch.lora_slots, torch.get_num_threads())  # the lane's threads
        if self._graphs is not None and self._graphs.fits(batch):
            hidden = self._graphs.forward(batch, self.kv_caches)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, lora)
        scored = score_prompts(entries, hidden, self.model.compute_logits)
        if not batch.sample_rows.numel():  # prefill chunks short of the end sample nothing
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32), scored
        rows = hidden[batch.sample_rows]
        # float32 once here: the sampler and the logprobs both read it.
        logits = self.model.compute_logits(rows, self._logits_buffer(rows.shape[0]))
        return logits.float(), scored

    def _logits_buffer(self, rows: int) -> torch.Tensor | None:
        """This thread's buffer for `rows` rows of logits, row padding included, on the CPU
        in float32: a large vocabulary's logits made fresh at every step cost their page
        faults each time (qwen3-0.6b's 64 decodes: 39 MB, 9 ms). Every use of a step's logits
        ends in its sampling, on the thread that computed them, before that thread computes
        the next step's: one buffer per thread serves every step."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        need = rows + (-rows % self.pad_rows_to if self.pad_rows_to else 0)
        return self.scratch.rows("logits", need, self.vocab_size)

    @torch.inference_mode()
    def _run(self, batch: ScheduledBatch) -> list[FrameEntry]:
        plan = self._plan(batch)
        shares = split_over_lanes(
            plan,
            1 + len(self._lanes),
            self.block_size,
            self._flops_per_token,
            self._kv_bytes_per_token,
            self.min_lane_work,
        )
        for lane, share in zip(self._lanes, shares[1:]):
            lane.submit(functools.partial(self._frames, share))
        with cpu_native.lent_to_this_thread(self._helper if len(shares) == 1 else None):
            frames = self._frames(shares[0])
        for lane in self._lanes[: len(shares) - 1]:
            frames |= lane.result()
        return [frames[e.req_id] for e in plan if e.samples]  # in the step's order

    @torch.inference_mode()
    def _frames(self, entries: list[EntryInputs]) -> dict[str, FrameEntry]:
        """A lane's share of a step: its forward pass, then the sampling of its entries, on
        the same lane (a request's draws depend only on its own seed and positions, so the
        lane that samples it changes no bit; each lane samples while the other computes)."""
        logits, scored = self._logits(entries)
        for req_id, rows in scored:
            self._prompt_lps.add(req_id, rows)
        samplers = [e for e in entries if e.samples]
        if not samplers:
            return {}
        return sample_frames(
            samplers, logits, self.eos_token_id, self._prompt_lps.take, self.logprobs_mode
        )


def _kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On the CPU an anonymous mapping of its own, whose pages the OS
    commits only when a block is first written: the budget bounds the cache, a short run's
    resident memory is what it used (torch.zeros writes every page), and freeing it unmaps
    it. (calloc served a pool from a free chunk of the heap when earlier frees left one:
    every page written by its memset, and none given back on a sleep.) Transparent huge
    pages are asked for, so a first write commits 2 MiB where the kernel allows it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    pages = mmap.mmap(-1, nbytes)  # page-aligned, so aligned for the kernels
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping: it is unmapped when the last view of the cache goes.
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _check_kv_cache_fits(
    shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, device: torch.device
) -> None:
    """A KV cache larger than the device's memory is a configuration error: say so with the
    figures, rather than let the allocator fail (or the OS kill the process) halfway."""
    need = 2 * num_layers * math.prod(shape) * torch.finfo(dtype).bits // 8
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
        where = f"free on {device}"
    else:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "of this machine's memory"
    if need > have:
        raise ValueError(
            f"num_kv_blocks={shape[0]} (block_size={shape[1]}) needs {need / 2**30:,.1f} GiB of KV "
            f"cache, more than the {have / 2**30:,.1f} GiB {where}; pass a smaller num_kv_blocks"
        )
