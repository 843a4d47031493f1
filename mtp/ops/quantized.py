"""The MTP head's quantized weight formats and the GEMM that takes them.

* `Fp8Weight` - 1 byte/weight: E4M3 values, one f32 scale per output row.
* `Nvfp4Weight` - 0.5 byte/weight (+ 1 byte per 16): E2M1 values in 16-wide blocks along
  the contraction dimension, an E4M3 scale per block and one f32 scale per tensor (the
  NVIDIA NVFP4 recipe).

Weights use the Hugging Face Linear layout ``[out_features, in_features]`` and `linear`
computes ``y = x @ W.T``. Quantized weights are pytrees so they pass through ``jax.jit``;
their static metadata (the logical shape) never retraces.

Rounding is done here explicitly onto each format's grid (round-to-nearest-even,
saturating) rather than by a dtype cast: XLA's f32 -> float8_e4m3fn conversion turns
overflow into NaN, and keeping the grid arithmetic visible lets tests pin code points.
Which tensors get quantized, and the ``--mtp_quant`` choice, belong to the loader
(`mtp.quant`); this module knows only arrays, so the model and the MoE op take these
weights without importing the loader.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16

# E2M1 magnitudes indexed by the low three code bits (2 exponent bits, 1 mantissa
# bit, exponent bias 1); bit 3 is the sign.
_E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@flax.struct.dataclass
class Fp8Weight:
    """E4M3 weight with one scale per output row (``w[o, :] ~= values[o, :] * row_scale[o]``).

    A per-row scale factors out of the contraction, so ``linear`` can run the GEMM on
    the raw E4M3 values and scale the output once.
    """

    values: jax.Array  # float8_e4m3fn [..., out, in]
    row_scale: jax.Array  # f32 [..., out]

    def dequantize(self) -> jax.Array:
        """The f32 weight it stands for (`dequantize`)."""
        return dequantize(self)


@flax.struct.dataclass
class Nvfp4Weight:
    """NVFP4 weight: packed E2M1 codes, E4M3 block scales, one f32 tensor scale.

    ``packed[o, j]`` holds the codes of elements ``2j`` (low nibble) and ``2j + 1``
    (high nibble) of row ``o``; a code is ``sign << 3 | magnitude index`` into
    0, 0.5, 1, 1.5, 2, 3, 4, 6. ``block_scale[o, b]`` scales elements
    ``16b .. 16b + 15`` of row ``o``. A stack of routed experts carries a leading expert
    axis on every array (one tensor scale per expert); ``shape`` is one expert's.
    """

    packed: jax.Array  # uint8 [..., out, in // 2]
    block_scale: jax.Array  # float8_e4m3fn [..., out, in // 16]
    tensor_scale: jax.Array  # f32 [...]
    shape: tuple[int, int] = flax.struct.field(pytree_node=False)

    def dequantize(self) -> jax.Array:
        """The f32 weight it stands for (`dequantize`)."""
        return dequantize(self)


def _round_to_float_grid(x: jax.Array, mantissa_bits: int, min_exponent: int, max_value: float) -> jax.Array:
    """Round-to-nearest-even onto a small float format's grid, saturating at ``max_value``.

    Within the binade ``[2^e, 2^(e+1))`` the grid spacing is ``2^(e - mantissa_bits)``;
    below the smallest normal exponent the spacing stays at the subnormal quantum.
    Dividing by a power of two is exact, so ``jnp.round`` (half-to-even) on the scaled
    value rounds to the nearest grid point with ties to the even mantissa.
    """
    x = jnp.asarray(x, jnp.float32)
    _, exp = jnp.frexp(x)  # |x| = m * 2^exp with m in [0.5, 1)
    binade = jnp.maximum(exp - 1, min_exponent)
    quantum = jnp.ldexp(jnp.float32(1.0), binade - mantissa_bits)
    rounded = jnp.round(x / quantum) * quantum
    return jnp.clip(rounded, -max_value, max_value)


@jax.jit
def e4m3_round(x: jax.Array) -> jax.Array:
    """Nearest E4M3 (``float8_e4m3fn``) value as f32: 3 mantissa bits, min normal 2^-6, max 448."""
    return _round_to_float_grid(x, mantissa_bits=3, min_exponent=-6, max_value=E4M3_MAX)


@jax.jit
def e2m1_round(x: jax.Array) -> jax.Array:
    """Nearest E2M1 value as f32: grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and negatives)."""
    return _round_to_float_grid(x, mantissa_bits=1, min_exponent=0, max_value=E2M1_MAX)


def e2m1_encode(values: jax.Array) -> jax.Array:
    """4-bit codes (uint8, 0..15) of values already on the E2M1 grid; -0.0 keeps its sign bit."""
    magnitude_index = jnp.searchsorted(jnp.asarray(_E2M1_MAGNITUDES), jnp.abs(values))
    sign = jnp.signbit(values).astype(jnp.uint8)
    return (sign << 3) | magnitude_index.astype(jnp.uint8)


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """f32 values of 4-bit E2M1 codes.

    Integer arithmetic rather than a 16-entry table lookup: a gather does not fuse
    into the GEMM's operand on GPU, an elementwise chain does. With exponent field
    ``e`` and mantissa bit ``m``, the magnitude is ``((e > 0) * 2 + m) << max(e, 1)``
    quarters, which covers the subnormal ``e == 0`` as well.
    """
    codes = codes.astype(jnp.int32)
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    quarters = (jnp.where(exponent > 0, 2, 0) + mantissa) << jnp.maximum(exponent, 1)
    magnitude = quarters.astype(jnp.float32) * 0.25
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Packs 4-bit codes pairwise along the last axis: element ``2j`` low nibble, ``2j+1`` high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension {codes.shape}")
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of ``pack_nibbles``: uint8 codes with the last axis doubled."""
    low = packed & 0x0F
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@jax.jit
def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """A ``[out, in]`` weight in E4M3 with one scale per output row (its row maximum maps to 448)."""
    w = w.astype(jnp.float32)
    row_max = jnp.max(jnp.abs(w), axis=1)
    # An all-zero row has no range to map; scale 1 keeps the division finite and the
    # values (all zero) exact.
    row_scale = jnp.where(row_max > 0, row_max / E4M3_MAX, 1.0)
    values = e4m3_round(w / row_scale[:, None]).astype(jnp.float8_e4m3fn)
    return Fp8Weight(values=values, row_scale=row_scale)


