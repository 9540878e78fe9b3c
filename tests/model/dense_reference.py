"""For the model tests: a dense (non-paged) forward pass of the same weights, an independent
check of the engine's paged path. A plain module (not conftest.py), imported by its name."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokentape.engine.model.decoder import CausalLM


def dense_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] from a plain causal forward pass (no KV cache, SDPA)."""
    cfg = model.config
    model.rope.extend(len(tokens))  # the engine's runner sizes it to its KV cache
    with torch.no_grad():
        ids = torch.tensor(tokens)
        pos = torch.arange(len(tokens))
        h = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            a = layer.self_attn
            x = layer.input_layernorm(h)
            t = x.shape[0]
            q = F.linear(x, a.q_proj.weight, a.q_proj.bias).view(t, a.num_heads, a.head_dim)
            k = F.linear(x, a.k_proj.weight, a.k_proj.bias).view(t, a.num_kv_heads, a.head_dim)
            v = F.linear(x, a.v_proj.weight, a.v_proj.bias).view(t, a.num_kv_heads, a.head_dim)
            if cfg.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = model.rope(pos, q, k)
            rep = a.num_heads // a.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            h = h + F.linear(o.transpose(0, 1).reshape(t, -1), a.o_proj.weight)
            m = layer.mlp
            x = layer.post_attention_layernorm(h)
            h = h + F.linear(
                F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight),
                m.down_proj.weight,
            )
        h = model.model.norm(h)
        w = model.model.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
        return F.linear(h, w)


def dense_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(dense_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
