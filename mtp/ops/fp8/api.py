"""The FP8 GEMM entry point: ``x @ w.T`` for a `BlockFp8Weight`, reference or kernel.

`matmul` resolves ``impl`` through the project's kernel switch (`mtp.pallas.backend.resolve_impl`,
op ``"fp8_gemm"``, so ``MTP_KERNELS=fp8_gemm=...`` names it like every other op). No Pallas kernel
exists for it yet, so every implementation runs the reference (`reference.w8a16` / `w8a8`), whose
dequantize XLA fuses into its GEMM on a GPU. A kernel goes in a file beside this one with the same
signature and an ``unsupported(...) -> str | None`` naming the shapes it declines, and `matmul`
calls it where the resolved path is ``"pallas"`` or ``"interpret"``.
"""

from __future__ import annotations

import jax

from mtp.ops.fp8 import reference
from mtp.ops.fp8.reference import BlockFp8Weight
from mtp.pallas.backend import resolve_impl

OP = "fp8_gemm"
MODES = ("w8a16", "w8a8")


def matmul(x: jax.Array, w: BlockFp8Weight, *, mode: str = "w8a16", impl: str = "auto") -> jax.Array:
    """``x [..., in] @ w.T`` for ``w [out, in]``, f32 ``[..., out]``.

    ``mode``: ``"w8a16"`` (activations as they are; the model's path) or ``"w8a8"`` (activations
    quantized per token and 128 columns, ``activation_scheme: dynamic``; an option for prefill).
    """
    if mode not in MODES:
        raise ValueError(f"fp8 matmul mode={mode!r}; choose one of {', '.join(MODES)}")
    resolve_impl(impl, OP)  # checks impl and MTP_KERNELS; every path is the reference until a kernel exists
    return getattr(reference, mode)(x, w)
