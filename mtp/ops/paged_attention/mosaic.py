"""Attention over paged KV for decode (Q = 1) and verify (Q = K new tokens), as a Mosaic GPU kernel.

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
  output in bf16 plus a log2-sum-exp per row). A small kernel (`triton.merge_splits`)
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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.ops.lowering import interpret_forced, num_sms, swizzle_transforms
from mtp.ops.paged_attention.reference import MASKED_M, merge_splits_reference, query_rows
from mtp.ops.paged_attention.triton import LOG2E, MAX_ROWS, merge_splits, too_many_rows

_SMEM_BYTES = 227 * 1024  # Hopper's per-block shared memory limit (232,448 bytes).


def choose_block_kv(d: int, page: int, block: int | None = None) -> int:
    """KV tokens per pipeline stage: 64 KiB of K+V per stage for D = 128 or 256."""
    block = block or (128 if d <= 128 else 64)
    if page > block:
        if page % block:
            raise ValueError(f"page_size {page} must be a multiple of {block} or divide it")
    elif block % page:
        raise ValueError(f"page_size {page} must divide {block} (KV tokens per tile)")
    return block


def choose_splits(b: int, hkv: int, max_tiles: int, num_sms: int) -> int:
    """As many splits as fill the multiprocessors in one wave (one program fits per SM).

    Measured on the H200 (results/kernels/kernels_h200.md): at B=8, 8k, (16, 2, 256) a split
    count giving 2.06 waves ran at 2.4 TB/s, the rest of the last wave idling.
    """
    return max(1, min(num_sms // (b * hkv), max_tiles))


def kernel_unsupported(q, k_pages, block_kv: int | None = None) -> str | None:
    """Why the kernel cannot take these inputs, or None when it can.

    `api.paged_attention` sends such calls (a long prefill chunk, f32 caches, odd head
    dims) to the reference whatever ``impl`` says, so one switch can turn the
    kernels on for a whole model; the kernel entry itself raises this message.
    """
    d, page = q.shape[-1], k_pages.shape[1]
    if why := too_many_rows(q, k_pages):
        return why
    if d not in (64, 128, 256):  # P @ V runs in whole chunks of min(D, 128) columns
        return f"head dim {d} must be 64, 128 or 256"
    if q.dtype != k_pages.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q and pages must share a 16-bit dtype, got {q.dtype}, {k_pages.dtype}"
    try:
        choose_block_kv(d, page, block_kv)
    except ValueError as e:
        return str(e)
    return None


def choose_stages(d: int, block_kv: int, tiles_per_split: int, stages: int | None = None) -> int:
    """K+V tiles in flight: up to 4, as many as shared memory holds beside Q, P and the LSE rows,
    and no more than a program has tiles."""
    if stages is None:
        # Barriers and Mosaic's own scratch take ~3 KB beyond the buffers listed here.
        fixed = (MAX_ROWS * d + MAX_ROWS * block_kv) * 2 + MAX_ROWS * 4 + 4096
        stages = max(1, min(4, (_SMEM_BYTES - fixed) // (2 * block_kv * d * 2)))
    return max(1, min(stages, tiles_per_split))


class _KvTiling(NamedTuple):
    """How a program walks its share of a sequence: ``block_kv``-token tiles of whole pages
    (``pages_per_tile``) or of one page's parts (``tiles_per_page``), ``stages`` in flight."""

    page: int
    block_kv: int
    pages_per_tile: int
    tiles_per_page: int
    tiles_per_split: int
    stages: int


