"""A weight-streaming w8a16 kernel for few rows: `w8a16`, `reference.w8a16`'s signature.

A decode or verify step multiplies 1-16 rows by each weight, so its GEMMs are bound by the bytes
of the weight. XLA's form of the block-scaled product (the dequantize fused into the dot) ran
2.2-3.4x slower with FP8 weights than XLA's dot with bf16 ones on an H200 at Qwen3-Next-80B's
large projections (results/kernels/fp8_few_rows_h200/results.md): it does not stream the 8-bit
values at the copy rate. Here each program reads one ``block_out x block_in`` tile of E4M3
values at a time, converts it to bf16 in registers (bf16 holds every E4M3 value exactly), takes
Triton's dot with the rows (padded to 16, its smallest M), scales the tile's partial product by
its 128 x 128 block's one ``scale_inv`` and accumulates in f32; the weight is read once, 8 bits
per element, and nothing is written but the ``[splits, rows, out]`` f32 partial sums.

The grid is ``(output blocks, splits)``: ``splits`` divides the input dimension into contiguous
chunks of whole tiles so that enough programs stream at once (a ``[2048, 4096]`` weight has only
64 output blocks of 32 rows; 4 splits make 256 programs for the H200's 132 SMs), and XLA sums
the partials. Edge tiles (``out`` or ``in`` not multiples of the tile) are masked loads. Pallas'
Triton lowering converts ``float8_e4m3fn`` on compute capability 8.9 and up (an H100 / H200 is
9.0). `Fp8GemvConfig` holds the tiling; `default_config` picks it from the shape, and a caller
tuning on a GPU passes its own; `pays` is the measured rule of where the kernel beats XLA.

`gemv` is the one-row form (a decode step's projection): no dot, so the row is not padded to 16,
and no splits, so no partial sums: each program streams ``block_out`` rows of the weight in place
and multiplies-and-sums them against the row (`mtp.ops.weight_stream`, as the MoE decode kernels
stream their experts), writing its outputs in the caller's dtype. Three launches a projection (the
pad, the kernel, XLA's sum of the splits) become one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mtp.ops import weight_stream as ws
from mtp.ops.fp8.reference import BlockFp8Weight
from mtp.ops.lowering import num_sms, triton_compiler_params

MAX_ROWS = 16  # the rows the kernel is for: a decode or verify step
DOT_ROWS = 16  # Triton's smallest dot M: the rows are padded to it
SCALE_BLOCK = 128  # the only scale block the kernels take (Qwen's checkpoints)


@dataclasses.dataclass(frozen=True)
class Fp8GemvConfig:
    """The kernels' tiling: static, so one config is one compiled kernel.

    ``block_out`` / ``block_in``: a program's tile of the weight, each a power of two that
    divides 128 (a tile then lies in one scale block); ``splits``: the chunks the input dimension
    is divided into (programs per output block; XLA sums their partials); ``num_warps`` /
    ``num_stages``: Triton's warps per program and software-pipeline depth of the tile loop.
    """

    block_out: int = 128
    block_in: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        ws.check_tiling(self, ("block_out", "block_in"), 16, SCALE_BLOCK, counts=("splits", "num_warps", "num_stages"))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(out: int, inp: int) -> Fp8GemvConfig:
    """The tiling of an ``[out, in]`` weight.

    Tiles of 32 x 128 (a quarter of a scale block), 4 warps, a 4-deep pipeline, then the fewest
    power-of-two splits that give about two programs per SM (from 7/8 of the SMs on: 230 programs
    on the H200's 132), no more splits than input tiles. A sweep of 48-56 tilings per shape at
    Qwen3-Next-80B's projections on an H200 (results/kernels/fp8_tilings_h200_2026-12-03, 1 and 4
    rows) put this within 3% of the fastest at each, and 11-20% under the 128 x 128 tiles sized to
    one program per SM: 14.1 against 17.7 µs at ``[12288, 2048]``, 11.5 against 13.4 at
    ``[8192, 2048]``, 8.3 against 9.2 at ``[2048, 4096]`` (one row).
    """
    block_out, tiles_in = 32, _cdiv(inp, 128)
    programs = 2 * (num_sms() * 7 // 8)
    splits = 1
    while _cdiv(out, block_out) * splits < programs and splits * 2 <= tiles_in:
        splits *= 2
    return Fp8GemvConfig(block_out=block_out, block_in=128, splits=splits, num_warps=4, num_stages=4)


def pays(rows: int, out: int) -> bool:
    """Whether the kernel beats XLA's fused dequantize for ``rows`` rows of a weight of ``out`` outputs.

    Measured on an H200 (CUPTI, L2 cold; results/kernels/fp8_few_rows_h200/results.md, 2026-12-02):
    at 4 rows the kernel took 0.39-0.92x XLA's time at every projection of Qwen3-Next-80B; at one
    row XLA's GEMV fusion read the small weights (``out <= 4096``) faster (5.3 against 9.4 µs at
    ``[2048, 4096]``), the kernel the large ones (17.6 against 53.2 µs at ``[12288, 2048]``).
    Row counts between were not timed apart; they take the 4-row rule.
    """
    return rows > 1 or out > 4096


def unsupported(x: jax.Array, w: BlockFp8Weight) -> str | None:
    """Why the dense kernel cannot take ``x @ w.T``, or None: the caller then runs the reference."""
    if not isinstance(w, BlockFp8Weight):
        return f"the weight is a {type(w).__name__}, not a BlockFp8Weight"
    if w.ndim != 2 or x.ndim != 2:
        return f"the kernel takes x [rows, in] and a 2-D weight, got x {tuple(x.shape)} and w {w.shape}"
    if x.shape[0] > MAX_ROWS:
        return f"{x.shape[0]} rows: the kernel streams the weight for at most {MAX_ROWS}"
    if x.dtype != jnp.bfloat16:
        return f"x is {x.dtype}; the kernel takes bfloat16 activations"
    if jnp.dtype(w.values.dtype) != jnp.float8_e4m3fn:
        return f"the values are {w.values.dtype}, not float8_e4m3fn"
    if tuple(w.block) != (SCALE_BLOCK, SCALE_BLOCK):
        return f"scale block {tuple(w.block)}: the kernel takes ({SCALE_BLOCK}, {SCALE_BLOCK}) blocks"
    if x.shape[-1] != w.shape[-1]:
        return f"x's {x.shape[-1]} columns are not the weight's input dimension {w.shape[-1]}"
    return None


def _tile_partial(x, q_ref, s_ref, o0, k0, *, out: int, inp: int, cfg: Fp8GemvConfig, even: bool):
    """``x [R, block_in]`` times one scaled weight tile at ``(o0, k0)`` of ``q_ref [out, in]``: f32 ``[R, block_out]``.

    Unless the tiles cover the weight exactly (``even``: every load then takes whole, unmasked
    vectors), the tile's masked rows and columns load as zeros, so an edge tile (or a split's tile
    past the end of ``in``) adds nothing; its scale index is clamped to a real block for the same reason.
    """
    bo, bi = cfg.block_out, cfg.block_in
    if even:
        q = plgpu.load(q_ref.at[pl.ds(o0, bo), pl.ds(k0, bi)])
    else:
        orows = o0 + jax.lax.broadcasted_iota(jnp.int32, (bo, bi), 0)
        cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (bo, bi), 1)
        q = plgpu.load(q_ref.at[pl.ds(o0, bo), pl.ds(k0, bi)], mask=(orows < out) & (cols < inp), other=0.0)
    sb = jnp.minimum(k0 // SCALE_BLOCK, _cdiv(inp, SCALE_BLOCK) - 1)
    scale = plgpu.load(s_ref.at[pl.ds(o0 // SCALE_BLOCK, 1), pl.ds(sb, 1)])  # [1, 1]
    part = jax.lax.dot_general(x.astype(jnp.bfloat16), q.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return part * scale


def _load_rows(x_ref, rows, k0, *, inp: int, bi: int, even: bool):
    """Columns ``[k0, k0 + bi)`` of the rows ``rows`` (a ``pl.ds``) of ``x_ref [R, in]``, zeros past ``in``."""
    if even:
        return plgpu.load(x_ref.at[rows, pl.ds(k0, bi)])
    cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (rows.size, bi), 1)
    return plgpu.load(x_ref.at[rows, pl.ds(k0, bi)], mask=cols < inp, other=0.0)


def _gemv_kernel(x_ref, q_ref, s_ref, o_ref, *, out, inp, cfg, tiles):
    """Output block ``program_id(0)``'s sum over the ``tiles`` input tiles of chunk ``program_id(1)``."""
    o0, split = pl.program_id(0) * cfg.block_out, pl.program_id(1)
    rows = pl.ds(0, x_ref.shape[0])
    even = out % cfg.block_out == 0 and inp == tiles * cfg.splits * cfg.block_in

    def body(t, acc):
        k0 = (split * tiles + t) * cfg.block_in
        x = _load_rows(x_ref, rows, k0, inp=inp, bi=cfg.block_in, even=even)
        return acc + _tile_partial(x, q_ref, s_ref, o0, k0, out=out, inp=inp, cfg=cfg, even=even)
    o_ref[...] = jax.lax.fori_loop(0, tiles, body, jnp.zeros((rows.size, cfg.block_out), jnp.float32))


