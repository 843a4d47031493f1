"""Attention over paged KV for decode (Q = 1) and verify (Q = K new tokens).

Decode and verify are memory-bound: every step streams each sequence's whole KV
once while doing a few FLOPs per byte. The kernel therefore aims at one thing,
reading each KV head's pages exactly once at close to copy bandwidth:

* All G query heads of a KV head and all Q queries share one program, stacked
  as the rows of a 64-row wgmma operand (row ``r = i * G + g``), so the pages of
  that KV head are read once for all of them. Q = 4 then costs about what Q = 1
  costs (the wgmma rows are there either way).
* The sequence is split across programs (flash-decoding): grid
  ``(splits, Hkv, B)``, each program walks a contiguous range of KV tiles with
  an online softmax and writes an unnormalised-free partial (its normalised
  output in bf16 plus a log2-sum-exp per row). A small kernel (``merge_splits``)
  merges the splits, applies the optional sigmoid output gate and restores the
  ``[B, Q, Hq, D]`` layout; it reads ``splits * Q * G * D`` values per KV head,
  a few percent of the KV bytes.
* KV tiles of ``block_kv`` tokens are gathered page by page with TMA straight
  into swizzled shared memory (one copy per page, all completing on one
  barrier), ``stages`` tiles in flight, so the copy engine keeps streaming
  while the warpgroup runs the two wgmmas and the softmax of an earlier tile.

Pages past a sequence's length are never read; the slots of the last, partial
tile beyond the length are masked out of the scores. Their V rows still enter
the P @ V product multiplied by exactly zero, so those page slots must hold
finite values (any page the cache allocates does: it is zero-initialised or
holds older tokens).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from mtp.pallas.backend import (TENSOR_AXIS, interpret_forced, num_sms, resolve_impl, swizzle_transforms,
                                tensor_parallel_mesh, triton_compiler_params)

_ROWS = 64  # wgmma's M: query rows (G heads x Q queries, zero-padded) per program.
_LOG2E = math.log2(math.e)
_SMEM_BYTES = 227 * 1024  # Hopper's per-block shared memory limit (232,448 bytes).
_MASKED_M = -1e30  # finite start for the running max, so empty rows never yield inf - inf.


def _check_inputs(q, k_pages, v_pages, block_tables, lengths, gate):
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
    _check_inputs(q, k_pages, v_pages, block_tables, lengths, gate)
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


def _query_rows(q, hkv: int, rows: int):
    """``[B, Q, Hq, D]`` -> ``[B, Hkv, rows, D]``: a KV head's ``Q * G`` queries as the rows of one
    operand (row ``r`` holds query ``r // G``, head ``r % G``), zero-padded to ``rows``."""
    b, nq, hq, d = q.shape
    g = hq // hkv
    qr = q.reshape(b, nq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, nq * g, d)
    return jnp.pad(qr, ((0, 0), (0, 0), (0, rows - nq * g), (0, 0)))


def _choose_block_kv(d: int, page: int, block: int | None = None) -> int:
    """KV tokens per pipeline stage: 64 KiB of K+V per stage for D = 128 or 256."""
    block = block or (128 if d <= 128 else 64)
    if page > block:
        if page % block:
            raise ValueError(f"page_size {page} must be a multiple of {block} or divide it")
    elif block % page:
        raise ValueError(f"page_size {page} must divide {block} (KV tokens per tile)")
    return block


def _choose_splits(b: int, hkv: int, max_tiles: int, num_sms: int) -> int:
    """As many splits as fill the multiprocessors in one wave (one program fits per SM).

    Measured on the H200 (results/kernels/kernels_h200.md): at B=8, 8k, (16, 2, 256) a split
    count giving 2.06 waves ran at 2.4 TB/s, the rest of the last wave idling.
    """
    return max(1, min(num_sms // (b * hkv), max_tiles))


def _too_many_rows(q, k_pages) -> str | None:
    """Both forms stack a KV head's ``Q * G`` queries as the rows of one operand of at most ``_ROWS``."""
    _, nq, hq, _ = q.shape
    g = hq // k_pages.shape[2]
    if nq * g > _ROWS:
        return (f"Q * (Hq / Hkv) = {nq} * {g} = {nq * g} query rows per KV head exceeds the "
                f"kernel's {_ROWS}; split the queries into several calls")
    return None


def kernel_unsupported(q, k_pages, block_kv: int | None = None) -> str | None:
    """Why the kernel cannot take these inputs, or None when it can.

    `paged_attention` sends such calls (a long prefill chunk, f32 caches, odd head
    dims) to the reference whatever ``impl`` says, so one switch can turn the
    kernels on for a whole model; the kernel entry itself raises this message.
    """
    d, page = q.shape[-1], k_pages.shape[1]
    if why := _too_many_rows(q, k_pages):
        return why
    if d not in (64, 128, 256):  # P @ V runs in whole chunks of min(D, 128) columns
        return f"head dim {d} must be 64, 128 or 256"
    if q.dtype != k_pages.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q and pages must share a 16-bit dtype, got {q.dtype}, {k_pages.dtype}"
    try:
        _choose_block_kv(d, page, block_kv)
    except ValueError as e:
        return str(e)
    return None


@functools.partial(jax.jit, static_argnames=("scale", "stages", "splits", "block_kv"))
def _paged_attention_pallas(q, k_pages, v_pages, block_tables, lengths, *, scale, gate,
                            stages=None, splits=None, block_kv=None):
    b, nq, hq, d = q.shape
    _, page, hkv, _ = k_pages.shape
    g = hq // hkv
    why = kernel_unsupported(q, k_pages, block_kv)
    if why:
        raise ValueError(why)
    block_kv = _choose_block_kv(d, page, block_kv)
    pages_per_tile = max(1, block_kv // page)
    tiles_per_page = max(1, page // block_kv)

    # Pad the block table to whole tiles so that the last tile's page ids are in range.
    max_blocks = block_tables.shape[1]
    padded = -(-max_blocks // pages_per_tile) * pages_per_tile
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - max_blocks)))
    max_tiles = padded // pages_per_tile * tiles_per_page
    num_splits = splits or _choose_splits(b, hkv, max_tiles, num_sms())
    tiles_per_split = -(-max_tiles // num_splits)
    if stages is None:
        # Barriers and Mosaic's own scratch take ~3 KB beyond the buffers listed here.
        fixed = (_ROWS * d + _ROWS * block_kv) * 2 + _ROWS * 4 + 4096
        stages = max(1, min(4, (_SMEM_BYTES - fixed) // (2 * block_kv * d * 2)))
    stages = max(1, min(stages, tiles_per_split))

    qr = _query_rows(q, hkv, _ROWS)
    scale_log2 = (d**-0.5 if scale is None else scale) * _LOG2E
    dtype = q.dtype
    d_chunk = min(d, 128)

    def kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, lse_ref,
               q_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bar, v_bar):
        split = lax.axis_index("split")
        h = lax.axis_index("head")
        bi = lax.axis_index("batch")
        length = len_ref[bi]
        n_tiles = lax.div(length + (block_kv - 1), jnp.int32(block_kv))
        t0 = split * tiles_per_split
        n = jnp.clip(n_tiles - t0, 0, tiles_per_split)

        plgpu.copy_gmem_to_smem(q_ref.at[bi, h], q_smem, q_bar.at[0])

        def issue(step, slot):
            tile = t0 + step
            if tiles_per_page == 1:
                for j in range(pages_per_tile):
                    pid = bt_ref[bi, tile * pages_per_tile + j]
                    dst = pl.ds(j * page, page)
                    plgpu.copy_gmem_to_smem(k_ref.at[pid, :, h, :], k_smem.at[slot, dst], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[pid, :, h, :], v_smem.at[slot, dst], v_bar.at[slot])
            else:
                pid = bt_ref[bi, lax.div(tile, jnp.int32(tiles_per_page))]
                src = pl.ds(lax.rem(tile, jnp.int32(tiles_per_page)) * block_kv, block_kv)
                plgpu.copy_gmem_to_smem(k_ref.at[pid, src, h, :], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[pid, src, h, :], v_smem.at[slot], v_bar.at[slot])

        for s in range(stages):
            @pl.when(s < n)
            def _prologue():
                issue(jnp.int32(s), s)

        plgpu.barrier_wait(q_bar.at[0])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m_i = plgpu.layout_cast(jnp.full((_ROWS,), _MASKED_M, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0.0, jnp.float32), row_layout)
        # The output accumulator lives in column chunks of at most 128 so that each P @ V
        # wgmma result can be added in without holding two full [64, 256] f32 arrays.
        acc = tuple(
            plgpu.layout_cast(jnp.full((_ROWS, d_chunk), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            for _ in range(d // d_chunk)
        )
        # Query row r sits at position length - Q + r // G and sees kv <= that position:
        # kv - (length - Q) <= r // G  <=>  G * (kv - length + Q) <= r.
        row_ids = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
        col_ids = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)

        def body(step, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(stages))
            plgpu.barrier_wait(k_bar.at[slot])

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                return acc_ref[...]

            s = pl.run_scoped(qk_scope, plgpu.ACC((_ROWS, block_kv), jnp.float32))
            kv0 = (t0 + step) * block_kv
            rel = col_ids + (kv0 - length + nq)
            mask = ((rel * g) <= row_ids) & (col_ids < length - kv0)
            s = jnp.where(mask, s * scale_log2, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            # P goes through shared memory: the wgmma reads both operands from there, which
            # is also the form Pallas' GPU interpreter can run on a CPU.
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            new_acc = []
            for c, acc_c in enumerate(acc):
                def pv_scope(acc_ref, c=c):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot, :, pl.ds(c * d_chunk, d_chunk)])
                    return acc_ref[...]

                pv = pl.run_scoped(pv_scope, plgpu.ACC((_ROWS, d_chunk), jnp.float32))
                new_acc.append(acc_c * lax.broadcast_in_dim(alpha, acc_c.shape, [0]) + pv)
            acc = tuple(new_acc)

            @pl.when(step + stages < n)
            def _refill():
                issue(step + stages, slot)

            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n, body, (acc, m_i, l_i))
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        inv_l = 1.0 / l_safe
        for c, acc_c in enumerate(acc):
            out_c = acc_c * lax.broadcast_in_dim(inv_l, acc_c.shape, [0])
            q_smem[:, pl.ds(c * d_chunk, d_chunk)] = out_c.astype(dtype)
        lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log(l_safe) * _LOG2E)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, h, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, h, split])
        plgpu.wait_smem_to_gmem(0)

    transforms = swizzle_transforms(64, dtype)  # every tile here is >= 64 wide: 128-byte swizzle
    arrivals = pages_per_tile if tiles_per_page == 1 else 1
    call = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((b, hkv, num_splits, _ROWS, d), dtype),
            jax.ShapeDtypeStruct((b, hkv, num_splits, _ROWS), jnp.float32),
        ),
        grid=(num_splits, hkv, b),
        grid_names=("split", "head", "batch"),
        scratch_types=dict(
            q_smem=plgpu.SMEM((_ROWS, d), dtype, transforms=transforms),
            k_smem=plgpu.SMEM((stages, block_kv, d), dtype, transforms=transforms),
            v_smem=plgpu.SMEM((stages, block_kv, d), dtype, transforms=transforms),
            p_smem=plgpu.SMEM((_ROWS, block_kv), dtype, transforms=transforms),
            lse_smem=plgpu.SMEM((_ROWS,), jnp.float32),
            q_bar=plgpu.Barrier(num_barriers=1),
            k_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
            v_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    o_part, lse_part = call(qr, k_pages, v_pages, bt, lengths.astype(jnp.int32))
    if interpret_forced():  # Pallas' GPU interpreter runs no Triton block specs: the definition
        return merge_splits_reference(o_part, lse_part, q, gate)
    return merge_splits(o_part, lse_part, q, gate)


# ------------------------------------------------------------------ Triton-lowered form


def triton_unsupported(q, k_pages) -> str | None:
    """Why the Triton form cannot take these inputs, or None."""
    d, page = q.shape[-1], k_pages.shape[1]
    if why := _too_many_rows(q, k_pages):
        return why
    if d & (d - 1) or d < 16 or page & (page - 1) or page < 16:
        return f"head dim {d} and page size {page} must be powers of two >= 16 (Triton's dot tiles)"
    if q.dtype != k_pages.dtype:
        return f"q ({q.dtype}) and the pages ({k_pages.dtype}) differ in dtype"
    if k_pages.size >= 2**31:
        return f"a page pool of {k_pages.size} elements: past int32 offsets"
    return None


def _triton_splits(b: int, hkv: int, max_blocks: int, num_sms: int) -> int:
    """About one program per multiprocessor, each over a contiguous run of whole pages."""
    return max(1, min(max_blocks, -(-num_sms // (b * hkv))))


@functools.partial(jax.jit, static_argnames=("scale", "splits", "interpret"))
def paged_attention_triton(q, k_pages, v_pages, block_tables, lengths, *, scale=None, gate=None,
                           splits=None, interpret=False):
    """The paged attention of `paged_attention`, lowered through Triton: one page per loop step.

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
    _check_inputs(q, k_pages, v_pages, block_tables, lengths, gate)
    why = triton_unsupported(q, k_pages)
    if why:
        raise ValueError(why)
    b, nq, hq, d = q.shape
    _, page, hkv, _ = k_pages.shape
    g = hq // hkv
    rows = max(16, 1 << (nq * g - 1).bit_length())  # Triton's dot tiles: a power of two >= 16
    max_blocks = block_tables.shape[1]
    num_splits = splits or _triton_splits(b, hkv, max_blocks, num_sms())
    per_split = -(-max_blocks // num_splits)
    scale_log2 = (d**-0.5 if scale is None else scale) * _LOG2E
    qr = _query_rows(q, hkv, rows)

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

        init = (jnp.full((rows,), _MASKED_M, jnp.float32), jnp.zeros((rows,), jnp.float32),
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
        **triton_compiler_params(interpret, num_warps=4, num_stages=2),
    )(qr, k_pages, v_pages, block_tables.astype(jnp.int32), lengths.astype(jnp.int32))
    return merge_splits(o_part, lse_part, q, gate, interpret=interpret)


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
    top = jnp.maximum(jnp.max(lse, axis=2, keepdims=True), _MASKED_M)
    w = jnp.exp2(lse - top)  # zero for empty splits and empty rows
    denom = jnp.sum(w, axis=2)
    o = jnp.sum(o * w[..., None], axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]
    o = o.reshape(b, hkv, nq, g, d).transpose(0, 2, 1, 3, 4).reshape(b, nq, hq, d)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate.astype(jnp.float32))
    return o.astype(q.dtype)


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
        m = jnp.full((), _MASKED_M, f32)
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
        **triton_compiler_params(interpret, num_warps=1),
    )(o_part, lse_part, *(() if gate is None else (gate,)))


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, gate=None,
                    impl="auto"):
    """Causal attention of Q new tokens per sequence over its paged KV.

    q: [B, Q, Hq, D]; k_pages, v_pages: [num_pages, page_size, Hkv, D];
    block_tables: [B, max_blocks] int32; lengths: [B] int32, the KV tokens of each
    sequence including the Q new ones. Query i of sequence b sits at position
    ``lengths[b] - Q + i``; one with a negative position (an idle slot) returns
    zeros. ``gate`` ([B, Q, Hq, D]) multiplies the output by ``sigmoid(gate)``.
    Returns [B, Q, Hq, D] in q's dtype; softmax and accumulation in f32.

    Inputs the kernel cannot take (`kernel_unsupported`) always go to the reference.
    ``MTP_KERNELS=paged_attention_triton=pallas`` (or ``=interpret``) sends the calls it
    can take to the Triton-lowered form (`paged_attention_triton`); it paid only in the default
    model's loops, so ``auto`` and a global ``MTP_KERNELS`` value leave it (``backend.OPT_IN``).
    ``impl="interpret"`` runs the Mosaic GPU kernel through the Pallas interpreter
    (CPU tests); call it eagerly then, since interpret mode is switched on around
    this call's own lowering. Traced under a mesh that splits ``backend.TENSOR_AXIS``
    (``jax.set_mesh``), the kernel runs per shard, on each device's own KV heads.
    """
    _check_inputs(q, k_pages, v_pages, block_tables, lengths, gate)  # before either form's support reads q
    if impl == "auto" and tensor_parallel_mesh() is None and not triton_unsupported(q, k_pages):
        # Opt-in (backend.OPT_IN): only where an MTP_KERNELS entry of its own names it.
        triton = resolve_impl("auto", op="paged_attention_triton")
        if triton != "reference":
            return paged_attention_triton(q, k_pages, v_pages, block_tables, lengths, scale=scale, gate=gate,
                                          interpret=triton == "interpret")
    mode = resolve_impl(impl, op="paged_attention")
    if mode != "reference" and kernel_unsupported(q, k_pages):
        mode = "reference"
    mesh = tensor_parallel_mesh() if mode != "reference" else None
    if mesh is not None and k_pages.shape[2] % mesh.shape[TENSOR_AXIS]:
        mode = "reference"  # KV heads replicated over the mesh: XLA partitions the reference
    if mode == "reference":
        return _reference_jit(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                              gate=gate)
    args = (q, k_pages, v_pages, block_tables, lengths) + (() if gate is None else (gate,))

    def run(q, k_pages, v_pages, block_tables, lengths, gate=None):
        return _paged_attention_pallas(q, k_pages, v_pages, block_tables, lengths, scale=scale, gate=gate)

    if mesh is not None:
        # Each device attends with its own KV heads and their query groups: attention
        # needs nothing from other heads, so no communication.
        heads, whole = P(None, None, TENSOR_AXIS, None), P()
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, heads, heads, whole, whole, heads)[:len(args)],
                            out_specs=heads, check_vma=False)
    if mode == "interpret":
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return run(*args)
    return run(*args)


_reference_jit = jax.jit(paged_attention_reference, static_argnames=("scale", "impl"))
