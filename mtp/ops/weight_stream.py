"""Streaming a weight's rows past a few activation rows inside a Triton-lowered Pallas kernel.

A decode step multiplies one row (a verify a few) by each weight, so a GEMM there is a stream of the
weight's bytes; a Triton dot would pad the row to 16. These helpers read a program's rows of a weight
in place, chunk by chunk, and multiply-and-sum them against one activation row in f32: the MoE
kernels of a decode step (`mtp.ops.moe.triton`) stream the selected experts this way, and the FP8
GEMV (`mtp.ops.fp8.triton.gemv`) a dense weight. A weight is an array or a block-scaled FP8 weight
(`mtp.ops.fp8.BlockFp8Weight`, 128 x 128 scale blocks), always with a leading stack axis (`as_stack`
makes a 2-D weight a stack of one). Each output's sum runs over the contraction in the same chunks
whatever the number of rows, so a verify's token computes what a decode step's would.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops.fp8.reference import BlockFp8Weight

SCALE_BLOCK = 128  # the FP8 scale block (Qwen's checkpoints' only one)
MIN_CHUNK = 16  # Triton's smallest tile side


def chunk_of(n: int, chunk: int) -> int:
    """The contraction chunk for a contraction of ``n``: the largest power of two <= ``chunk`` dividing it."""
    return math.gcd(n, chunk)


def check_tiling(config, tiles, low: int = 1, high: int | None = None,
                 counts=("num_warps", "num_stages")) -> None:
    """Raise a ValueError that names the field unless each of ``tiles`` is a power of two in
    ``[low, high]`` and each of ``counts`` at least 1: the check the streaming kernels' tiling
    configs share."""
    kind = type(config).__name__
    for field in tiles:
        t = getattr(config, field)
        if t < low or (high is not None and t > high) or t & (t - 1):
            bounds = (f" from {low}" if low > 1 else "") + (f" to {high}" if high is not None else "")
            raise ValueError(f"{kind}.{field}={t}: a power of two{bounds}")
    if any(getattr(config, field) < 1 for field in counts):
        raise ValueError(f"{kind} {config}: {', '.join(counts)} must be >= 1")


def is_fp8(w) -> bool:
    return isinstance(w, BlockFp8Weight)


def operands(w) -> tuple:
    """The kernel operands of one weight: ``(values,)`` or ``(values, f32 scales)``."""
    if is_fp8(w):
        return (w.values, w.scale_inv.astype(jnp.float32))
    return (w,)


def as_stack(w):
    """A 2-D weight (plain or FP8) as a stack of one, the leading axis the kernels index."""
    return jax.tree.map(lambda leaf: leaf[None], w)


def rows_times(refs, e, o0, k0, v, *, rows: int, chunk: int):
    """``sum_c w[e, o0 + r, k0 + c] * v[c]`` for ``r < rows``: f32 ``[rows]``, the weight read in place.

    ``refs``: `operands` of a stacked weight; ``v``: f32 ``[chunk]``. With scales, ``v`` is scaled
    per 128 columns first (the rows lie in one row of scale blocks: ``rows`` divides 128 and ``o0``
    is a multiple of it), so the weight's tile needs no per-element scale; E4M3 values convert to
    f32 exactly.
    """
    w = refs[0][e, pl.ds(o0, rows), pl.ds(k0, chunk)].astype(jnp.float32)
    if len(refs) == 2:
        blocks = chunk // SCALE_BLOCK if chunk >= SCALE_BLOCK else 1
        s = refs[1][e, o0 // SCALE_BLOCK, pl.ds(k0 // SCALE_BLOCK, blocks)]
        if chunk >= SCALE_BLOCK:
            v = (v.reshape(blocks, SCALE_BLOCK) * s[:, None]).reshape(chunk)
        else:
            v = v * s[0]
    return jnp.sum(w * v[None, :], axis=1)


def stream(refs_of, e, row_of, src_ref, o0, *, rows, contraction, chunk, out_ref, epilogue):
    """One program: rows ``[o0, o0 + rows)`` of each weight in ``refs_of`` (stack entry ``e``) times
    row ``row_of`` of ``src_ref``, then ``epilogue`` of the f32 sums, written to ``out_ref`` (a
    ``[1, rows]`` block). Program ids are read by the caller, outside any ``pl.when``: Pallas'
    interpreter does not take them inside one."""

    def body(c, acc):
        k0 = pl.multiple_of(c * chunk, chunk)
        v = src_ref[row_of, pl.ds(k0, chunk)].astype(jnp.float32)
        return tuple(a + rows_times(r, e, o0, k0, v, rows=rows, chunk=chunk) for a, r in zip(acc, refs_of))

    zeros = tuple(jnp.zeros((rows,), jnp.float32) for _ in refs_of)
    acc = jax.lax.fori_loop(0, contraction // chunk, body, zeros)
    out_ref[...] = epilogue(*acc).astype(out_ref.dtype)[None, :]


def fp8_unsupported(w, rows: int, name: str = "the weight") -> str | None:
    """Why an FP8 weight cannot stream in programs of ``rows`` rows (one row of scale blocks), or None."""
    if jnp.dtype(w.values.dtype) != jnp.float8_e4m3fn or tuple(w.block) != (SCALE_BLOCK, SCALE_BLOCK):
        return (f"{name} is {w.values.dtype} in {tuple(w.block)} blocks; the kernels take float8_e4m3fn in "
                f"({SCALE_BLOCK}, {SCALE_BLOCK}) blocks")
    if rows > SCALE_BLOCK or SCALE_BLOCK % rows:
        return f"FP8 weights stream in blocks of rows dividing {SCALE_BLOCK} (one row of scale blocks), not {rows}"
    if any(d % SCALE_BLOCK for d in w.shape[-2:]):
        return f"{name}'s {tuple(w.shape[-2:])} are not whole {SCALE_BLOCK}-blocks"
    return None