def _plan(cfg: Fp8GemvConfig, out: int, inp: int) -> tuple[int, int]:
    """(output blocks, input tiles per split) of ``cfg`` for an ``[out, in]`` weight."""
    cfg.check()
    return _cdiv(out, cfg.block_out), _cdiv(_cdiv(inp, cfg.block_in), cfg.splits)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _w8a16(x, w, *, config, interpret):
    (out, inp), rows = w.shape, x.shape[0]
    blocks, tiles = _plan(config, out, inp)
    padded = max(DOT_ROWS, rows)
    xp = jnp.pad(x, ((0, padded - rows), (0, 0)))
    parts = pl.pallas_call(
        functools.partial(_gemv_kernel, out=out, inp=inp, cfg=config, tiles=tiles),
        grid=(blocks, config.splits),
        out_specs=pl.BlockSpec((None, padded, config.block_out), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((config.splits, padded, blocks * config.block_out), jnp.float32),
        interpret=interpret,
        name=f"fp8_w8a16_{out}x{inp}",  # the kernel's name in a profile (CUPTI): its weight's shape
        **triton_compiler_params(interpret, num_warps=config.num_warps, num_stages=config.num_stages),
    )(xp, w.values, w.scale_inv.astype(jnp.float32))
    return jnp.sum(parts, axis=0)[:rows, :out]


def w8a16(x: jax.Array, w: BlockFp8Weight, *, config: Fp8GemvConfig | None = None,
          interpret: bool = False) -> jax.Array:
    """``x [R, in] @ dequantize(w).T``, f32 ``[R, out]``, streaming ``w``'s E4M3 values (``R <= 16``).

    The products are exact f32 ones of the E4M3 values, each 128 x 128 block's partial scaled
    once: the result is ``x @ dequantize(w, f32).T`` to f32 rounding (the reference rounds the
    dequantized weight to ``x``'s dtype first). Inputs must pass `unsupported`.
    """
    why = unsupported(x, w)
    if why:
        raise ValueError(f"fp8 w8a16 kernel: {why}")
    return _w8a16(x, w, config=config or default_config(*w.shape), interpret=interpret)


# ------------------------------------------------------------------ one row: the weight streamed


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """`gemv`'s tiling: ``block_out`` weight rows a program (a power of two dividing 128),
    ``chunk`` contraction columns a loop step (the largest power of two dividing ``in`` and at most
    this), Triton's ``num_warps`` / ``num_stages``."""

    block_out: int = 8
    chunk: int = 512
    num_warps: int = 4
    num_stages: int = 3


def gemv_pays(out: int) -> bool:
    """Whether `gemv` beats the other paths for one row of a weight of ``out`` outputs.

    Measured in Qwen3-Next-80B-A3B's FP8 decode step on an H100 (2026-12-06,
    results/real_shape/moe_stream_h100_2026-12-06/, `fp8_gemv/`): 10.8 µs a call at ``[12288, 2048]``
    against the dot kernel's 13.2 plus its row pad (1.2) and split sum (1.3), 8.2 against 10.7 plus
    the same at ``[8192, 2048]``; but 8.6 against XLA's GEMV fusion's 5.5 at ``[2048, 4096]``, whose
    256 programs each loop over 4096 columns. The same line as `pays`: more than 4096 outputs.
    """
    return out > 4096


def gemv_unsupported(x: jax.Array, w: BlockFp8Weight, config: RowConfig | None = None) -> str | None:
    """Why `gemv` cannot take ``x @ w.T``, or None: the caller then runs another path."""
    cfg = config or RowConfig()
    if not isinstance(w, BlockFp8Weight) or w.ndim != 2:
        return f"the weight is a {type(w).__name__} of {len(w.shape)} dims, not a 2-D BlockFp8Weight"
    if x.ndim != 2 or x.shape[0] != 1 or x.shape[1] != w.shape[1]:
        return f"the row kernel takes x [1, {w.shape[1]}], got {tuple(x.shape)}"
    if x.dtype != jnp.bfloat16:
        return f"x is {x.dtype}; the kernel takes bfloat16 activations"
    if why := ws.fp8_unsupported(w, cfg.block_out):
        return why
    if ws.chunk_of(w.shape[1], cfg.chunk) < ws.MIN_CHUNK:
        return f"in = {w.shape[1]} has no power-of-two chunk of {ws.MIN_CHUNK} columns or more"
    return None


def _gemv_row_kernel(x_ref, q_ref, s_ref, o_ref, *, rows, contraction, chunk):
    o0 = pl.program_id(0) * rows
    ws.stream(((q_ref, s_ref),), 0, 0, x_ref, o0, rows=rows, contraction=contraction, chunk=chunk, out_ref=o_ref,
              epilogue=lambda y: y)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def _gemv(x, w, *, config, out_dtype, interpret):
    out, inp = w.shape
    return pl.pallas_call(
        functools.partial(_gemv_row_kernel, rows=config.block_out, contraction=inp, chunk=ws.chunk_of(inp, config.chunk)),
        grid=(out // config.block_out,),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.BlockSpec((1, config.block_out), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, out), out_dtype),
        interpret=interpret,
        name=f"fp8_gemv_{out}x{inp}",  # the kernel's name in a profile (CUPTI): its weight's shape
        **triton_compiler_params(interpret, num_warps=config.num_warps, num_stages=config.num_stages),
    )(x, *ws.operands(ws.as_stack(w)))


def gemv(x: jax.Array, w: BlockFp8Weight, *, out_dtype=jnp.float32, config: RowConfig | None = None,
         interpret: bool = False) -> jax.Array:
    """``x [1, in] @ dequantize(w).T`` in ``out_dtype``, ``[1, out]``: the weight's E4M3 values streamed
    once, each 128-column chunk of the row scaled by its block's scale, the sums in f32. Inputs must
    pass `gemv_unsupported`."""
    cfg = config or RowConfig()
    if why := gemv_unsupported(x, w, cfg):
        raise ValueError(f"fp8 gemv kernel: {why}")
    return _gemv(x, w, config=cfg, out_dtype=jnp.dtype(out_dtype), interpret=interpret)
