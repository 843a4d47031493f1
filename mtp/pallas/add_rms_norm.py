"""The residual add and the norm after it, as one kernel: ``s = x + y; h = rms_norm(s)``.

A decoder layer adds its token mixer's output to the residual stream and normalizes the sum
for its FFN. XLA runs the two as separate kernels: its Triton normalization fusion has one
output, and the sum is needed again for the next residual add. A decode step of a few rows
is mostly such small kernels (results/decode_h200.md), so here one program per row writes
both: 16 launches fewer per step of the 1.38B model.

Pallas' Triton lowering, like `mtp.pallas.gdn_step` and for the same reasons: the op is a
row reduction with no matmul, and a Triton custom call can run inside XLA's CUDA graphs,
which a Mosaic GPU one cannot in jax 0.11.2 (results/decode_h200.md, session 7).

``add_rms_norm_reference`` is the definition: the model's own ``add_rows`` and ``rms_norm``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.model.layers import add_rows, rms_norm
from mtp.pallas.backend import run_triton_op, triton_compiler_params


def add_rms_norm_reference(x, y, w, *, eps):
    """``(s, rms_norm(s, w))`` with ``s = x + y``, ``x`` and ``s`` as ``x`` is.

    x: the residual stream, ``[*lead, H]`` or the padded stream's rows ``[R, H]``
    (`layers.stream_rows`); y: ``[*lead, H]``, the real rows (``add_rows``: padding rows of
    ``x`` get zeros); w: ``[H]``, the ``(1 + w)`` norm's weight.
    """
    s = add_rows(x, y)
    return s, rms_norm(s, w, eps)


def kernel_unsupported(x, y, w) -> str | None:
    """Why the kernel cannot take these inputs (the caller then runs the reference), or None."""
    h = x.shape[-1]
    if h & (h - 1) or h < 16:
        return f"hidden size {h} is not a power of two >= 16"
    if y.shape[-1] != h or w.shape != (h,):
        return f"y {y.shape} or w {w.shape} does not match the stream's hidden size {h}"
    if y.size > x.size or y.dtype != x.dtype:
        return f"y {y.shape} {y.dtype} is not at most the stream's rows {x.shape} {x.dtype}"
    return None


def _kernel(x_ref, y_ref, w_ref, s_ref, h_ref, *, real_rows, eps):
    y = y_ref[...]
    y = jnp.where(pl.program_id(0) < real_rows, y, jnp.zeros_like(y))
    s = (x_ref[...].astype(jnp.float32) + y.astype(jnp.float32)).astype(s_ref.dtype)
    s_ref[...] = s
    h_ref[...] = rms_norm(s, w_ref[...], eps)  # the model's own norm, on a [1, H] row


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm_pallas(x, y, w, *, eps, interpret=False):
    h = x.shape[-1]
    x2, y2 = x.reshape(-1, h), y.reshape(-1, h)
    rows, real_rows = x2.shape[0], y2.shape[0]
    row = pl.BlockSpec((1, h), lambda r: (r, 0))
    s, normed = pl.pallas_call(
        functools.partial(_kernel, real_rows=real_rows, eps=eps),
        grid=(rows,),
        # Padding rows (r >= real_rows) read y's last real row and add zeros instead.
        in_specs=[row, pl.BlockSpec((1, h), lambda r: (jnp.minimum(r, real_rows - 1), 0)),
                  pl.BlockSpec((h,), lambda r: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x.dtype)] * 2,
        interpret=interpret,
        **triton_compiler_params(interpret, num_warps=4),
    )(x2, y2, w)
    return s.reshape(x.shape), normed.reshape(x.shape)


def add_rms_norm(x, y, w, *, eps, impl="auto"):
    """``add_rms_norm_reference``'s signature and results; ``impl`` picks the path (``backend``).

    Inputs the kernel cannot take (``kernel_unsupported``) and traces under a
    tensor-parallel mesh (where the stream is replicated and XLA's fusions are as cheap)
    go to the reference. The kernel has no autodiff rule: training passes
    ``impl="reference"``.
    """
    return run_triton_op("add_rms_norm", impl, lambda: kernel_unsupported(x, y, w),
                         lambda: add_rms_norm_reference(x, y, w, eps=eps),
                         lambda interpret: _add_rms_norm_pallas(x, y, w, eps=eps, interpret=interpret))
