"""The residual add and the norm after it, as one kernel: ``s = x + y; h = rms_norm(s)``.

A decoder layer adds its token mixer's output to the residual stream and normalizes the sum
for its FFN. XLA runs the two as separate kernels: its Triton normalization fusion has one
output, and the sum is needed again for the next residual add. A decode step of a few rows
is mostly such small kernels (results/decode/decode_h200.md), so here one program per row writes
both: 16 launches fewer per step of the 1.38B model.

A row whose width is not a power of two (the shipped default model's 384) is read as
power-of-two pieces (256 + 128): Triton's tensors must have power-of-two sizes, and XLA
runs such a norm as two kernels, a reduction and an elementwise pass.

Pallas' Triton lowering, like `mtp.ops.gdn_step` and for the same reason: the op is a
row reduction with no matmul.

`reference.add_rms_norm_reference` is the definition: the model's own ``add_rows`` and
``rms_norm``; `api.add_rms_norm` picks between the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops.lowering import triton_compiler_params

MAX_PIECES = 4  # a row is read as at most this many power-of-two pieces


def row_pieces(h: int) -> list[tuple[int, int]]:
    """``(offset, width)`` of the power-of-two pieces a row of ``h`` is read in, widest first."""
    pieces, offset = [], 0
    for bit in reversed(range(h.bit_length())):
        if h >> bit & 1:
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return pieces


def kernel_unsupported(x, y, w) -> str | None:
    """Why the kernel cannot take these (well-formed, `reference.check_inputs`) inputs, or None:
    the caller then runs the reference."""
    h = x.shape[-1]
    if h % 16 or len(row_pieces(h)) > MAX_PIECES:
        return (f"hidden size {h} is not a multiple of 16 made of at most {MAX_PIECES} "
                f"power-of-two pieces")
    if y.dtype != x.dtype:
        return f"y's dtype {y.dtype} is not the stream's {x.dtype}"
    return None


def num_warps(h: int) -> int:
    """Warps per row: 8 for the 1.38B model's 2048-wide rows, where the kernel took 1.73 µs
    against 2.30 at 4 warps (and XLA's add + norm 2.85) on the H200, one row padded to two
    (results/decode/decode_h200.md, 2026-11-30; 2 warps 2.08, 16 warps 1.79). Narrower rows (the
    default model's 384) keep the 4 they were measured with."""
    return 8 if h >= 2048 else 4


def _kernel(x_ref, y_ref, w_ref, s_ref, h_ref, *, real_rows, eps):
    width = x_ref.shape[-1]
    pieces, sum_sq = [], jnp.zeros((1,), jnp.float32)
    for offset, size in row_pieces(width):
        cols = pl.ds(offset, size)
        y = y_ref[:, cols]
        y = jnp.where(pl.program_id(0) < real_rows, y, jnp.zeros_like(y))
        s = (x_ref[:, cols].astype(jnp.float32) + y.astype(jnp.float32)).astype(s_ref.dtype)
        s_ref[:, cols] = s
        sf = s.astype(jnp.float32)
        sum_sq = sum_sq + jnp.sum(sf * sf, axis=-1)
        pieces.append((cols, sf))
    # `mtp.ops.norms.rms_norm`'s arithmetic, with the row's sum of squares taken over its pieces.
    scale = jax.lax.rsqrt(sum_sq / width + eps)[:, None]
    for cols, sf in pieces:
        h_ref[:, cols] = (sf * scale * (1.0 + w_ref[cols].astype(jnp.float32))).astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm_triton(x, y, w, *, eps, interpret=False):
    """The kernel path of `reference.add_rms_norm_reference`; ``interpret``: Pallas' interpreter (CPU tests)."""
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
        name="add_rms_norm",  # the kernel's name in a profile (CUPTI)
        **triton_compiler_params(interpret, num_warps=num_warps(h)),
    )(x2, y2, w)
    return s.reshape(x.shape), normed.reshape(x.shape)