@jax.jit
def quantize_nvfp4(w: jax.Array) -> Nvfp4Weight:
    """A ``[out, in]`` weight (``in`` a multiple of 16) in NVFP4: E2M1 values, E4M3 block scales, an f32 tensor scale."""
    out_features, in_features = w.shape
    w = w.astype(jnp.float32)
    blocks = w.reshape(out_features, in_features // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = jnp.max(jnp.abs(w))
    # Chosen so the largest block's scale lands on E4M3's maximum: the per-block scales
    # then use the whole E4M3 range below it.
    tensor_scale = jnp.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), 1.0)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    block_scale = e4m3_round(block_amax / E2M1_MAX / tensor_scale)
    step = block_scale * tensor_scale
    # A block whose scale underflows E4M3 is below the grid entirely: it encodes as zeros.
    scaled = jnp.where(step[..., None] > 0, blocks / jnp.where(step > 0, step, 1.0)[..., None], 0.0)
    codes = e2m1_encode(e2m1_round(scaled)).reshape(out_features, in_features)
    return Nvfp4Weight(
        packed=pack_nibbles(codes),
        block_scale=block_scale.astype(jnp.float8_e4m3fn),
        tensor_scale=tensor_scale.astype(jnp.float32),
        shape=(out_features, in_features),
    )


def _nvfp4_block_scaled_values(weight: Nvfp4Weight) -> jax.Array:
    """E2M1 values times their block scale, f32 ``[..., out, in]``, without the tensor scale.

    Each product has at most 2 + 4 significant bits, so it is exact in bf16 as well:
    the GEMM can run at the activation dtype with the tensor scale applied afterwards.
    """
    values = e2m1_decode(unpack_nibbles(weight.packed))
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    scaled = blocks * weight.block_scale.astype(jnp.float32)[..., None]
    return scaled.reshape(values.shape)


@jax.jit
def dequantize(weight) -> jax.Array:
    """f32 ``[..., out, in]`` array the quantized weight (one, or a stack of experts) stands for."""
    if isinstance(weight, Fp8Weight):
        return weight.values.astype(jnp.float32) * weight.row_scale[..., None]
    if isinstance(weight, Nvfp4Weight):
        return _nvfp4_block_scaled_values(weight) * weight.tensor_scale[..., None, None]
    return jnp.asarray(weight).astype(jnp.float32)


def _matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` with f32 accumulation, contracting in place (no transposed copy)."""
    return jax.lax.dot_general(
        x,
        w.astype(x.dtype),
        dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


@jax.jit
def linear(x: jax.Array, weight) -> jax.Array:
    """``y = x @ W.T`` for x ``[..., in]`` at the weight's precision; output in ``x.dtype``.

    Scales that are constant along the contraction (fp8 row scales, the nvfp4 tensor
    scale) are applied to the f32 accumulator, so the GEMM itself sees exactly
    representable grid values in the activation dtype.
    """
    if isinstance(weight, Fp8Weight):
        y = _matmul_t(x, weight.values) * weight.row_scale
    elif isinstance(weight, Nvfp4Weight):
        y = _matmul_t(x, _nvfp4_block_scaled_values(weight)) * weight.tensor_scale
    else:
        y = _matmul_t(x, weight)
    return y.astype(x.dtype)