@functools.partial(jax.jit, static_argnames=("scale", "stages", "splits", "block_kv"))
def paged_attention_mosaic(q, k_pages, v_pages, block_tables, lengths, *, scale, gate,
                            stages=None, splits=None, block_kv=None):
    b, nq, hq, d = q.shape
    _, page, hkv, _ = k_pages.shape
    g = hq // hkv
    why = kernel_unsupported(q, k_pages, block_kv)
    if why:
        raise ValueError(why)
    block_kv = choose_block_kv(d, page, block_kv)
    pages_per_tile = max(1, block_kv // page)
    tiles_per_page = max(1, page // block_kv)

    # Pad the block table to whole tiles so that the last tile's page ids are in range.
    max_blocks = block_tables.shape[1]
    padded = -(-max_blocks // pages_per_tile) * pages_per_tile
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - max_blocks)))
    max_tiles = padded // pages_per_tile * tiles_per_page
    num_splits = splits or choose_splits(b, hkv, max_tiles, num_sms())
    tiles_per_split = -(-max_tiles // num_splits)
    tiling = _KvTiling(page, block_kv, pages_per_tile, tiles_per_page, tiles_per_split,
                       choose_stages(d, block_kv, tiles_per_split, stages))

    qr = query_rows(q, hkv, MAX_ROWS)
    scale_log2 = (d**-0.5 if scale is None else scale) * LOG2E
    call = _partials_call(tiling, b, nq, g, hkv, d, num_splits, scale_log2, q.dtype)
    o_part, lse_part = call(qr, k_pages, v_pages, bt, lengths.astype(jnp.int32))
    if interpret_forced():  # Pallas' GPU interpreter runs no Triton block specs: the definition
        return merge_splits_reference(o_part, lse_part, q, gate)
    return merge_splits(o_part, lse_part, q, gate)


def _partials_call(t: _KvTiling, b, nq, g, hkv, d, num_splits, scale_log2, dtype):
    """The kernel writing each split's normalised output and log2-sum-exp rows, for `merge_splits`."""
    transforms = swizzle_transforms(64, dtype)  # every tile here is >= 64 wide: 128-byte swizzle
    arrivals = t.pages_per_tile if t.tiles_per_page == 1 else 1
    return plgpu.kernel(
        _program(t, nq, g, d, scale_log2, dtype),
        out_type=(
            jax.ShapeDtypeStruct((b, hkv, num_splits, MAX_ROWS, d), dtype),
            jax.ShapeDtypeStruct((b, hkv, num_splits, MAX_ROWS), jnp.float32),
        ),
        grid=(num_splits, hkv, b),
        grid_names=("split", "head", "batch"),
        scratch_types=dict(
            q_smem=plgpu.SMEM((MAX_ROWS, d), dtype, transforms=transforms),
            k_smem=plgpu.SMEM((t.stages, t.block_kv, d), dtype, transforms=transforms),
            v_smem=plgpu.SMEM((t.stages, t.block_kv, d), dtype, transforms=transforms),
            p_smem=plgpu.SMEM((MAX_ROWS, t.block_kv), dtype, transforms=transforms),
            lse_smem=plgpu.SMEM((MAX_ROWS,), jnp.float32),
            q_bar=plgpu.Barrier(num_barriers=1),
            k_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=t.stages),
            v_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=t.stages),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _program(t: _KvTiling, nq, g, d, scale_log2, dtype):
    """A program per (split, KV head, sequence): its KV tiles stream through a ring of
    ``stages`` slots while it runs the wgmmas and the online softmax of an earlier tile."""
    d_chunk = min(d, 128)

    def kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, lse_ref,
               q_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bar, v_bar):
        split = lax.axis_index("split")
        h = lax.axis_index("head")
        bi = lax.axis_index("batch")
        length = len_ref[bi]
        n_tiles = lax.div(length + (t.block_kv - 1), jnp.int32(t.block_kv))
        t0 = split * t.tiles_per_split
        n = jnp.clip(n_tiles - t0, 0, t.tiles_per_split)

        plgpu.copy_gmem_to_smem(q_ref.at[bi, h], q_smem, q_bar.at[0])

        def issue(step, slot):
            _issue_kv_tile(t, bt_ref, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, bi, h, t0 + step, slot)

        for s in range(t.stages):
            @pl.when(s < n)
            def _prologue():
                issue(jnp.int32(s), s)

        plgpu.barrier_wait(q_bar.at[0])
        acc, m_i, l_i = _initial_carry(d, d_chunk)
        # Query row r sits at position length - Q + r // G and sees kv <= that position:
        # kv - (length - Q) <= r // G  <=>  G * (kv - length + Q) <= r.
        row_ids = plgpu.broadcasted_iota(jnp.int32, (MAX_ROWS, t.block_kv), 0, layout=plgpu.Layout.WGMMA)
        col_ids = plgpu.broadcasted_iota(jnp.int32, (MAX_ROWS, t.block_kv), 1, layout=plgpu.Layout.WGMMA)

        def body(step, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(t.stages))
            plgpu.barrier_wait(k_bar.at[slot])

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                return acc_ref[...]

            s = pl.run_scoped(qk_scope, plgpu.ACC((MAX_ROWS, t.block_kv), jnp.float32))
            kv0 = (t0 + step) * t.block_kv
            rel = col_ids + (kv0 - length + nq)
            mask = ((rel * g) <= row_ids) & (col_ids < length - kv0)
            p, m_new, alpha, l_i = _online_softmax(s, m_i, l_i, mask, scale_log2)
            # P goes through shared memory: the wgmma reads both operands from there, which
            # is also the form Pallas' GPU interpreter can run on a CPU.
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            acc = _add_pv(acc, alpha, p_smem, v_smem, slot, d_chunk)

            @pl.when(step + t.stages < n)
            def _refill():
                issue(step + t.stages, slot)

            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n, body, (acc, m_i, l_i))
        _store_partial(acc, m_i, l_i, q_smem, lse_smem, o_ref.at[bi, h, split], lse_ref.at[bi, h, split],
                       d_chunk, dtype)

    return kernel


