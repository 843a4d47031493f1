"""Device-side cache state: paged KV and Gated DeltaNet states, as immutable pytrees.

Every jitted entry point takes one of these and returns the next one (donated), so
the state of a decode is always an explicit value. Layers are kept as tuples of
per-layer arrays rather than one stacked array: a layer's update then rewrites only
that layer's buffer, which XLA performs in place under donation.

The paged KV's layout, its null page and its page writes are `mtp.ops.paged_kv`'s, shared
with the attention kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp.config import ModelConfig


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

