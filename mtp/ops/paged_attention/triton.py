"""Both forms' shared merge kernel and the Triton-lowered form of the paged attention.

`merge_splits` combines the per-split partials of either form (`merge_splits_reference`'s
definition); `paged_attention_triton` is the attention itself lowered through Triton, one page
per loop step (opt-in: `mtp.ops.dispatch.OPT_IN`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mtp.ops.lowering import num_sms, triton_compiler_params
from mtp.ops.paged_attention.reference import MASKED_M, check_inputs, query_rows

MAX_ROWS = 64  # query rows (G heads x Q queries) a KV head's program stacks in either form: wgmma's M
LOG2E = math.log2(math.e)


def too_many_rows(q, k_pages) -> str | None:
    """Both forms stack a KV head's ``Q * G`` queries as the rows of one operand of at most ``MAX_ROWS``."""
    _, nq, hq, _ = q.shape
    g = hq // k_pages.shape[2]
    if nq * g > MAX_ROWS:
        return (f"Q * (Hq / Hkv) = {nq} * {g} = {nq * g} query rows per KV head exceeds the "
                f"kernel's {MAX_ROWS}; split the queries into several calls")
    return None


def triton_unsupported(q, k_pages) -> str | None:
    """Why the Triton form cannot take these inputs, or None."""
    d, page = q.shape[-1], k_pages.shape[1]
    if why := too_many_rows(q, k_pages):
        return why
    if d & (d - 1) or d < 16 or page & (page - 1) or page < 16:
        return f"head dim {d} and page size {page} must be powers of two >= 16 (Triton's dot tiles)"
    if q.dtype != k_pages.dtype:
        return f"q ({q.dtype}) and the pages ({k_pages.dtype}) differ in dtype"
    if k_pages.size >= 2**31:
        return f"a page pool of {k_pages.size} elements: past int32 offsets"
    return None


