"""Weight-streaming GEMM for a few rows: ``y[M, N] = x[M, K] @ w[N, K].T`` with M <= 64.

At decode and propose, a projection reads ``N x K`` weights for a handful of rows:
it is a weight stream, and its time is the weight bytes over the bandwidth it
reaches. The kernel is shaped for that and nothing else:

* one program per ``tile_n``-row slab of ``w`` (contiguous rows of the Hugging Face
  ``[out, in]`` layout), the narrowest slab that keeps the grid within one wave of
  the SMs, so every SM streams and no split-K reduction is needed;
* a ``stages``-deep ring of TMA copies (x tile + w tile per stage) that runs across
  all of K, with one wgmma in flight; rows past M are TMA zero-fill (the wgmma's
  64 rows cost nothing in memory traffic);
* the input may come in segments ``xs = (x_0, x_1, ...)`` read in turn along K (the
  MTP fc's ``[embed, hidden]``: no concat), each with an optional per-row RMS scale
  ``rsqrt(mean(x_i^2) + eps)`` computed in the kernel from the same x tiles the
  wgmma reads and applied to that segment's f32 accumulator in the epilogue.

``stream_gemm_reference`` is the definition. ``mtp.pallas.fc_gemm`` calls the kernel
with two normalised segments for its small-M path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.pallas.backend import num_sms, swizzle_transforms

MAX_ROWS = 64  # one wgmma row tile
SMEM_LIMIT = 232_448 - 2048  # bytes per block, less headroom for Mosaic's own scratch


def _check(xs, w):
    if not xs or any(x.ndim != 2 or x.shape != xs[0].shape for x in xs):
        raise ValueError(f"xs must be one or more [M, K] arrays of one shape; got "
                         f"{[x.shape for x in xs]}")
    m, k = xs[0].shape
    if w.ndim != 2 or w.shape[1] != len(xs) * k:
        raise ValueError(f"w must be [N, {len(xs)} x K = {len(xs) * k}] (out_features, "
                         f"in_features); got {w.shape}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the stream kernel takes 1..{MAX_ROWS} rows; got M={m}")


def stream_gemm_reference(xs, w, *, eps=None):
    """``concat_i(s_i * x_i) @ w.T`` in f32, ``s_i`` = the row RMS scale (or 1); out in x's dtype."""
    _check(xs, w)
    parts = []
    for x in xs:
        xf = x.astype(jnp.float32)
        if eps is not None:
            xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        parts.append(xf)
    out = jnp.dot(jnp.concatenate(parts, -1), w.astype(jnp.float32).T)
    return out.astype(xs[0].dtype)


def _smem_bytes(tile_n, tile_k, stages):
    return stages * (MAX_ROWS + tile_n) * tile_k * 2 + MAX_ROWS * tile_n * 2