def _initial_carry(d, d_chunk):
    """The online softmax's start; the row maximum starts at the finite ``MASKED_M`` so that a
    row that sees no key never computes inf - inf."""
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m_i = plgpu.layout_cast(jnp.full((MAX_ROWS,), MASKED_M, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.full((MAX_ROWS,), 0.0, jnp.float32), row_layout)
    # The output accumulator lives in column chunks of at most 128 so that each P @ V
    # wgmma result can be added in without holding two full [64, 256] f32 arrays.
    acc = tuple(
        plgpu.layout_cast(jnp.full((MAX_ROWS, d_chunk), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        for _ in range(d // d_chunk)
    )
    return acc, m_i, l_i


def _issue_kv_tile(t: _KvTiling, bt_ref, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, bi, h, tile, slot):
    """Start the TMA copies of KV tile ``tile`` into ring slot ``slot``: one per page when a
    tile spans pages, all arriving on the slot's barrier."""
    if t.tiles_per_page == 1:
        for j in range(t.pages_per_tile):
            pid = bt_ref[bi, tile * t.pages_per_tile + j]
            dst = pl.ds(j * t.page, t.page)
            plgpu.copy_gmem_to_smem(k_ref.at[pid, :, h, :], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[pid, :, h, :], v_smem.at[slot, dst], v_bar.at[slot])
    else:
        pid = bt_ref[bi, lax.div(tile, jnp.int32(t.tiles_per_page))]
        src = pl.ds(lax.rem(tile, jnp.int32(t.tiles_per_page)) * t.block_kv, t.block_kv)
        plgpu.copy_gmem_to_smem(k_ref.at[pid, src, h, :], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[pid, src, h, :], v_smem.at[slot], v_bar.at[slot])


def _online_softmax(s, m_i, l_i, mask, scale_log2):
    """(p, m_new, alpha, l_new) of one tile's scores: base-2 exponentials against the running
    row maximum, ``alpha`` rescaling what was accumulated under the old one."""
    s = jnp.where(mask, s * scale_log2, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    return p, m_new, alpha, l_i


def _add_pv(acc, alpha, p_smem, v_smem, slot, d_chunk):
    """The rescaled accumulator chunks plus P @ V, one wgmma per chunk of ``d_chunk`` columns."""
    new_acc = []
    for c, acc_c in enumerate(acc):
        def pv_scope(acc_ref, c=c):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot, :, pl.ds(c * d_chunk, d_chunk)])
            return acc_ref[...]

        pv = pl.run_scoped(pv_scope, plgpu.ACC((MAX_ROWS, d_chunk), jnp.float32))
        new_acc.append(acc_c * lax.broadcast_in_dim(alpha, acc_c.shape, [0]) + pv)
    return tuple(new_acc)


def _store_partial(acc, m_i, l_i, q_smem, lse_smem, o_out, lse_out, d_chunk, dtype):
    """Write a split's normalised output and log2-sum-exp rows; a split that saw no key (past
    its sequence) writes an LSE of -inf, so the merge gives it no weight."""
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    inv_l = 1.0 / l_safe
    for c, acc_c in enumerate(acc):
        out_c = acc_c * lax.broadcast_in_dim(inv_l, acc_c.shape, [0])
        q_smem[:, pl.ds(c * d_chunk, d_chunk)] = out_c.astype(dtype)
    lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log(l_safe) * LOG2E)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_out)
    plgpu.copy_smem_to_gmem(lse_smem, lse_out)
    plgpu.wait_smem_to_gmem(0)
