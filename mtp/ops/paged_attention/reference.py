"""Attention over paged KV for decode (Q = 1) and verify (Q = K new tokens), in pure JAX.

`paged_attention_reference` gathers every sequence's pages into a dense KV and runs masked
softmax attention: the definition both kernels (`mosaic`, `triton`) are tested against, and
the path the model takes on a CPU. `merge_splits_reference` defines how the kernels' per-split
partials (flash-decoding) combine, and `query_rows` the operand they stack a KV head's queries
in. The pages are `mtp.ops.paged_kv`'s layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_M = -1e30  # finite start for a running max, so empty rows never yield inf - inf


def check_inputs(q, k_pages, v_pages, block_tables, lengths, gate):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_pages, page_size, Hkv, D]; got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    b, nq, hq, d = q.shape
    _, _, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the KV pages ({dk}) differ")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, max_blocks], got {block_tables.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B={b}], got {lengths.shape}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"gate must have q's shape {q.shape}, got {gate.shape}")


def paged_attention_reference(
    q, k_pages, v_pages, block_tables, lengths, *, scale=None, gate=None, impl="reference"
):
    """Gathers every sequence's pages into a dense KV and runs masked softmax attention.

    The definition the kernel is tested against; also the path the model takes on
    CPU. ``impl`` is accepted (and ignored) so both functions share one signature.
    """
    del impl
    check_inputs(q, k_pages, v_pages, block_tables, lengths, gate)
    b, nq, hq, d = q.shape
    _, page, hkv, _ = k_pages.shape
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    k = k_pages[block_tables].reshape(b, -1, hkv, d)
    v = v_pages[block_tables].reshape(b, -1, hkv, d)
    qg = q.reshape(b, nq, hkv, g, d)
    s = jnp.einsum("bqhgd,bthd->bqhgt", qg, k, preferred_element_type=jnp.float32) * scale
    t = jnp.arange(k.shape[1])
    pos = lengths[:, None] - nq + jnp.arange(nq)[None, :]  # [B, Q] absolute positions
    valid = (t[None, None, :] <= pos[:, :, None]) & (t[None, None, :] < lengths[:, None, None])
    valid = valid[:, :, None, None, :]
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bqhgt,bthd->bqhgd", p, v.astype(jnp.float32))
    o = o.reshape(b, nq, hq, d)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate.astype(jnp.float32))
    return o.astype(q.dtype)


def query_rows(q, hkv: int, rows: int):
    """``[B, Q, Hq, D]`` -> ``[B, Hkv, rows, D]``: a KV head's ``Q * G`` queries as the rows of one
    operand (row ``r`` holds query ``r // G``, head ``r % G``), zero-padded to ``rows``."""
    b, nq, hq, d = q.shape
    g = hq // hkv
    qr = q.reshape(b, nq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, nq * g, d)
    return jnp.pad(qr, ((0, 0), (0, 0), (0, rows - nq * g), (0, 0)))


def merge_splits_reference(o_part, lse_part, q, gate):
    """Combines the per-split partials (log2 domain) and applies the output gate: the definition.

    o_part: ``[B, Hkv, S, R, D]`` (each split's normalised output, rows ``r = i G + g`` past
    ``Q G`` ignored); lse_part: ``[B, Hkv, S, R]`` (its log2-sum-exp, -inf for an empty split
    or row); q: the queries ``[B, Q, Hq, D]`` (their shape and dtype); gate: None or
    ``[B, Q, Hq, D]``. Returns ``[B, Q, Hq, D]`` in q's dtype.
    """
    b, nq, hq, d = q.shape
    hkv = o_part.shape[1]
    g = hq // hkv
    rows = nq * g
    lse = lse_part[..., :rows]  # [B, Hkv, S, R]
    o = o_part[..., :rows, :].astype(jnp.float32)
    top = jnp.maximum(jnp.max(lse, axis=2, keepdims=True), MASKED_M)
    w = jnp.exp2(lse - top)  # zero for empty splits and empty rows
    denom = jnp.sum(w, axis=2)
    o = jnp.sum(o * w[..., None], axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]
    o = o.reshape(b, hkv, nq, g, d).transpose(0, 2, 1, 3, 4).reshape(b, nq, hq, d)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate.astype(jnp.float32))
    return o.astype(q.dtype)
