"""The MTP drafter's input projection with both RMSNorms and the concat fused in.

``out = concat(norm_e(embed), norm_h(hidden)) @ w.T`` with Qwen3-Next's ``(1 + w)``
RMSNorm. Done unfused, XLA writes and re-reads the normalised ``[M, 2H]`` input;
here it never reaches device memory. The kernel streams raw ``embed``/``hidden``
tiles and weight tiles through a TMA pipeline; before each wgmma the warpgroup
scales its A tile by the row's ``rsqrt`` and the column's ``(1 + w)``, rounds to
bf16 exactly as the Hugging Face norm does (all in f32, one cast at the end) and
stores it into a shared-memory operand buffer. The embedding half of ``w``
(columns ``[0, H)``) meets the normalised embedding, the other half the hidden.

The per-row ``rsqrt(mean(x^2) + eps)`` needs the whole row before the first tile
can be scaled, so a small XLA reduction computes it first; it reads ``embed`` and
``hidden`` once (``4 M H`` bytes), a few percent of the GEMM's time at large M.

Two regimes share the kernel. Drafter prefill (M in the thousands) is
compute-bound: 64 x 128 output tiles, one per program, bf16 written straight out.
Batched propose (M = 1..64) is a weight stream: M is padded to one 64-row tile and
the 2H reduction is split across programs (split-K) so that every multiprocessor
streams its share of ``w``; the f32 partials (``splits x 64 x H`` floats) are
summed by XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.pallas.backend import resolve_impl


def _rms_scale(x, eps):
    xf = x.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)


def _rms_norm(x, weight, eps):
    """Qwen3-Next RMSNorm: f32 throughout, scale by (1 + w), one cast back."""
    y = x.astype(jnp.float32) * _rms_scale(x, eps)[..., None]
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _check_inputs(embed, hidden, norm_e_w, norm_h_w, w):
    if embed.ndim != 2 or embed.shape != hidden.shape:
        raise ValueError(
            f"embed and hidden must both be [M, H]; got {embed.shape} and {hidden.shape}"
        )
    m, h = embed.shape
    if norm_e_w.shape != (h,) or norm_h_w.shape != (h,):
        raise ValueError(
            f"norm weights must be [H={h}]; got {norm_e_w.shape} and {norm_h_w.shape}"
        )
    if w.shape != (h, 2 * h):
        raise ValueError(
            f"w must be [H, 2H] = [{h}, {2 * h}] (out_features, in_features); got {w.shape}"
        )


def fc_gemm_reference(embed, hidden, norm_e_w, norm_h_w, w, *, eps, impl="reference"):
    """Norm both inputs, concat (embedding first), one f32-accumulated dot; bf16 out.

    The definition the kernel is tested against and the CPU path of the model.
    ``impl`` is accepted (and ignored) so both functions share one signature.
    """
    del impl
    _check_inputs(embed, hidden, norm_e_w, norm_h_w, w)
    x = jnp.concatenate(
        [_rms_norm(embed, norm_e_w, eps), _rms_norm(hidden, norm_h_w, eps)], axis=-1
    )
    out = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    return out.astype(embed.dtype)


def _num_sms() -> int:
    try:
        return jax.devices()[0].core_count or 132
    except Exception:  # CPU devices have no core_count in some jaxlib builds.
        return 132


def _plan(m: int, h: int, num_sms: int):
    """(tile_m, tile_n, k_splits) for M rows: split-K only while programs are scarce."""
    # Measured on the H200 (results/kernels_h200.md, run 2): M=8, H=4096: 64x128 tiles with
    # 4 stages 29.1 µs vs 64x64 32.0 µs; M=12288: 64x128 with 2 stages (three programs per
    # SM overlap each other's prologue) 2.22 ms vs 128x128 2.89 ms.
    tile_k = 64
    tile_m, tile_n, stages = (64, 128, 4) if m <= 64 else (64, 128, 2)
    while h % tile_n:
        tile_n //= 2
    if tile_n < 8:
        raise ValueError(f"H={h} must be a multiple of 8")
    programs = (h // tile_n) * (-(-m // tile_m))
    splits = 1
    # Each split must lie inside one half (embed or hidden) and hold whole k tiles.
    # At most one wave: at M=8, H=4096 four splits (128 programs) ran 29.1 µs, eight 32.8 µs.
    while (programs * splits * 2 <= num_sms and (2 * h) % (2 * splits * tile_k) == 0
           and 2 * h // (2 * splits) >= 4 * tile_k):
        splits *= 2
    if h % tile_k:
        raise ValueError(f"H={h} must be a multiple of {tile_k}")
    return tile_m, tile_n, tile_k, splits, stages


@functools.partial(jax.jit, static_argnames=("eps", "tile_m", "tile_n", "k_splits", "stages"))
def _fc_gemm_pallas(embed, hidden, norm_e_w, norm_h_w, w, *, eps, tile_m=None, tile_n=None,
                    k_splits=None, stages=None):
    m, h = embed.shape
    dtype = embed.dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != dtype:
        raise ValueError(f"embed, hidden and w must share a 16-bit dtype; got {dtype}, {w.dtype}")
    p_m, p_n, tile_k, p_s, p_st = _plan(m, h, _num_sms())
    tile_m, tile_n, k_splits = tile_m or p_m, tile_n or p_n, k_splits or p_s
    stages = stages or p_st
    m_pad = -(-m // tile_m) * tile_m
    pad = ((0, m_pad - m), (0, 0))
    e_p, h_p = jnp.pad(embed, pad), jnp.pad(hidden, pad)
    row_scale = jnp.stack([_rms_scale(e_p, eps), _rms_scale(h_p, eps)])  # [2, M_pad]
    col_scale = 1.0 + jnp.concatenate([norm_e_w, norm_h_w]).astype(jnp.float32)  # [2H]

    chunk = 2 * h // k_splits  # reduction columns per program
    out_dtype = dtype if k_splits == 1 else jnp.float32
    swizzle = 128
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(tile_n * jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )

    def kernel(e_ref, h_ref, rs_ref, cs_ref, w_ref, o_ref, a_smem, o_smem):
        ni = lax.axis_index("n")
        mi = lax.axis_index("m")
        si = lax.axis_index("k")
        rows = pl.ds(mi * tile_m, tile_m)
        cols = pl.ds(ni * tile_n, tile_n)

        def run_half(acc_ref, x_ref, half, k_begin, k_end):
            """Accumulates x[:, k_begin:k_end] (normalised) times w's matching columns."""
            r = plgpu.load(rs_ref.at[half, rows], layout=plgpu.Layout.WGMMA.reduce(1),
                           optimized=False)
            base = half * h + k_begin

            def step(_, x_smem, w_smem, c_smem):
                c = plgpu.load(c_smem, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                y = x * lax.broadcast_in_dim(r, x.shape, [0])
                y = y * lax.broadcast_in_dim(c, x.shape, [1])
                a_smem[...] = y.astype(dtype)
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, a_smem, w_smem.T)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step,
                grid=((k_end - k_begin) // tile_k,),
                in_specs=[
                    plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k), transforms=transforms),
                    plgpu.BlockSpec((tile_n, tile_k), lambda k: (0, k), transforms=transforms),
                    plgpu.BlockSpec((tile_k,), lambda k: (k,)),
                ],
                max_concurrent_steps=stages,
            )(
                x_ref.at[rows, pl.ds(k_begin, k_end - k_begin)],
                w_ref.at[cols, pl.ds(base, k_end - k_begin)],
                cs_ref.at[pl.ds(base, k_end - k_begin)],
            )

        def acc_scope(acc_ref, s):
            lo, hi = s * chunk, (s + 1) * chunk
            for half, x_ref in ((0, e_ref), (1, h_ref)):
                a, b = max(lo, half * h), min(hi, (half + 1) * h)
                if a < b:
                    run_half(acc_ref, x_ref, half, a - half * h, b - half * h)
            return acc_ref[...]

        for s in range(k_splits):
            @pl.when(si == s)
            def _split(s=s):
                acc = pl.run_scoped(functools.partial(acc_scope, s=s),
                                    plgpu.ACC((tile_m, tile_n), jnp.float32))
                o_smem[...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                dst = o_ref.at[rows, cols] if k_splits == 1 else o_ref.at[s, rows, cols]
                plgpu.copy_smem_to_gmem(o_smem, dst)
                plgpu.wait_smem_to_gmem(0)

    out_shape = (m_pad, h) if k_splits == 1 else (k_splits, m_pad, h)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(h // tile_n, m_pad // tile_m, k_splits),
        grid_names=("n", "m", "k"),
        scratch_types=dict(
            a_smem=plgpu.SMEM((tile_m, tile_k), dtype, transforms=transforms),
            o_smem=plgpu.SMEM((tile_m, tile_n), out_dtype, transforms=out_transforms),
        ),
    )
    out = call(e_p, h_p, row_scale, col_scale, w)
    if k_splits > 1:
        out = jnp.sum(out, axis=0).astype(dtype)
    return out[:m]


def fc_gemm(embed, hidden, norm_e_w, norm_h_w, w, *, eps, impl="auto"):
    """``concat(norm_e(embed), norm_h(hidden)) @ w.T`` -> [M, H] in embed's dtype.

    embed, hidden: [M, H]; norm_e_w, norm_h_w: [H] Qwen3-Next ``(1 + w)`` RMSNorm
    weights; w: [H, 2H] in the Hugging Face Linear layout, embedding columns first.
    f32 accumulation. ``impl`` picks the path (see ``mtp.pallas.backend``);
    ``"interpret"`` must be called eagerly, as interpret mode is switched on
    around this call's own lowering.
    """
    mode = resolve_impl(impl)
    if mode == "pallas" and impl == "auto":
        # Measured on the H200 (results/kernels_h200.md): the fused kernel runs at
        # 0.4-0.8x of XLA's norm + concat + dot, so "auto" keeps XLA until it wins.
        mode = "reference"
    if mode == "reference":
        return _reference_jit(embed, hidden, norm_e_w, norm_h_w, w, eps=eps)
    _check_inputs(embed, hidden, norm_e_w, norm_h_w, w)
    args = (embed, hidden, norm_e_w, norm_h_w, w)
    if mode == "interpret":
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return _fc_gemm_pallas(*args, eps=eps)
    return _fc_gemm_pallas(*args, eps=eps)


_reference_jit = jax.jit(fc_gemm_reference, static_argnames=("eps", "impl"))
