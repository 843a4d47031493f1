"""Device-side cache state: paged KV and Gated DeltaNet states, as immutable pytrees.

Every jitted entry point takes one of these and returns the next one (donated), so
the state of a decode is always an explicit value. Layers are kept as tuples of
per-layer arrays rather than one stacked array: a layer's update then rewrites only
that layer's buffer, which XLA performs in place under donation.

Paged-KV convention (shared with `mtp.pallas.paged_attention`): one layer's pages are
``[num_pages, page_size, num_kv_heads, head_dim]``; ``block_tables[b, j]`` is the page
that holds positions ``j * page_size ... (j + 1) * page_size - 1`` of batch slot ``b``;
``lengths[b]`` counts the valid positions. Page `NULL_PAGE` is never handed out by the
allocator: an idle slot's block table points there, and padding tokens, whose writes
are dropped, read it; no sequence's page is ever written by padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp.config import ModelConfig

NULL_PAGE = 0


@struct.dataclass
class PagedKV:
    k: tuple[jax.Array, ...]  # per layer [num_pages, page_size, Hkv, D]
    v: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def create(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )


@struct.dataclass
class LinearState:
    """Gated DeltaNet state of every linear-attention layer, per batch slot.

    ``conv[l]``: the last ``kernel - 1`` conv inputs ``[B, kernel - 1, conv_dim]``, channels
    grouped per key head (`mtp.model.gated_deltanet`'s conv order, not the checkpoint's);
    ``recurrent[l]``: the delta-rule matrix ``[B, Hv, Dk, Dv]`` in float32 (it
    integrates thousands of rank-one updates; bf16 would drift).
    """

    conv: tuple[jax.Array, ...]
    recurrent: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, dtype) -> "LinearState":
        n = len(cfg.linear_layers)
        conv = (batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim)
        rec = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return cls(
            conv=tuple(jnp.zeros(conv, dtype) for _ in range(n)),
            recurrent=tuple(jnp.zeros(rec, jnp.float32) for _ in range(n)),
        )

    def select_slots(self, mask: jax.Array, other: "LinearState") -> "LinearState":
        """Per batch slot: this state where ``mask``, else ``other``."""
        def pick(a, b):
            m = mask.reshape(mask.shape + (1,) * (a.ndim - 1))
            return jnp.where(m, a, b)
        return jax.tree.map(pick, self, other)


@struct.dataclass
class TargetCache:
    kv: PagedKV
    linear: LinearState
    block_tables: jax.Array  # [B, max_blocks] int32
    lengths: jax.Array  # [B] int32

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, num_pages: int, page_size: int,
               max_blocks_per_seq: int, dtype) -> "TargetCache":
        return cls(
            kv=PagedKV.create(len(cfg.attention_layers), num_pages, page_size,
                              cfg.num_key_value_heads, cfg.head_dim, dtype),
            linear=LinearState.zeros(cfg, batch, dtype),
            block_tables=jnp.zeros((batch, max_blocks_per_seq), jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
        )


def write_pages(pages: jax.Array, values: jax.Array, block_tables: jax.Array,
                positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Scatter ``values[b, t]`` to position ``positions[b, t]`` of slot ``b``.

    Invalid entries, positions past the block table and positions whose block is
    `NULL_PAGE` are dropped (their index points past the last page), so nothing ever
    writes the null page. Routing them all to one spot instead, as this once did, made
    XLA's GPU scatter serialise every padding row on that address (a partial prefill
    chunk or a carry's tail is padded to a bucket width).
    """
    page_size = pages.shape[1]
    max_blocks = block_tables.shape[1]
    block = positions // page_size
    valid = valid & (positions >= 0) & (block < max_blocks)
    page = jnp.take_along_axis(block_tables, jnp.clip(block, 0, max_blocks - 1), axis=1)
    page = jnp.where(valid & (page != NULL_PAGE), page, pages.shape[0])
    return pages.at[page, positions % page_size].set(values.astype(pages.dtype), mode="drop")
