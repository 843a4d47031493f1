"""The paged KV cache's layout and its page writes, shared by the attention ops and the caches.

One layer's pages are ``[num_pages, page_size, num_kv_heads, head_dim]``; ``block_tables[b, j]``
is the page that holds positions ``j * page_size ... (j + 1) * page_size - 1`` of batch slot
``b``; ``lengths[b]`` counts the valid positions. Page `NULL_PAGE` is never handed out by the
allocator (`mtp.cache.pages`): an idle slot's block table points there, and padding tokens,
whose writes are dropped, read it; no sequence's page is ever written by padding.
`mtp.ops.paged_attention` reads this layout, `mtp.ops.attn_prologue` writes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0


def write_pages(pages: jax.Array, values: jax.Array, block_tables: jax.Array,
                positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Scatter ``values[b, t]`` to position ``positions[b, t]`` of slot ``b``.

    Invalid entries, positions past the block table and positions whose block is
    `NULL_PAGE` are dropped (their index points past the last page), so nothing ever
    writes the null page. Routing them all to one spot instead made XLA's GPU scatter
    serialise every padding row on that address (a partial prefill chunk or a carry's
    tail is padded to a bucket width).
    """
    page_size = pages.shape[1]
    max_blocks = block_tables.shape[1]
    block = positions // page_size
    valid = valid & (positions >= 0) & (block < max_blocks)
    page = jnp.take_along_axis(block_tables, jnp.clip(block, 0, max_blocks - 1), axis=1)
    page = jnp.where(valid & (page != NULL_PAGE), page, pages.shape[0])
    return pages.at[page, positions % page_size].set(values.astype(pages.dtype), mode="drop")
