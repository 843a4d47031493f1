"""The MTP drafter's input projection as Mosaic GPU kernels: both RMSNorms, the concat and the fc GEMM.

``out = concat(norm_e(embed), norm_h(hidden)) @ w.T`` with Qwen3-Next's ``(1 + w)``
RMSNorm, ``w`` in the Hugging Face Linear layout ``[H, 2H]`` (embedding columns first).
`reference.fc_gemm_reference` is the definition (the Hugging Face numerics); `api.fc_gemm` is
the one public op and picks the path.

How the kernel path computes it. The norm is ``x * r * (1 + w_n)`` with a per-row
``r = rsqrt(mean(x^2) + eps)`` and a per-column ``(1 + w_n)``. The column factor is
folded into the weight once, at load (`reference.fold_fc_weight`):
``W_f = bf16(W * (1 + concat(w_ne, w_nh)))``, so that

    out = r_e * (embed @ W_f[:, :H].T) + r_h * (hidden @ W_f[:, H:].T)

The ``[M, 2H]`` normalised input never exists; the GEMM's inner loop is a plain bf16
GEMM (f32 accumulation) that takes its A tiles from ``embed`` for the first H reduction
columns and from ``hidden`` for the rest, and applies the row scales in its epilogue:
the single accumulator is multiplied by ``r_e / r_h`` at the half boundary and by
``r_h`` at the end (``r > 0`` always). The ratio is needed before the hidden half is
read, so the rows' sums of squares come from a small memory-bound kernel that runs
first (``row_sumsq``: it reads embed and hidden once, ``4 M H`` bytes, at ~4 TB/s where
XLA's reduction ran at 1.75; the GEMM takes the rsqrt itself). An embed row's norm depends
on its token alone, so the model passes each row's mean square from a per-token table made
at load (`reference.row_mean_squares`) and normalises the embed rows where the embedding gather
makes them: then ``r_e = 1`` and the pre-pass reads the hidden rows alone (``2 M H`` bytes;
at M = 2048, H = 2048 that pass was 6.0 of the op's 50.5 us, the whole gap to XLA's bare
dot; results/kernels/kernels_h200.md, 2026-11-30). Every way of summing the
squares inside the GEMM measured slower than this pre-pass (results/kernels/kernels_h200.md): by
the consumers from the A tiles in shared memory (2.4x slower; 0.71x), by the producer (0.43-0.46x),
by a fourth warpgroup or from the registers of an RS wgmma (0.70-0.75x; docs/tried_and_rejected.md).
A fourth warpgroup that only synchronised cost nothing; the summing's loads and arithmetic slow the wgmmas.

Rounding moves. Hugging Face rounds the normalised input ``x * r * (1 + w_n)`` to bf16
and multiplies by ``W``; here ``W * (1 + w_n)`` is rounded to bf16 instead and ``x`` is
used as is (exact in bf16), with ``r`` applied to the f32 accumulator. Both are one
bf16 rounding per product term, so the kernel agrees with the reference to bf16
precision (relative error ~1e-3..1e-2 of the output norm), not bit for bit.

Two kernels (Mosaic GPU, Hopper):

* M > 128 (drafter prefill, compute-bound): a persistent warp-specialised GEMM. Its
  structure follows JAX's ``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``
  (one TMA producer warpgroup and two consumer warpgroups that each own half of a
  128x256 output tile, 4 stages of 64-wide k steps), but the
  producer loop is written by hand here so that it can take the A tile from ``embed``
  or from ``hidden`` depending on the reduction step (no ``[M, 2H]`` concat, and
  no bubble at the half boundary or between output tiles: the stage ring runs
  across all tiles a program owns). ``w`` stays in its ``[N, K]`` layout: the B tile
  is a ``(2 tile_n, tile_k)`` slab of ``W_f`` used through a transposed view. The
  consumer keeps one wgmma in flight (``wgmma_wait(1)``) and releases a stage as soon
  as the wgmma that read it has finished. The consumers' halves are stacked (64x256
  each, both reading the whole B tile: one 64x256 wgmma reads less shared memory than
  two 64x128 halves of a 128x128 one); side by side (128x128 each) measured 0.3-0.5%
  slower at all four benchmark shapes, 128-wide k steps (2 stages) 1.35-1.59x slower
  (results/kernels/kernels_h200.md, 2026-11-30).
  Pallas' GPU interpreter cannot store to an accumulator, so in interpret mode (CPU
  tests) the consumers instead keep two f32 accumulators (embed half, hidden half) for a
  64x128 tile each (``acc="two"``, 128x128 CTA tiles; same producer and stage ring);
  on the H200 that form measured 13% slower (results/kernels/kernels_h200.md, 2026-11-29).
* M <= 128 (batched propose, a carry's short tail append: a weight stream): M sits in one
  64- or 128-row tile (rows past M are TMA zero-fill, never materialised) and the 2H reduction is split across
  programs (split-K, each split inside one half) so that >= ~128 programs stream
  ``W_f``; each streams ``(tile_n, 64)`` weight tiles through a ``stages``-deep TMA
  pipeline with one wgmma in flight, and sums its input tiles' squares meanwhile (its
  share of the row norms). The f32 partials (``splits x M x H``) and shares are summed
  and scaled by ``r`` in one XLA loop fusion: two kernels in all. Reducing the splits
  inside the kernel, in a thread-block cluster, measured 2.5x slower
  (docs/tried_and_rejected.md). At 128 rows it was 1.04-1.35x faster alone than the
  GEMM's plan (32-64 tiles of 128 x 64 for 132 SMs) and than XLA's norm + concat + dot; at
  192-256 rows (64-column tiles, 3-5 stages) it lost to both (results/kernels/kernels_h200.md, 2026-11-30).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.ops.lowering import num_sms, swizzle_transforms

SMALL_M = 128  # by default at most this many rows take the split-K weight-streaming kernel (module docstring)
SPLITK_MAX_M = 256  # the most rows the split-K kernel can hold (64-row blocks in one warpgroup)
SMEM_LIMIT = 232_448 - 2048  # bytes per block, less headroom for Mosaic's own scratch


def _scale_of(sum_sq, h: int, eps):
    """A row's RMSNorm scale from its sum of squares over ``h`` columns (every kernel's epilogue)."""
    return lax.rsqrt(sum_sq * (1.0 / h) + eps)


def kernel_unsupported(embed, hidden, w, small_m: int = SMALL_M) -> str | None:
    """Why the kernels cannot take these (well-formed) inputs, or None when they can.

    `api.fc_gemm` sends such calls to the reference whatever ``impl`` says, so that one
    switch can turn the kernels on for a whole model; ``fc_gemm_folded`` raises this.
    """
    m, h = embed.shape
    dtypes = {jnp.dtype(embed.dtype), jnp.dtype(hidden.dtype), jnp.dtype(w.dtype)}
    if len(dtypes) != 1 or jnp.dtype(embed.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                          jnp.dtype(jnp.float16)):
        return ("embed, hidden and the weight must share a 16-bit float dtype (bfloat16 or "
                f"float16); got embed {embed.dtype}, hidden {hidden.dtype}, weight {w.dtype}")
    if m < 1:
        return f"embed must have at least one row; got shape {embed.shape}"
    if h % 64:
        return f"H={h} must be a multiple of 64 for the fc kernels"
    if m > small_m and m % 8:
        return (f"M={m} rows: the warp-specialised fc kernel (M > small_m={small_m}) needs a "
                "multiple of 8 (its TMA row tiles)")
    return None


def _check_kernel_inputs(embed, hidden, w_folded, small_m):
    if embed.ndim != 2 or embed.shape != hidden.shape:
        raise ValueError(
            f"embed and hidden must both be [M, H]; got {embed.shape} and {hidden.shape}"
        )
    m, h = embed.shape
    if w_folded.shape != (h, 2 * h):
        raise ValueError(
            f"w_folded must be [H, 2H] = [{h}, {2 * h}] (out_features, in_features); "
            f"got {w_folded.shape}")
    why = kernel_unsupported(embed, hidden, w_folded, small_m)
    if why:
        raise ValueError(why)


# ------------------------------------------------------------------ small M: split-K stream

SLAB_COLS = 32  # width of a partial's f32 slabs, each its own buffer and TMA store: one 128-byte swizzle tile


def plan_small(m: int, h: int, num_sms: int, tile_n=None, k_splits=None, stages=None):
    """(tile_n, k_splits, stages) of the split-K stream for M rows.

    By default ~one wave of 128-column tiles with 6 stages. One measured bucket differs:
    at H >= 4096 and 1 < M <= 16, 256-column tiles over 8 splits with 3 stages
    (results/kernels/kernels_h200.md, 2026-11-30, L2 cold, M = 8: 1.00-1.02x XLA's norm + concat +
    dot against 0.93-0.95x with the default plan; at M = 1 and 32 the default is faster).
    Above 64 rows the program's row tile grows in 64-row blocks, so the columns narrow to
    keep its f32 accumulator at 128 x 128 (128 registers a thread) and the ring shrinks to
    what shared memory holds.
    """
    if h >= 4096 and 1 < m <= 16 and (tile_n, k_splits, stages) == (None, None, None):
        tile_n, k_splits, stages = 256, 8, 3
    tile_m = splitk_rows(m)
    tile_n = tile_n or (128 if tile_m <= 128 else 64)
    while h % tile_n:
        tile_n //= 2
    if k_splits is None:
        # Programs = (H / tile_n) * splits: the fewest splits giving ~one wave of programs.
        k_splits = 2
        while ((h // tile_n) * k_splits * 2 <= num_sms and h % (k_splits * 64) == 0
               and h // k_splits >= 4 * 64):
            k_splits *= 2
    if k_splits % 2 or h % ((k_splits // 2) * 64):
        raise ValueError(f"k_splits={k_splits} must be even and split H={h} into 64-column tiles")
    if stages is None:
        stages = 6
        while stages > 2 and splitk_smem(tile_m, tile_n, stages) > SMEM_LIMIT:
            stages -= 1
    return tile_n, k_splits, stages


def splitk_rows(m: int) -> int:
    """The split-K program's row tile: M rounded up to 64-row blocks (rows past M are zero-fill)."""
    return 64 * -(-m // 64)


def splitk_smem(tile_m: int, tile_n: int, stages: int, tile_k: int = 64) -> int:
    """Shared memory of a split-K program: its ring, its f32 partial,
    and what Mosaic GPU adds beyond ``SMEM_LIMIT``'s headroom (the pipeline's barriers,
    the row shares and alignment: ~3.1 KB at 128-256 rows by the deviceless compile of
    ``.venv-aot``, which rejected a ring 40 bytes over the limit)."""
    return stages * (tile_m + tile_n) * tile_k * 2 + tile_m * tile_n * 4 + 2048


def _splitk(embed, hidden, w_f, *, tile_n, k_splits, stages, eps, embed_normed=False, tile_k=64):
    """The propose path and short appends (M <= 128 by default, up to 256): ``fc_gemm`` as a
    split-K weight stream.

    Programs own ``tile_n`` output columns and one of ``k_splits`` reduction chunks, each
    inside one half (embed for split s < S/2). A program streams ``(tile_n, tile_k)``
    weight tiles and the matching ``(tile_m, tile_k)`` input tiles (M rounded up to 64-row
    blocks) through a ``stages``-deep
    TMA pipeline (rows past M are zero-fill) with one wgmma in flight, and, while the
    wgmma runs, sums the squares of the input tile's rows: its split's share of the row
    norms, so no separate pass over the inputs is needed.

    The kernel writes the partials ``[S, M, H]`` and shares ``[S, tile_m]`` and one XLA loop
    fusion finishes. ``embed_normed``: the embed rows arrive normalised
    (``r_e = 1``; their shares are summed all the same, at no measurable cost). Returns [M, H].
    """
    m, h = embed.shape
    dtype = embed.dtype
    tile_m = splitk_rows(m)
    per_half = k_splits // 2
    chunk = h // per_half  # reduction columns per program
    nk = chunk // tile_k
    stages = max(1, min(stages, nk))
    slabs = tile_n // SLAB_COLS
    part_tr = swizzle_transforms(SLAB_COLS, jnp.float32)
    if tile_n % SLAB_COLS:
        raise ValueError(f"the split-K kernel needs tile_n a multiple of {SLAB_COLS}; got tile_n={tile_n}")
    smem = splitk_smem(tile_m, tile_n, stages, tile_k)
    if smem > SMEM_LIMIT:
        raise ValueError(f"split-K fc kernel needs {smem} bytes of shared memory "
                         f"(M={m} in {tile_m} rows, tile_n={tile_n}, stages={stages}); "
                         f"the limit is {SMEM_LIMIT}")
    scratch = dict(part_smem=[plgpu.SMEM((tile_m, SLAB_COLS), jnp.float32, transforms=part_tr)
                              for _ in range(slabs)],
                   ss_smem=plgpu.SMEM((tile_m,), jnp.float32))
    parts, ss = plgpu.kernel(
        _splitk_program(h, tile_m, tile_n, per_half, chunk, nk, stages, tile_k, dtype),
        out_type=(jax.ShapeDtypeStruct((k_splits, m, h), jnp.float32),
                  jax.ShapeDtypeStruct((k_splits, tile_m), jnp.float32)),
        grid=(h // tile_n, k_splits), grid_names=("n", "k"),
        scratch_types=scratch,
    )(embed, hidden, w_f)
    return _sum_splits(parts, ss, h, eps, embed_normed).astype(dtype)


def _splitk_program(h, tile_m, tile_n, per_half, chunk, nk, stages, tile_k, dtype):
    """A split-K program: one wgmma in flight over its chunk's k steps, the input tile's row
    squares summed while it runs, the partial stored in ``SLAB_COLS``-wide slabs."""
    delay = 1 if stages > 1 else 0
    in_tr = swizzle_transforms(tile_k, dtype)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(e_ref, h_ref, w_ref, parts_ref, ss_ref, *, part_smem, ss_smem):
        ni = lax.axis_index("n")
        si = lax.axis_index("k")
        zero = ni * 0  # a traced 0: row windows past M are TMA zero-fill / clipped stores
        cols = pl.ds(ni * tile_n, tile_n)
        k0 = lax.rem(si, per_half) * chunk

        def half(x_ref, base):
            def scope(acc_ref):
                def step(_, x_smem, w_smem, ss):
                    plgpu.wgmma(acc_ref, x_smem, w_smem.T)
                    x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                    ss = ss + jnp.sum(x * x, axis=1)
                    plgpu.wgmma_wait(delay)
                    return ss

                ss = plgpu.emit_pipeline(
                    step,
                    grid=(nk,),
                    in_specs=[
                        plgpu.BlockSpec((tile_m, tile_k), lambda k: (zero, k), transforms=in_tr,
                                        delay_release=delay),
                        plgpu.BlockSpec((tile_n, tile_k), lambda k: (0, k), transforms=in_tr,
                                        delay_release=delay),
                    ],
                    max_concurrent_steps=stages,
                    init_carry=plgpu.layout_cast(jnp.zeros((tile_m,), jnp.float32), row_layout),
                )(x_ref.at[:, pl.ds(k0, chunk)], w_ref.at[cols, pl.ds(base + k0, chunk)])
                return acc_ref[...], ss

            acc, ss = pl.run_scoped(scope, plgpu.ACC((tile_m, tile_n), jnp.float32))
            for j, slab_smem in enumerate(part_smem):
                slab_smem[...] = acc[:, j * SLAB_COLS:(j + 1) * SLAB_COLS]
            ss_smem[...] = ss

        pl.when(si < per_half)(lambda: half(e_ref, 0))
        pl.when(si >= per_half)(lambda: half(h_ref, h))

        plgpu.commit_smem()
        for j, slab_smem in enumerate(part_smem):
            plgpu.copy_smem_to_gmem(slab_smem, parts_ref.at[
                si, pl.ds(zero, tile_m), pl.ds(ni * tile_n + j * SLAB_COLS, SLAB_COLS)])

        @pl.when(ni == 0)
        def _():
            plgpu.copy_smem_to_gmem(ss_smem, ss_ref.at[si])

        plgpu.wait_smem_to_gmem(0)

    return kernel


def _sum_splits(parts, ss, h, eps, embed_normed):
    """[M, H] f32: the partials of each half summed and scaled by that half's row norms."""
    k_splits, m = parts.shape[:2]
    per_half = k_splits // 2
    # Sums of static slices, not reductions: XLA keeps the whole epilogue in one loop
    # fusion (at M = 1 a reduction became two more kernels).
    total = lambda x, splits: functools.reduce(jnp.add, (x[s] for s in splits))
    lo, hi = range(per_half), range(per_half, k_splits)
    acc_e = total(parts, lo)
    if not embed_normed:
        acc_e = acc_e * _scale_of(total(ss[:, :m], lo), h, eps)[:, None]
    return acc_e + total(parts, hi) * _scale_of(total(ss[:, :m], hi), h, eps)[:, None]


# ------------------------------------------------------------------ row sums of squares


def plan_sumsq(m: int, h: int, num_sms: int, tile_c=None, splits=None, stages=None):
    """(tile_c, splits, stages): about two programs per SM, and at most 4 splits (8 of
    128 columns where there are 16 row blocks or fewer).

    Splits add programs where M is short, but each split is one more partial the GEMM
    loads per tile: 8 or 16 splits measured 3-6% slower end to end than 4 at M = 2048,
    H = 2048 (results/kernels/kernels_h200.md, 2026-11-29; equal when re-timed on 2026-11-30).
    A drafter-prefill chunk of 512-1024 rows has only 8-16 row blocks: 8 splits of 128
    columns were 0.7-2% faster there than 4 of 256 (2026-11-30).
    """
    row_blocks = -(-m // SUMSQ_ROWS)
    few_rows = row_blocks <= 16 and splits is None
    tile_c = tile_c or (128 if few_rows else 256)
    while h % tile_c:
        tile_c //= 2
    if splits is None:
        splits = 1
        while (row_blocks * splits < 2 * num_sms and splits < (8 if few_rows else 4)
               and h % (2 * splits * tile_c) == 0):
            splits *= 2
    if h % (splits * tile_c):
        raise ValueError(f"splits={splits} x tile_c={tile_c} must divide H={h}")
    return tile_c, splits, stages or 2


SUMSQ_ROWS = 64  # rows per program: one warpgroup's WGMMA-layout row block


def row_sumsq(*inputs, m_pad, tile_c, splits, stages):
    """[splits, len(inputs), M_pad] f32: split s's share of each row's sum of squares, per input.

    The inputs are the GEMM's halves whose rows still need their norm: (embed, hidden), or
    hidden alone when the embedding half arrives normalised (``fc_gemm_folded(embed_normed=True)``).
    A memory-bound pass (it reads ``2 M H`` bytes an input): programs own 64 rows x ``H / splits``
    columns of every input and stream them through a TMA pipeline; rows past M are
    zero-fill (sum 0) up to ``m_pad``, a multiple of 64. The GEMM sums the splits and takes
    the rsqrt itself, so nothing runs between the two kernels. XLA's own reduction of the same sums measured
    1.75 TB/s on the H200 (results/kernels/kernels_h200.md, 2026-11-29).
    """
    m, h = inputs[0].shape
    n = len(inputs)
    if m_pad % SUMSQ_ROWS or m_pad < m:
        raise ValueError(f"m_pad={m_pad} must be a multiple of {SUMSQ_ROWS} and >= M={m}")
    cols = h // splits
    tr = swizzle_transforms(tile_c, inputs[0].dtype)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(*refs, o_smem):
        x_refs, o_ref = refs[:n], refs[n]
        mi = lax.axis_index("m")
        si = lax.axis_index("s")
        rows = pl.ds(mi * SUMSQ_ROWS, SUMSQ_ROWS)
        zero = plgpu.layout_cast(jnp.zeros((SUMSQ_ROWS,), jnp.float32), row_layout)

        def sq_sum(ref):
            x = plgpu.load(ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            return jnp.sum(x * x, axis=1)

        def step(_, *smems_and_carry):
            *smems, carry = smems_and_carry
            return tuple(c + sq_sum(x) for c, x in zip(carry, smems))

        spec = plgpu.BlockSpec((SUMSQ_ROWS, tile_c), lambda c: (0, c), transforms=tr)
        ss = plgpu.emit_pipeline(
            step, grid=(cols // tile_c,), in_specs=[spec] * n,
            max_concurrent_steps=stages, init_carry=(zero,) * n,
        )(*(x.at[rows, pl.ds(si * cols, cols)] for x in x_refs))
        for j in range(n):
            o_smem[j] = ss[j]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[si, :, rows])
        plgpu.wait_smem_to_gmem(0)

    smem = stages * n * SUMSQ_ROWS * tile_c * inputs[0].dtype.itemsize
    if smem > SMEM_LIMIT:
        raise ValueError(f"row sum-of-squares kernel needs {smem} bytes of shared memory "
                         f"(tile_c={tile_c}, stages={stages}); the limit is {SMEM_LIMIT}")
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, m_pad), jnp.float32),
        grid=(m_pad // SUMSQ_ROWS, splits),
        grid_names=("m", "s"),
        scratch_types=dict(o_smem=plgpu.SMEM((n, SUMSQ_ROWS), jnp.float32)),
    )
    return call(*inputs)


# ------------------------------------------------------------------ large M: warp-specialised


def cta_shape(wg_m: int, tile_n: int, split: str) -> tuple[int, int]:
    """(rows, columns) of a program's output tile: its two consumers' ``wg_m x tile_n`` tiles,
    stacked (``split="m"``) or side by side (``"n"``)."""
    return (2 * wg_m, tile_n) if split == "m" else (wg_m, 2 * tile_n)


def plan_large(m: int, h: int, num_sms: int, wg_m=None, tile_n=None, stages=None,
                num_programs=None, acc="two", split=None):
    """(wg_m, tile_n, stages, programs, split): each consumer warpgroup owns a wg_m x tile_n tile.

    ``split``: how the two consumers share the CTA tile, ``"n"`` (side by side, CTA
    ``wg_m x 2 tile_n``) or ``"m"`` (stacked, CTA ``2 wg_m x tile_n``, both reading the
    whole B tile). Defaults: ``acc="two"`` 64x128 (two accumulators fit only that
    small), ``acc="rescale"`` 64x256; both stacked.
    """
    if acc not in ("two", "rescale"):
        raise ValueError(f"acc={acc!r}: choose 'two' or 'rescale'")
    split = split or "m"
    if split not in ("m", "n"):
        raise ValueError(f"split={split!r}: choose 'm' or 'n'")
    wg_m = wg_m or (128 if (acc, split) == ("rescale", "n") else 64)  # n: 128x128 each
    auto_n = tile_n is None and (acc, split) == ("rescale", "m")
    tile_n = tile_n or (256 if auto_n else 128)
    cta_m, cta_n = cta_shape(wg_m, tile_n, split)
    m_tiles = -(-m // cta_m)
    # A drafter-prefill chunk (512-1024 rows) has too few 256-wide tiles to fill the chip:
    # narrower ones, with deeper rings, until there are about as many tiles as SMs (measured 2026-11-30:
    # at 64 columns 8 stages beat 6 and 4; at 128, 6 and 4 were within 3% either way).
    while h % cta_n or (auto_n and tile_n > 64 and m_tiles * (h // cta_n) < 0.9 * num_sms):
        tile_n //= 2
        cta_n //= 2
    if tile_n < 8:
        raise ValueError(f"H={h} must be a multiple of 16")
    stages = stages or (5 if acc == "two" else {64: 8, 128: 6}.get(tile_n, 4) if auto_n else 4)
    num_programs = min(num_programs or num_sms, m_tiles * (h // cta_n))
    return wg_m, tile_n, stages, num_programs, split


class _WsTiling(NamedTuple):
    """What every warpgroup of the warp-specialised GEMM must agree on: the tiles (``plan_large``),
    the order programs take them in, the stage ring and the epilogue's store chunks."""

    wg_m: int
    tile_n: int
    tile_k: int
    stages: int
    split_m: bool
    cta_m: int
    cta_n: int
    n_tiles: int
    num_tiles: int
    num_programs: int
    kh: int  # k steps per half
    epi_m: int
    epi_n: int


def _ws_gemm(embed, hidden, w_f, ss_parts, *, wg_m, tile_n, stages, num_programs, acc, split,
             eps, tile_k=64):
    """bf16 [M, H] = r_e * (embed @ W_f[:, :H].T) + r_h * (hidden @ W_f[:, H:].T).

    Persistent and warp-specialised: warpgroup 2 is the TMA producer, warpgroups 0 and 1
    consume, each a ``wg_m x tile_n`` tile (``split``: see ``plan_large``). ``acc="two"``:
    each consumer keeps two f32 accumulators (embed half, hidden half). ``acc="rescale"``:
    one accumulator, multiplied by ``r_e / r_h`` at the half boundary and by ``r_h`` at the
    end, so a consumer can own a larger tile. The epilogue stores a consumer's tile
    through shared memory in chunks of up to 64 rows, as wide as the stage ring leaves
    room for. Pallas' GPU interpreter cannot store to an accumulator, so only ``"two"``
    runs in CPU tests. The row scales come from
    ``ss_parts`` = ``row_sumsq(...)``: each consumer sums the splits of its rows and takes
    ``r = rsqrt(ss / H + eps)`` when a tile starts (the ratio must be known at the half
    boundary, before the hidden half is read; see the module docstring). With one input's sums
    (``[splits, 1, M_pad]``, the hidden's) the embedding half arrives normalised: ``r_e = 1``.
    """
    m, h = embed.shape
    dtype = embed.dtype
    split_m = split == "m"
    cta_m, cta_n = cta_shape(wg_m, tile_n, split)
    m_tiles = -(-m // cta_m)
    n_tiles = h // cta_n
    num_tiles = m_tiles * n_tiles
    kh = h // tile_k  # k steps per half
    splits, normed_inputs = ss_parts.shape[:2]
    if ss_parts.ndim != 3 or normed_inputs not in (1, 2) or ss_parts.shape[2] != m_tiles * cta_m:
        raise ValueError(f"ss_parts must be [splits, 1 or 2, {m_tiles * cta_m}]; got {ss_parts.shape}")
    ring = stages * (cta_m + cta_n) * tile_k * 2
    # A WGMMA-layout tile splits into 64-row blocks only; columns split down to 64.
    epi_m, epi_n = min(64, wg_m), tile_n
    while epi_n > 64 and ring + 2 * epi_m * epi_n * 2 > SMEM_LIMIT:
        epi_n //= 2
    smem = ring + 2 * epi_m * epi_n * 2
    in_tr = swizzle_transforms(tile_k, dtype)
    out_tr = swizzle_transforms(epi_n, dtype)
    if smem > SMEM_LIMIT:
        raise ValueError(f"warp-specialised fc kernel needs {smem} bytes of shared memory "
                         f"(wg_m={wg_m}, tile_n={tile_n}, stages={stages}, acc={acc}, split={split}); "
                         f"the limit is {SMEM_LIMIT}")

    t = _WsTiling(wg_m, tile_n, tile_k, stages, split_m, cta_m, cta_n, n_tiles, num_tiles,
                  num_programs, kh, epi_m, epi_n)
    call = plgpu.kernel(
        _ws_program(t, h, splits, normed_inputs, acc, eps, dtype),
        out_type=jax.ShapeDtypeStruct((m, h), dtype),
        grid=(num_programs,),
        grid_names=("p",),
        num_threads=3,
        thread_name="wg",
        scratch_types=dict(
            a_smem=plgpu.SMEM((stages, cta_m, tile_k), dtype, transforms=in_tr),
            b_smem=plgpu.SMEM((stages, cta_n, tile_k), dtype, transforms=in_tr),
            o_smem=plgpu.SMEM((2, epi_m, epi_n), dtype, transforms=out_tr),
            full=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            empty=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ),
    )
    return call(embed, hidden, w_f, ss_parts)


def _ws_program(t: _WsTiling, h, splits, normed_inputs, acc, eps, dtype):
    """A persistent program: warpgroup 2 fills the stage ring for every tile the program owns,
    warpgroups 0 and 1 drain it, so the ring never empties between tiles."""

    def kernel(e_ref, h_ref, w_ref, ss_ref, o_ref, a_smem, b_smem, o_smem, full, empty):
        pid = lax.axis_index("p")
        wg = lax.axis_index("wg")
        my_tiles = lax.div(t.num_tiles - 1 - pid, t.num_programs) + 1

        def tile_coords(i):
            tile = pid + i * t.num_programs
            return lax.div(tile, t.n_tiles), lax.rem(tile, t.n_tiles)  # n minor: W slabs shared in a wave

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            _ws_produce(t, h, e_ref, h_ref, w_ref, a_smem, b_smem, full, empty, my_tiles, tile_coords)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            _ws_consume(t, h, splits, normed_inputs, acc, eps, dtype, wg, ss_ref, o_ref, a_smem, b_smem,
                        o_smem, full, empty, my_tiles, tile_coords)

    return kernel


def _ws_produce(t: _WsTiling, h, e_ref, h_ref, w_ref, a_smem, b_smem, full, empty, my_tiles,
                tile_coords):
    """The TMA producer: the A tile comes from ``embed`` for the first half's k steps and from
    ``hidden`` for the rest, so the ``[M, 2H]`` concat never exists."""
    cta_m, cta_n, kh, stages, tile_k = t.cta_m, t.cta_n, t.kh, t.stages, t.tile_k

    def tile_body(i, step):
        mi, ni = tile_coords(i)
        rows = pl.ds(mi * cta_m, cta_m)
        cols = pl.ds(ni * cta_n, cta_n)
        for src, base in ((e_ref, 0), (h_ref, h)):
            def k_body(k, step, src=src, base=base):
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(empty.at[slot])

                plgpu.copy_gmem_to_smem(src.at[rows, pl.ds(k * tile_k, tile_k)],
                                        a_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[cols, pl.ds(base + k * tile_k, tile_k)],
                                        b_smem.at[slot], full.at[slot])
                return step + 1

            step = lax.fori_loop(0, kh, k_body, step)
        return step

    total = lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))

    # Observe the releases of the last stages too, so that no barrier is left with
    # an unobserved phase (the interpreter checks this; on the GPU it is free).
    @pl.loop(lax.max(total - stages, 0), total)
    def _(j):
        plgpu.barrier_wait(empty.at[lax.rem(j, stages)])


def _ws_consume(t: _WsTiling, h, splits, normed_inputs, acc, eps, dtype, wg, ss_ref, o_ref, a_smem,
                b_smem, o_smem, full, empty, my_tiles, tile_coords):
    """A consumer warpgroup's ``wg_m x tile_n`` share of every tile its program owns. A tile's
    row scales are loaded before its first wgmma: ``acc="rescale"`` needs ``r_e / r_h`` at the
    half boundary, before the hidden half is read."""
    wg_m, tile_n, cta_m, cta_n, split_m = t.wg_m, t.tile_n, t.cta_m, t.cta_n, t.split_m
    if split_m:
        a_of = lambda slot: a_smem.at[slot, pl.ds(wg * wg_m, wg_m)]
        b_of = lambda slot: b_smem.at[slot].T
    else:
        a_of = lambda slot: a_smem.at[slot]
        b_of = lambda slot: b_smem.at[slot, pl.ds(wg * tile_n, tile_n)].T
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    run_half = functools.partial(_ws_consume_half, t, a_of, b_of, full, empty)

    def tile_body(i, step):
        mi, ni = tile_coords(i)
        row0 = mi * cta_m + (wg * wg_m if split_m else 0)
        col0 = ni * cta_n + (0 if split_m else wg * tile_n)
        rows = pl.ds(row0, wg_m)
        bcast = lambda v: lax.broadcast_in_dim(v, (wg_m, tile_n), [0])
        *r_e, r_h = (_scale_of(sum(plgpu.load(ss_ref.at[p, j, rows], layout=row_layout,
                                              optimized=False) for p in range(splits)), h, eps)
                     for j in range(normed_inputs))
        scaled_e = (lambda a: a * bcast(r_e[0])) if r_e else (lambda a: a)

        if acc == "two":
            def scope(acc_e, acc_h):
                s = run_half(acc_e, step)
                s = run_half(acc_h, s)
                return s, scaled_e(acc_e[...]) + acc_h[...] * bcast(r_h)

            step, out = pl.run_scoped(scope, plgpu.ACC((wg_m, tile_n), jnp.float32),
                                      plgpu.ACC((wg_m, tile_n), jnp.float32))
        else:
            def scope(acc_ref):
                s = run_half(acc_ref, step)
                acc_ref[...] = acc_ref[...] * bcast((r_e[0] if r_e else 1.0) / r_h)
                s = run_half(acc_ref, s)
                return s, acc_ref[...] * bcast(r_h)

            step, out = pl.run_scoped(scope, plgpu.ACC((wg_m, tile_n), jnp.float32))
        _ws_store(t, out.astype(dtype), wg, o_smem, o_ref, row0, col0)
        return step

    lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def _ws_consume_half(t: _WsTiling, a_of, b_of, full, empty, acc_ref, step):
    """One half's k steps into ``acc_ref``: one wgmma in flight, each stage released as soon
    as the wgmma that read it has finished."""
    stages = t.stages

    def k_body(k, step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(full.at[slot])
        plgpu.wgmma(acc_ref, a_of(slot), b_of(slot))
        plgpu.wgmma_wait(1)  # the previous step's wgmma is done: free its stage

        @pl.when(k > 0)
        def _():
            plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])

        return step + 1

    step = lax.fori_loop(0, t.kh, k_body, step)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])
    return step


def _ws_store(t: _WsTiling, out, wg, o_smem, o_ref, row0, col0):
    """A consumer's tile to global memory in ``epi_m x epi_n`` chunks: the stage ring leaves
    shared memory for no more (``_ws_gemm``)."""
    epi_m, epi_n = t.epi_m, t.epi_n
    for j in range(t.wg_m // epi_m):
        for c in range(t.tile_n // epi_n):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = out[j * epi_m:(j + 1) * epi_m, c * epi_n:(c + 1) * epi_n]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[wg], o_ref.at[pl.ds(row0 + j * epi_m, epi_m),
                                        pl.ds(col0 + c * epi_n, epi_n)])


@functools.partial(jax.jit, static_argnames=("eps", "wg_m", "tile_n", "k_splits", "stages",
                                             "num_programs", "small_m", "acc", "split", "sumsq",
                                             "embed_normed"))
def fc_gemm_folded(embed, hidden, w_folded, *, eps, embed_normed=False, wg_m=None, tile_n=None,
                   k_splits=None, stages=None, num_programs=None, small_m=SMALL_M, acc="rescale",
                   split=None, sumsq=None):
    """The kernel path: `api.fc_gemm` given the folded weight `reference.fold_fc_weight(...)`.

    embed, hidden: [M, H]; w_folded: [H, 2H]; all three the same 16-bit dtype. The tile
    arguments override the plan (benchmarks, tests); M <= ``small_m`` takes the
    split-K stream, larger M the warp-specialised GEMM, by default with one rescaled
    accumulator per consumer (``acc="rescale"``: 128x256 CTA tiles, measured 13-15%
    faster than ``acc="two"`` on the H200, results/kernels/kernels_h200.md, 2026-11-29). Pallas' GPU
    interpreter cannot store to an accumulator, so interpret mode needs ``acc="two"``
    (`api.fc_gemm` passes it when interpreted). ``split``: how the two consumer warpgroups
    share a CTA tile (``plan_large``). ``sumsq``: ``(tile_c, splits, stages)`` of
    the row sum-of-squares kernel that runs before the large-M GEMM.
    ``embed_normed``: ``embed``'s rows are already RMS-normalised (`reference.normed_embed_rows`; in the
    model that happens inside the embedding gather, from a per-token table), so only the hidden
    half's row norms are computed and the large-M pre-pass reads half the bytes.
    """
    _check_kernel_inputs(embed, hidden, w_folded, small_m)
    m, h = embed.shape
    if small_m > SPLITK_MAX_M:
        raise ValueError(f"small_m={small_m}: the split-K kernel holds at most {SPLITK_MAX_M} rows")
    if m <= small_m:
        tn, ks, st = plan_small(m, h, num_sms(), tile_n, k_splits, stages)
        return _splitk(embed, hidden, w_folded, tile_n=tn, k_splits=ks, stages=st, eps=eps,
                       embed_normed=embed_normed)
    wm, tn, st, npg, sm = plan_large(m, h, num_sms(), wg_m, tile_n, stages, num_programs, acc,
                                      split)
    tc, sp, sst = plan_sumsq(m, h, num_sms(), *(sumsq or ()))
    cta_m = cta_shape(wm, tn, sm)[0]
    m_pad = -(-m // cta_m) * cta_m  # rows past M: TMA zero-fill, never stored
    ss_parts = row_sumsq(*(() if embed_normed else (embed,)), hidden, m_pad=m_pad, tile_c=tc, splits=sp,
                          stages=sst)
    return _ws_gemm(embed, hidden, w_folded, ss_parts, wg_m=wm, tile_n=tn, stages=st,
                    num_programs=npg, acc=acc, split=sm, eps=eps)