def triton_splits(b: int, hkv: int, max_blocks: int, num_sms: int) -> int:
    """About one program per multiprocessor, each over a contiguous run of whole pages."""
    return max(1, min(max_blocks, -(-num_sms // (b * hkv))))


@functools.partial(jax.jit, static_argnames=("scale", "splits", "interpret"))
def paged_attention_triton(q, k_pages, v_pages, block_tables, lengths, *, scale=None, gate=None,
                           splits=None, interpret=False):
    """The paged attention of `api.paged_attention`, lowered through Triton: one page per loop step.

    Why a second form, measured in the model against the Mosaic kernel (results/decode/decode_h200.md,
    2026-11-30): it is faster at small shapes (the default model's plain loop 1.045x; the
    1.38B model's 4 calls at batch 1 22.9 vs 24.6 µs) and 1.47x slower at batch 8 with
    (16, 2, 256) heads, hence opt-in. (It was built because deviceless compiles showed the
    Mosaic calls outside XLA's CUDA graphs; with the target's CUDA driver stated, both forms
    are recorded into them, 2026-11-30.) The work is split as in the Mosaic
    kernel: programs ``(B, Hkv, splits)``, each over a contiguous run of pages with an
    online softmax, the ``Q * G`` query rows of a KV head stacked as the rows of one dot
    (padded to a power of two >= 16), and the same partials merged by ``merge_splits``.
    ``interpret``: Pallas' interpreter (CPU tests).
    """
    check_inputs(q, k_pages, v_pages, block_tables, lengths, gate)
    why = triton_unsupported(q, k_pages)
    if why:
        raise ValueError(why)
    b, nq, hq, d = q.shape
    _, page, hkv, _ = k_pages.shape
    g = hq // hkv
    rows = max(16, 1 << (nq * g - 1).bit_length())  # Triton's dot tiles: a power of two >= 16
    max_blocks = block_tables.shape[1]
    num_splits = splits or triton_splits(b, hkv, max_blocks, num_sms())
    per_split = -(-max_blocks // num_splits)
    scale_log2 = (d**-0.5 if scale is None else scale) * LOG2E
    qr = query_rows(q, hkv, rows)

    def kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, lse_ref):
        bi, h, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        length = len_ref[bi]
        first = si * per_split
        last = jnp.minimum(first + per_split, lax.div(length + page - 1, page))
        qt = q_ref[0, 0]  # [rows, D]
        r = lax.broadcasted_iota(jnp.int32, (rows, page), 0)
        col = lax.broadcasted_iota(jnp.int32, (rows, page), 1)
        # Query row r sits at position length - Q + r // G and sees the KV at or before it.
        pos = length - nq + lax.div(r, jnp.int32(g))

        def body(j, carry):
            m_i, l_i, acc = carry
            pid = bt_ref[bi, j]
            k = k_ref[pid, :, h, :]  # [page, D]
            v = v_ref[pid, :, h, :]
            s = lax.dot_general(qt, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            t = j * page + col
            s = jnp.where((t <= pos) & (t < length), s * scale_log2, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            p = jnp.exp2(s - m_new[:, None])
            alpha = jnp.exp2(m_i - m_new)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return m_new, l_i * alpha + p.sum(axis=1), acc * alpha[:, None] + pv

        init = (jnp.full((rows,), MASKED_M, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, d), jnp.float32))
        m_i, l_i, acc = lax.fori_loop(first, jnp.maximum(first, last), body, init)
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        o_ref[0, 0, 0] = (acc / l_safe[:, None]).astype(o_ref.dtype)
        lse_ref[0, 0, 0] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(l_safe))

    whole = lambda a: pl.BlockSpec(a.shape, lambda bi, h, si: (0,) * a.ndim)
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=[pl.BlockSpec((1, 1, rows, d), lambda bi, h, si: (bi, h, 0, 0)),
                  whole(k_pages), whole(v_pages), whole(block_tables), whole(lengths)],
        out_specs=[pl.BlockSpec((1, 1, 1, rows, d), lambda bi, h, si: (bi, h, si, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda bi, h, si: (bi, h, si, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, num_splits, rows, d), q.dtype),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32)],
        interpret=interpret,
        name="paged_attention_parts",  # the kernel's name in a profile (CUPTI)
        **triton_compiler_params(interpret, num_warps=4, num_stages=2),
    )(qr, k_pages, v_pages, block_tables.astype(jnp.int32), lengths.astype(jnp.int32))
    return merge_splits(o_part, lse_part, q, gate, interpret=interpret)


_MERGE_COLUMNS = 64  # head-dim columns per merge program


@functools.partial(jax.jit, static_argnames=("interpret",))
def merge_splits(o_part, lse_part, q, gate, *, interpret=False):
    """`merge_splits_reference` as one kernel, for both forms of the paged attention.

    XLA ran the merge as three kernels (the splits' maximum, the weighted sum, the gate
    and the layout), ~4.5 µs a layer at batch 1 on the H200 (results/decode/decode_h200.md,
    2026-11-30), where their data is a few KB. Here one program per (sequence, KV head,
    query row, 64 columns) walks the splits with a running maximum (the online form of the
    reference's two passes; one rounding apart), applies the gate and writes its row in the
    ``[B, Q, Hq, D]`` layout. Pallas' Triton lowering: every load a power of two, which a
    split count (about one per SM) is not, so the splits are a static loop.
    """
    b, nq, hq, d = q.shape
    _, hkv, num_splits, _, _ = o_part.shape
    g = hq // hkv
    dc = min(d, _MERGE_COLUMNS)
    if d % dc:  # both attention forms take power-of-two head dims
        raise ValueError(f"head dim {d} is not a multiple of the merge's {dc} columns")
    f32 = jnp.float32

    def kernel(o_ref, lse_ref, *rest):
        gate_ref, out_ref = rest if gate is not None else (None, *rest)
        m = jnp.full((), MASKED_M, f32)
        denom = jnp.zeros((), f32)
        acc = jnp.zeros((dc,), f32)
        for split in range(num_splits):
            lse = lse_ref[0, 0, split, 0]
            m_new = jnp.maximum(m, lse)
            alpha, w = jnp.exp2(m - m_new), jnp.exp2(lse - m_new)  # w = 0 for an empty split
            denom = denom * alpha + w
            acc = acc * alpha + w * o_ref[0, 0, split, 0, :].astype(f32)
            m = m_new
        out = acc / jnp.where(denom == 0, 1.0, denom)
        if gate_ref is not None:
            out = out * jax.nn.sigmoid(gate_ref[0, 0, 0, :].astype(f32))
        out_ref[0, 0, 0, :] = out.astype(out_ref.dtype)

    # Program (bi, h, r, c): query i = r // G of KV head h's group, head h G + r % G.
    row = pl.BlockSpec((1, 1, 1, dc), lambda bi, h, r, c: (bi, r // g, h * g + r % g, c))
    in_specs = [pl.BlockSpec((1, 1, num_splits, 1, dc), lambda bi, h, r, c: (bi, h, 0, r, c)),
                pl.BlockSpec((1, 1, num_splits, 1), lambda bi, h, r, c: (bi, h, 0, r))]
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, nq * g, d // dc),
        in_specs=in_specs + ([row] if gate is not None else []),
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        name="paged_attention_merge",
        **triton_compiler_params(interpret, num_warps=1),
    )(o_part, lse_part, *(() if gate is None else (gate,)))
