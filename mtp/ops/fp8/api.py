"""The FP8 GEMM entry point: ``x @ w.T`` for a `BlockFp8Weight`, reference or kernel.

`matmul` resolves ``impl`` through the project's kernel switch (`mtp.ops.dispatch.choose`,
op ``"fp8_gemm"``: the model hands it ``ExecutionConfig.impl_for("fp8_gemm")``, so
``MTP_KERNELS=fp8_gemm=...`` names it like every other op). The reference
(`reference.w8a16` / `w8a8`) dequantizes right before XLA's dot. The kernel (`triton`, with the
reference's signature and an ``unsupported`` that names the inputs it declines) runs where the
resolved path is ``"pallas"`` or ``"interpret"``; under ``"auto"`` on a GPU only where its measured
rule (`triton.pays`) says it beats XLA.

One row (a decode step's projection) of a weight of more than 4096 outputs (`triton.gemv_pays`)
goes to the one-row kernel `triton.gemv` under its own op name, ``"fp8_gemv"``
(``MTP_KERNELS=fp8_gemv=reference`` hands one row back to the rule below), which streams the weight
without padding the row or splitting the sum: one launch a projection.

`triton` is the kernel for ``w8a16`` at up to 16 rows (a decode or verify step, where the GEMM is
bound by the weight's bytes): XLA's fused dequantize streamed FP8 weights 2-3x slower than bf16
ones there. More rows, other dtypes or blocks, and ``w8a8`` run the reference, which is the only
path on a CPU unless ``impl="interpret"`` is named, so a CPU model with FP8 weights still equals
its dequantized twin bit for bit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtp.ops import dispatch
from mtp.ops.fp8 import reference, triton
from mtp.ops.fp8.reference import BlockFp8Weight
from mtp.ops.lowering import triton_interpret_scope

OP = "fp8_gemm"
GEMV_OP = "fp8_gemv"
MODES = ("w8a16", "w8a8")


def matmul(x: jax.Array, w: BlockFp8Weight, *, mode: str = "w8a16", impl: str = "auto", gemv_impl: str = "auto",
           out_dtype=jnp.float32) -> jax.Array:
    """``x [..., in] @ w.T`` for ``w [out, in]``, ``[..., out]`` in ``out_dtype`` (the sums in f32).

    ``mode``: ``"w8a16"`` (activations as they are; the model's path) or ``"w8a8"`` (activations
    quantized per token and 128 columns, ``activation_scheme: dynamic``; an option for prefill).
    ``impl`` / ``gemv_impl``: the paths of ops ``"fp8_gemm"`` and ``"fp8_gemv"`` (one row).
    """
    if mode not in MODES:
        raise ValueError(f"fp8 matmul mode={mode!r}; choose one of {', '.join(MODES)}")
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1])
    if mode == "w8a16" and rows == 1:
        path = dispatch.choose(GEMV_OP, gemv_impl, lambda: triton.gemv_unsupported(x2, w),
                               kernel_pays=lambda: triton.gemv_pays(w.shape[0]))
        if path != "reference":
            with triton_interpret_scope(path) as interpret:
                return triton.gemv(x2, w, out_dtype=out_dtype, interpret=interpret).reshape(*x.shape[:-1], -1)
    path = dispatch.choose(OP, impl, lambda: unsupported(x, w) if mode == "w8a16" else f"mode {mode}",
                           kernel_pays=lambda: triton.pays(rows, w.shape[0]))
    if path == "reference":
        return getattr(reference, mode)(x, w).astype(out_dtype)
    with triton_interpret_scope(path) as interpret:
        return triton.w8a16(x2, w, interpret=interpret).reshape(*x.shape[:-1], -1).astype(out_dtype)


def unsupported(x: jax.Array, w: BlockFp8Weight) -> str | None:
    """Why `matmul`'s w8a16 kernel declines ``x [..., in] @ w.T`` (the reference then runs), or None."""
    if x.ndim < 1 or w.ndim != 2:
        return f"the kernel takes x [..., in] and a 2-D weight, got x {tuple(x.shape)} and w {w.shape}"
    return triton.unsupported(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w)