def plan(n: int, k: int, sms: int, tile_n=None, tile_k=None, stages=None):
    """(tile_n, tile_k, stages): the narrowest w slab that keeps the grid within one wave.

    ``tile_n`` is a multiple of 16 (the output tile's 32-byte swizzle), at most 256
    (wgmma's N); the default ring is 6 stages, fewer where shared memory runs out.
    """
    if tile_n is None:
        tile_n = min(256, 16 * -(-n // (16 * sms)))
    if tile_n % 16 or not 16 <= tile_n <= 256:
        raise ValueError(f"tile_n={tile_n} must be a multiple of 16 in [16, 256]")
    if tile_k is None:
        tile_k = 128 if k % 128 == 0 else 64
    if tile_k % 64 or k % tile_k:
        raise ValueError(f"tile_k={tile_k} must be a multiple of 64 that divides K={k}")
    if stages is None:
        stages = 6
        while stages > 2 and _smem_bytes(tile_n, tile_k, stages) > SMEM_LIMIT:
            stages -= 1
    if stages < 2:
        raise ValueError(f"stages={stages}: one wgmma stays in flight, so at least 2 are needed")
    return tile_n, tile_k, stages


def _kernel_call(xs, w, *, eps, tile_n, tile_k, stages):
    m, k = xs[0].shape
    n = w.shape[0]
    dtype = xs[0].dtype
    nseg = len(xs)
    kh = k // tile_k  # steps per segment
    steps = nseg * kh
    stages = min(stages, steps)
    num_acc = nseg if eps is not None else 1
    in_tr = swizzle_transforms(tile_k, dtype)
    out_tr = swizzle_transforms(tile_n, dtype)
    smem = _smem_bytes(tile_n, tile_k, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"the stream kernel needs {smem} bytes of shared memory "
                         f"(tile_n={tile_n}, tile_k={tile_k}, stages={stages}); "
                         f"the limit is {SMEM_LIMIT}")

    def kernel(*refs):
        x_refs, (w_ref, o_ref, x_smem, w_smem, o_smem, full) = refs[:nseg], refs[nseg:]
        ni = lax.axis_index("n")
        zero = ni * 0  # a traced 0: rows past M are TMA zero-fill / clipped stores
        rows = pl.ds(zero, MAX_ROWS)
        cols = pl.ds(ni * tile_n, tile_n)  # the last slab may run past N: zero-fill, clipped

        def issue(step):
            slot = lax.rem(step, stages)
            kk = lax.rem(step, kh) * tile_k
            for i, src in enumerate(x_refs):
                @pl.when(lax.div(step, kh) == i)
                def _(src=src):
                    plgpu.copy_gmem_to_smem(src.at[rows, pl.ds(kk, tile_k)], x_smem.at[slot],
                                            full.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[cols, pl.ds(step * tile_k, tile_k)],
                                    w_smem.at[slot], full.at[slot])

        for s in range(stages):
            issue(jnp.int32(s))

        def run_segment(acc_ref, step):
            """kh steps into acc_ref; returns the next step and the row scale (or None)."""
            def k_body(_, carry):
                step, ss = carry if eps is not None else (carry, None)
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(full.at[slot])
                plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot].T)
                if eps is not None:  # the x tile's squares, while the wgmma runs
                    xf = x_smem[slot].astype(jnp.float32)
                    ss = ss + xf * xf
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: refill its stage

                @pl.when((step > 0) & (step - 1 + stages < steps))
                def _():
                    issue(step - 1 + stages)

                return (step + 1, ss) if eps is not None else step + 1

            if eps is None:
                step = lax.fori_loop(0, kh, k_body, step)
                plgpu.wgmma_wait(0)
                return step, None
            step, ss = lax.fori_loop(0, kh, k_body,
                                     (step, jnp.zeros((MAX_ROWS, tile_k), jnp.float32)))
            plgpu.wgmma_wait(0)
            return step, lax.rsqrt(jnp.sum(ss, axis=1) * (1.0 / k) + eps)

        def scope(*accs):
            step, out = jnp.int32(0), None
            bcast = lambda v: lax.broadcast_in_dim(v, (MAX_ROWS, tile_n), [0])
            for i in range(nseg):
                acc = accs[i if eps is not None else 0]
                step, r = run_segment(acc, step)  # a segment's first step refills the last one's stage
                if eps is not None:
                    term = acc[...] * bcast(r)
                    out = term if out is None else out + term
            return out if eps is not None else accs[0][...]

        out = pl.run_scoped(scope, *[plgpu.ACC((MAX_ROWS, tile_n), jnp.float32)] * num_acc)
        o_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), dtype),
        grid=(-(-n // tile_n),),
        grid_names=("n",),
        scratch_types=(  # x_smem, w_smem, o_smem, full
            plgpu.SMEM((stages, MAX_ROWS, tile_k), dtype, transforms=in_tr),
            plgpu.SMEM((stages, tile_n, tile_k), dtype, transforms=in_tr),
            plgpu.SMEM((MAX_ROWS, tile_n), dtype, transforms=out_tr),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ),
    )
    return call(*xs, w)


@functools.partial(jax.jit, static_argnames=("eps", "tile_n", "tile_k", "stages"))
def stream_gemm(xs, w, *, eps=None, tile_n=None, tile_k=None, stages=None):
    """``concat_i(s_i * x_i) @ w.T`` -> [M, N] in x's dtype, by the Pallas kernel.

    xs: a tuple of [M, K] arrays (M <= 64), the input's segments along K; w: [N, nseg*K]
    in the Hugging Face ``[out, in]`` layout; all 16-bit floats of one dtype. ``eps``:
    scale each segment's rows by ``rsqrt(mean(x_i^2) + eps)`` (None: no scale). The
    tile arguments override the plan (benchmarks, tests).
    """
    _check(xs, w)
    dtypes = {jnp.dtype(x.dtype) for x in xs} | {jnp.dtype(w.dtype)}
    if len(dtypes) != 1 or jnp.dtype(w.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                      jnp.dtype(jnp.float16)):
        raise ValueError(f"xs and w must share a 16-bit float dtype; got "
                         f"{[str(x.dtype) for x in xs]} and {w.dtype}")
    tn, tk, st = plan(w.shape[0], xs[0].shape[1], num_sms(), tile_n, tile_k, stages)
    return _kernel_call(tuple(xs), w, eps=eps, tile_n=tn, tile_k=tk, stages=st)
