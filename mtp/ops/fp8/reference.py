"""Block-scaled FP8 weights and their pure-JAX reference matmuls.

Qwen's FP8 checkpoints (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size: [128, 128]``)
store a Linear weight ``w [out, in]`` as E4M3 values ``q`` (``float8_e4m3fn``) and one scale per
128 x 128 block, ``weight_scale_inv [ceil(out / 128), ceil(in / 128)]``, which multiplies the
stored value: ``w[o, i] = q[o, i] * scale_inv[o // 128, i // 128]``. Blocks at the right and bottom
edges may be partial. `BlockFp8Weight` holds the two arrays (any leading dims, so stacked experts
``[E, out, in]`` with scales ``[E, ceil(out / 128), ceil(in / 128)]`` are one weight) with the block
size as static metadata, so it passes through ``jax.jit`` like an array and never retraces.

The reference matmul dequantizes right before the dot (`dequantize` is a convert, a broadcast of
the block scales and a multiply): on the CPU that is exactly ``x @ dequantize(w).T``, and on a GPU
XLA fuses the elementwise prologue into its GEMM's operand load, so the weight stays 8-bit in
device memory. `w8a8` is the ``activation_scheme: dynamic`` form of transformers and vLLM: each
token's activations quantized to E4M3 in groups of the weight's input block (one scale per token
and 128 columns, from the group's amax), both operands then dequantized and multiplied in f32.

This module imports only JAX and numpy: the model, the checkpoint code and a future kernel all
build on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

BLOCK = (128, 128)  # (rows, columns) of one scale block: the only size Qwen's checkpoints use
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale_inv"],
                   meta_fields=["block", "scale_dtype"])
@dataclasses.dataclass(frozen=True)
class BlockFp8Weight:
    """A block-scaled FP8 weight: ``values[..., o, i] * scale_inv[..., o // bo, i // bi]``.

    ``values``: ``float8_e4m3fn [..., out, in]`` (HF Linear orientation). ``scale_inv``: ``f32
    [..., ceil(out / bo), ceil(in / bi)]``, ``(bo, bi) = block``. ``scale_dtype``: the dtype the
    checkpoint stores the scales in (``"float32"`` or ``"bfloat16"``); the device keeps them in f32
    (a bf16 value is exact in f32), and a save writes them back in this dtype, so a round trip is
    exact. The leaves may be host (numpy) arrays on their way from or to a file.
    """

    values: jax.Array
    scale_inv: jax.Array
    block: tuple[int, int] = BLOCK
    scale_dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight this stands for (the values' shape)."""
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def size(self) -> int:
        return math.prod(self.values.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """`dequantize` of this weight (the interface `mtp.ops.quantized`' weights share)."""
        return dequantize(self, dtype)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The block-scale shape of a weight of ``shape``: the last two dims rounded up to whole blocks."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def expand_scales(scale_inv: jax.Array, shape: tuple[int, ...], block: tuple[int, int]) -> jax.Array:
    """Each element's block scale, ``[..., out, in]`` (``shape``): a broadcast, no gather.

    A repeat of each scale over its block's rows and columns, cropped where the edge blocks are
    partial; XLA writes it as a broadcast and a reshape, which fuse into their consumer.
    """
    rows, cols = shape[-2:]
    s = jnp.repeat(scale_inv, block[0], axis=-2)[..., :rows, :]
    return jnp.repeat(s, block[1], axis=-1)[..., :cols]


def dequantize(w: BlockFp8Weight, dtype=jnp.float32) -> jax.Array:
    """The weight ``w`` stands for, ``values * scale_inv`` per block, computed in f32, in ``dtype``.

    The product is the checkpoint's own definition of the weight; with bf16-stored scales (8
    significant bits times E4M3's 4) it is exact in f32.
    """
    scales = expand_scales(jnp.asarray(w.scale_inv, jnp.float32), w.shape, w.block)
    return (jnp.asarray(w.values).astype(jnp.float32) * scales).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block", "scale_dtype"))
def _quantize(w: jax.Array, block: tuple[int, int], scale_dtype: str) -> tuple[jax.Array, jax.Array]:
    w32 = w.astype(jnp.float32)
    *lead, rows, cols = w.shape
    pad = [(0, 0)] * len(lead) + [(0, -rows % block[0]), (0, -cols % block[1])]
    padded = jnp.pad(w32, pad)  # zeros never raise a block's amax
    nb_rows, nb_cols = scale_shape(w.shape, block)[-2:]
    blocks = padded.reshape(*lead, nb_rows, block[0], nb_cols, block[1])
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    # An all-zero block has no range to map; scale 1 keeps it exact (all zeros) and finite.
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(scale_dtype).astype(jnp.float32)
    # Clipped before the cast: XLA turns an f32 -> E4M3 overflow into NaN, and a scale rounded to
    # bf16 can put a block's amax a little above 448.
    q = jnp.clip(w32 / expand_scales(scale, w.shape, block), -E4M3_MAX, E4M3_MAX)
    return q.astype(jnp.float8_e4m3fn), scale


def quantize(w: jax.Array, block: tuple[int, int] = BLOCK, scale_dtype: str = "float32") -> BlockFp8Weight:
    """``w [..., out, in]`` (bf16 / f32) as a `BlockFp8Weight`, as Qwen's FP8 checkpoints are made.

    Each block's scale is its amax / 448 (so the block's largest magnitude maps to E4M3's
    largest), rounded to ``scale_dtype`` (the dtype a save stores it in); the values are the
    nearest E4M3 (round to nearest even) of ``w / scale``.
    """
    if jnp.ndim(w) < 2:
        raise ValueError(f"quantize: a weight of at least 2 dims [..., out, in] is needed, got shape {jnp.shape(w)}")
    block = tuple(int(b) for b in block)
    values, scale = _quantize(jnp.asarray(w), block, str(jnp.dtype(scale_dtype)))
    return BlockFp8Weight(values, scale, block, str(jnp.dtype(scale_dtype)))


def quantize_activations(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Dynamic 1 x ``group`` activation quantization: ``(E4M3 values [..., in], f32 scales [..., ceil(in / group)])``.

    One scale per token and ``group`` columns, its group's amax / 448, as ``activation_scheme:
    dynamic`` computes them at run time in transformers and vLLM.
    """
    xq, scale = _quantize(x[..., None, :], (1, group), "float32")
    return xq[..., 0, :], scale[..., 0, :]


def _check_2d(x: jax.Array, w: BlockFp8Weight) -> None:
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8 matmul: x {tuple(x.shape)} @ w.T needs a 2-D weight [out, {x.shape[-1]}], "
                         f"got a BlockFp8Weight of shape {w.shape}")


def _contract(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
    """``x @ w.T`` with f32 accumulation, contracting in place (no transposed copy)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def w8a16(x: jax.Array, w: BlockFp8Weight) -> jax.Array:
    """``x @ dequantize(w).T``, f32 out: the weight dequantized to ``x``'s dtype right before the dot.

    Exactly what a plain ``[out, in]`` weight equal to ``dequantize(w)`` computes at ``x``'s dtype
    (`mtp.model.gemm_layout.linear`'s cast of the weight to the activations), so a model with FP8
    weights and its dequantized twin agree bit for bit on the CPU.
    """
    _check_2d(x, w)
    return _contract(x, dequantize(w, x.dtype))


def w8a8(x: jax.Array, w: BlockFp8Weight) -> jax.Array:
    """``x @ w.T`` with ``x`` quantized too (dynamic 1 x 128 scales), f32 operands and accumulation.

    The reference of an FP8 x FP8 GEMM (prefill, where the GEMM is compute-bound): the
    activations' rounding to E4M3 is the only difference from `w8a16`, a relative error of
    about 2^-4 per element that averages down over the contraction.
    """
    _check_2d(x, w)
    xq, xs = quantize_activations(x, w.block[1])
    xd = xq.astype(jnp.float32) * jnp.repeat(xs, w.block[1], axis=-1)[..., :x.shape[-1]]
    return _contract(xd, dequantize(w, jnp.float32), precision=jax.lax.Precision.HIGHEST)
