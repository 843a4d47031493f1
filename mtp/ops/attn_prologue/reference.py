"""What a gated-attention layer does between its q/k/v GEMM and attention, in pure JAX.

The model's own functions: the split of ``q_proj``'s output into the query and the output
gate (`query_and_gate`), the per-head RMS norms of q and k (`key_values` for k),
the partial RoPE (`rope`), all composed in `qkv_of`, and the page writes of k and v
(`mtp.ops.paged_kv.write_pages`). `mtp.model.layers` runs them for every attention call;
`attn_prologue_reference` composes them into the definition the kernel (`triton`) is tested
against. They read a config under `mtp.config.ModelConfig`'s field names, which
`AttentionShape` carries for the kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp.ops.norms import rms_norm
from mtp.ops.paged_kv import write_pages


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """A gated-attention layer's heads and its norm and RoPE constants, under `ModelConfig`'s field names.

    What the layer's functions here read of a config. Hashable: a jit static.
    """

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def of(cls, cfg) -> "AttentionShape":
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
                   cfg.rope_theta, cfg.rms_norm_eps)


def rope(x: jax.Array, positions: jax.Array, cfg) -> jax.Array:
    """Partial rotary embedding on the first ``rotary_dim`` channels of each head.

    x: ``[..., T, H, D]``; positions: ``[..., T]`` (sequence space, any integer).
    """
    rd = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, rd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, rd]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    rot, keep = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, keep], axis=-1)


def query_and_gate(q_columns, lead: tuple[int, ...], cfg):
    """``q_proj``'s output split per head into the query and the output gate, each ``[*lead, Hq, D]``.

    ``q_columns``: its columns in a GEMM's output rows, with ``view(lead)`` the ``[*lead, Hq 2 D]``
    array (`mtp.model.gemm_layout.Columns`).
    """
    d = cfg.head_dim
    qg = q_columns.view(lead).reshape(*lead, cfg.num_attention_heads, 2 * d)
    return qg[..., :d], qg[..., d:]


def key_values(k: jax.Array, v: jax.Array, k_norm_w: jax.Array, lead: tuple[int, ...], cfg):
    """Projected keys (normed) and values ``[*lead, Hkv D]`` as ``[*lead, Hkv, D]``."""
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    k = rms_norm(k.reshape(*lead, hkv, d), k_norm_w, cfg.rms_norm_eps)
    return k, v.reshape(*lead, hkv, d)


def qkv_of(columns, q_norm_w, k_norm_w, positions: jax.Array, lead: tuple[int, ...], cfg):
    """Rotated ``q [*lead, Hq, D]``, ``k, v [*lead, Hkv, D]`` and the output gate from the q (with its
    gate), k and v projections' columns (each with ``view(lead)``): the norms, the RoPE and the gate's split."""
    q, gate = query_and_gate(columns[0], lead, cfg)
    k, v = (c.view(lead) for c in columns[1:])
    q = rms_norm(q, q_norm_w, cfg.rms_norm_eps)
    k, v = key_values(k, v, k_norm_w, lead, cfg)
    return rope(q, positions, cfg), rope(k, positions, cfg), v, gate


def attn_prologue_reference(columns, q_norm_w, k_norm_w, rope_positions, slots, k_pages, v_pages,
                            block_tables, write, *, heads: AttentionShape):
    """``(q [B, T, Hq, D], gate [B, T, Hq, D], k_pages, v_pages)`` as the model computes them.

    columns: the q (with its gate), k and v projections' columns in their GEMM output rows
    (`mtp.model.layers.attention_columns`: ``rows``, ``start``, ``view(lead)``), of the tokens
    ``[B, T]`` of ``rope_positions`` (RoPE's sequence positions); ``slots [B, T]``: where each
    token's K/V land in its sequence's pages (``block_tables``); ``write [B, T]``: which tokens write.
    """
    q, k, v, gate = qkv_of(columns, q_norm_w, k_norm_w, rope_positions, rope_positions.shape, heads)
    return (q, gate, write_pages(k_pages, k, block_tables, slots, write),
            write_pages(v_pages, v, block_tables, slots, write))
