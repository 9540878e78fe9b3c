"""A Llama/Qwen2/Qwen3-style decoder over a paged KV cache.

One forward pass takes a flattened ragged batch: the new tokens of every scheduled sequence,
prefill chunks and decodes mixed, concatenated into one [T] tensor (as vLLM and nano-vllm do).
Parameter names are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so a
checkpoint's state_dict loads as is and this model's state_dict loads into transformers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokentape import kernels
from tokentape.engine.model import cpu_matmul
from tokentape.engine.model.layers import (
    MLP,
    MLP_ROW_CHUNK,
    Linear,
    LinearFn,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    linear,
    matmul_for,
)
from tokentape.engine.model.model_config import ModelConfig
from tokentape.engine.model.weight_checks import apply_update, checked_update
from tokentape.kernels import FusedOps, cpu_layers
from tokentape.kernels.cpu_layers import LINEAR_NAMES, LayerSpec, LinearSpec, StackShape
from tokentape.kernels.scratch import ThreadScratch
from tokentape.lora.layers import LoRABatch


@dataclass(slots=True)
class AttentionMetadata:
    """Where the batch's tokens sit in the paged KV cache (see tokentape.kernels)."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, -1 skips the write
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: the new tokens of sequence b are [cu[b], cu[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scale = d**-0.5
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * d, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q_proj, k_proj, v_proj = self.q_proj, self.k_proj, self.v_proj
        q = q_proj.add_lora(x, q_proj(x), lora).view(t, self.num_heads, self.head_dim)
        k = k_proj.add_lora(x, k_proj(x), lora).view(t, self.num_kv_heads, self.head_dim)
        v = v_proj.add_lora(x, v_proj(x), lora).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        k_cache, v_cache = kv_cache
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            seq_lens=meta.seq_lens,
            block_tables=meta.block_tables,
            scale=self.scale,
        )
        out = out.reshape(t, self.num_heads * self.head_dim)
        return self.o_proj.add_lora(out, self.o_proj(out), lora)

    def forward_fused(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ops: FusedOps,
        batch: object,
        num_tokens: int,
        matmul: LinearFn,
        packed: bool,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """forward() through a backend's fused operations (kernels.FusedOps): the q/k norms
        and RoPE in one call, the KV write and attention over `batch` (ops.pass_batch, made
        once per pass), the matmuls called directly (layers.matmul_for). `x` may have rows
        past the batch's `num_tokens` (row padding, see CausalLM._forward_fused): they go
        through the matmuls and row operations, not into the cache or attention."""
        rows, t = x.shape[0], num_tokens
        q_proj, k_proj, v_proj, o_proj = self.q_proj, self.k_proj, self.v_proj, self.o_proj
        q = q_proj.add_lora(x, matmul(x, q_proj.weight_for(packed), q_proj.bias), lora)
        k = k_proj.add_lora(x, matmul(x, k_proj.weight_for(packed), k_proj.bias), lora)
        v = v_proj.add_lora(x, matmul(x, v_proj.weight_for(packed), v_proj.bias), lora)
        q = q.view(rows, self.num_heads, self.head_dim)
        k = k.view(rows, self.num_kv_heads, self.head_dim)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        q_norm = self.q_norm.weight if self.qk_norm else None
        k_norm = self.k_norm.weight if self.qk_norm else None
        eps = self.q_norm.eps if self.qk_norm else 0.0
        ops.qk_norm_rope(q, k, q_norm, k_norm, eps, *rope_tables, positions)
        k_cache, v_cache = kv_cache
        ops.write_kv(batch, k[:t], v[:t], k_cache, v_cache)
        # The attention writes the batch's rows of o_proj's input in place; padding rows are
        # zeros (a padded copy per layer cost a fresh [rows, heads x head_dim] tensor).
        out = x.new_empty(rows, self.num_heads * self.head_dim)
        if rows > t:
            out[t:].zero_()
        attn = out[:t].view(t, self.num_heads, self.head_dim)
        ops.attend(batch, q[:t], k_cache, v_cache, self.scale, attn)
        return o_proj.add_lora(out, matmul(out, o_proj.weight_for(packed), o_proj.bias), lora)


def _linear_spec(weight: cpu_matmul.MklWeight, bias: torch.Tensor | None) -> LinearSpec:
    spec = LinearSpec(weight.buffer.data_ptr(), n=weight.out_features, k=weight.in_features)
    if weight.parts:
        assert weight.first_columns is not None
        spec.parts[:] = [part.data_ptr() for part in weight.parts]
        spec.first_column[:] = list(weight.first_columns)
    spec.bias = bias.data_ptr() if bias is not None else None
    return spec


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        # The residual adds go into the sublayers' fresh outputs (a sum is the same either way
        # round), saving two [T, hidden] tensors per layer.
        h = self.self_attn(self.input_layernorm(h), rope, kv_cache, meta, lora).add_(h)
        return self.mlp(self.post_attention_layernorm(h), lora).add_(h)


class DecoderModel(nn.Module):
    """HF's `model.*`: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its LM head (tied to the embeddings when the config says so)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.pad_rows_to = 0  # batch-invariant row padding of the matmuls, 0: off
        self.tied_head = cpu_matmul.PackedWeight()  # the embedding packed as the LM head
        # Run through the kernels' fused operations where the kernel backend has them (the
        # compiled ones on the CPU in float32, Triton's on CUDA: kernels.fused_ops); False
        # keeps the modules' own torch ops (the reference).
        self.fused = True
        # On the CPU, the fused ops of every layer in one C call where the kernels take the
        # pass (cpu_layers.decoder_layers: MKL's packed matmuls, no LoRA); False runs them
        # layer by layer from Python, the same ops in the same order (its oracle).
        self.layers_in_one_call = True
        self._layer_specs: tuple[tuple[object, ...], ctypes.Array[LayerSpec]] | None = None
        self._stack_scratch = ThreadScratch()  # the one call's intermediate rows, per lane
        self.model = DecoderModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )
        c = config  # the layers' sizes as the one-call stack reads them
        self._stack_shape = StackShape(
            c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.rms_norm_eps, self.model.layers[0].self_attn.scale, MLP_ROW_CHUNK,
        )  # fmt: skip

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's model interface, for the code collective_rpc runs: load (name, tensor)
        pairs, every one checked first (names, shapes, finite values: weight_checks.py),
        so a refused load changes nothing. The names loaded."""
        tensors = dict(weights)
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # the embedding is the head
        checked = checked_update(dict(self.named_parameters()), tensors, {})
        apply_update(self, checked)
        return set(checked)

    def set_batch_invariant(self, pad_rows_to: int) -> None:
        """Pad every matmul's rows to a multiple of `pad_rows_to` (0: off); see layers.py."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pad_rows_to = pad_rows_to
        self.pad_rows_to = pad_rows_to

    def prepack(self, split: bool | None = None) -> None:
        """Packed copies of the weights for the CPU's matmul (float32; see layers.Linear),
        the LM head's too when it is the embedding. `split`: packed in parts too, which a
        helper thread shares (cpu_matmul.PackedWeight.split), from now on; None: as before."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if split is not None:
            for p in (*(m.packed_weight for m in linears), self.tied_head):
                p.split = split
        self._layer_specs = None  # it holds the copies it points into
        for m in linears:
            m.prepack()
        if self.config.tie_word_embeddings:
            self.tied_head.pack(self.model.embed_tokens.weight)

    def matmul_weights(self) -> list[object]:
        """The weights the matmuls read, the packed copies where there are (to calibrate)."""
        weights = [m.matmul_weight() for m in self.modules() if isinstance(m, Linear)]
        if self.config.tie_word_embeddings:
            weights.append(self.tied_head.packed_as_is(self.model.embed_tokens.weight))
        return [w.detach() if isinstance(w, torch.Tensor) else w for w in weights]

    def release_cpu_memory(self) -> None:
        """Free what the model keeps beside its weights for the CPU's kernels: the packed
        copies and the layer stack's scratch (a sleeping or closed runner's memory)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed_weight.drop()
        self.tied_head.drop()
        self._layer_specs = None  # it holds the copies it points into
        self._stack_scratch.clear()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; `lora`: the rows' LoRA adapters."""
        # The caches as the pass found them, held until it ends: the kernels write through
        # their addresses, and a cache dropped from the list meanwhile would be unmapped.
        kv_caches = list(kv_caches)
        h = self.model.embed_tokens(input_ids)
        # The fused pass calls the kernels the dispatch (TOKENTAPE_KERNELS, else auto) chooses
        # for these tensors: the compiled CPU ones (float32, a built library) or Triton's.
        ops = (
            kernels.fused_ops(kernels.resolve_backend(h.device, None, h.dtype))
            if self.fused
            else None
        )
        if ops is not None:
            return self._forward_fused(h, positions, kv_caches, meta, lora, ops)
        rope = self.rope.cos_sin(positions, h.dtype)  # the same for every layer
        for layer, kv in zip(self.model.layers, kv_caches):
            h = layer(h, rope, kv, meta, lora)
        return self.model.norm(h)

    def _forward_fused(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoRABatch | None,
        ops: FusedOps,
    ) -> torch.Tensor:
        """forward() through a kernel backend's fused operations (kernels.FusedOps): a
        residual stream updated in place, each norm fused with the add before it, the q/k
        norms with RoPE and SwiGLU's activation one call each. The same formulas as the
        modules."""
        layers = self.model.layers
        rope_tables = (self.rope.cos_cached, self.rope.sin_cached)
        positions = positions.to(torch.int64)
        t = h.shape[0]
        # The batch in the kernels' form and the matmul, chosen once for every layer: with
        # two lanes at once, each Python step of a pass waits for the GIL.
        batch = ops.pass_batch(
            meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.slot_mapping
        )
        matmul, packed = matmul_for(h)
        # Batch-invariant row padding (layers.linear) done once here, not at every matmul:
        # the padding rows go through the whole pass (rows do not mix outside attention,
        # which reads the first t) and are cut off at the end.
        pad = -t % self.pad_rows_to if self.pad_rows_to else 0
        if pad:
            h, positions = F.pad(h, (0, 0, 0, pad)), F.pad(positions, (0, pad))
        residual = h  # a fresh tensor from the embedding lookup (or the padding)
        first = layers[0].input_layernorm
        one_call = ops is cpu_layers and lora is None and packed
        stack = self._cpu_layer_specs(kv_caches) if one_call else None
        if stack is not None:
            specs, compute = stack
            x = cpu_layers.decoder_layers(
                batch, specs, self._stack_shape, first.weight, residual, positions,
                *rope_tables, t, kv_caches[0][0].shape[:2], compute, cpu_matmul.SPLIT_MIN_ROWS,
                self._stack_scratch,
            )  # fmt: skip
            if x is not None:
                return x[:t] if pad else x
        x = ops.rms_norm(residual, first.weight, first.eps)
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            attn = layer.self_attn
            a = attn.forward_fused(
                x, positions, rope_tables, kv, ops, batch, t, matmul, packed, lora
            )
            post = layer.post_attention_layernorm
            x = ops.add_rms_norm(a, residual, post.weight, post.eps)
            m = layer.mlp.forward_fused(x, matmul, packed, ops, lora)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = ops.add_rms_norm(m, residual, norm.weight, norm.eps)
        return x[:t] if pad else x

    def _cpu_layer_specs(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[ctypes.Array[LayerSpec], int] | None:
        """The layers as cpu_layers.decoder_layers reads them, with the address of MKL's
        compute function it calls, or None where it cannot run them: off, no MKL, a weight
        without MKL's packed copy, or caches it does not take as they are (the pass layer by
        layer checks them, and says what is wrong). Made again only when a packed copy, a
        norm, a bias or a cache is not the one it was made from."""
        compute = cpu_matmul.mkl_compute_address()
        if not self.layers_in_one_call or compute is None:
            return None
        c = self.config
        shape = (*kv_caches[0][0].shape[:2], c.num_key_value_heads, c.head_dim)
        caches = [t for kv in kv_caches for t in kv]
        if len(kv_caches) != len(self.model.layers) or not all(
            t.shape == shape
            and t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.is_contiguous()
            for t in caches
        ):
            return None
        layers = self.model.layers
        linears = [
            (m, m.weight_for(True))
            for layer in layers
            for m in (
                layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                layer.mlp.down_proj,
            )
        ]  # fmt: skip
        if not all(isinstance(w, cpu_matmul.MklWeight) for _, w in linears):
            return None
        tensors = [
            t
            for m in self.modules()
            if isinstance(m, (RMSNorm, Linear))
            for t in (m.weight, getattr(m, "bias", None))
            if t is not None
        ]
        key = (
            *(w for _, w in linears),
            *(t.data_ptr() for t in tensors),
            *(t.data_ptr() for t in caches),
        )
        if self._layer_specs is not None and self._layer_specs[0] == key:
            return self._layer_specs[1], compute
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        specs = (LayerSpec * len(layers))()
        for i, (layer, (k_cache, v_cache), next_norm) in enumerate(zip(layers, kv_caches, norms)):
            spec = specs[i]
            for name, (m, w) in zip(LINEAR_NAMES, linears[7 * i : 7 * i + 7]):
                setattr(spec, name, _linear_spec(w, m.bias))
            attn = layer.self_attn
            spec.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            spec.next_norm = next_norm.weight.data_ptr()
            spec.q_norm = attn.q_norm.weight.data_ptr() if attn.qk_norm else None
            spec.k_norm = attn.k_norm.weight.data_ptr() if attn.qk_norm else None
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._layer_specs = (key, specs)
        return specs, compute

    def compute_logits(
        self, hidden: torch.Tensor, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits [rows, vocab]; `into`: a buffer they may be written into (see
        layers.linear: row padding included)."""
        if not self.config.tie_word_embeddings:
            return self.lm_head(hidden, into)
        weight = self.model.embed_tokens.weight
        if matmul_for(hidden)[1]:
            weight = self.tied_head.current(weight)
        return linear(hidden, weight, None, self.pad_rows_to, into)
