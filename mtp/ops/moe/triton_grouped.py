"""The routed-expert FFN of a prefill chunk on block-scaled FP8 experts: grouped GEMMs in Triton.

The Mosaic GPU grouped GEMMs (`mosaic`) read 16-bit weights: wgmma takes both operands in one
type, and Qwen's experts are E4M3 values with one scale per 128 x 128 block. Here the same row
plan and combine (`mosaic.grouped_ffn`: the pairs sorted by expert into blocks of 64 rows) run two
Pallas Triton kernels that read the 8-bit values themselves, as vLLM's fused-MoE Triton kernel
does for its w8a16 path. A program owns one block's ``tile_n`` output columns of one expert and
walks the contraction in 128-column steps: it loads the block's rows ``[64, 128]`` and the
expert's E4M3 tile ``[tile_n, 128]``, converts the tile to bf16 (exact: bf16 holds every E4M3
value), takes Triton's dot with f32 accumulation and scales the step's product by the tile's one
block scale. The weight is read once per block, 8 bits an element, and no bf16 copy of it is
ever written (the alternative, a dequantized copy for `mosaic`, writes and reads one of every
expert). The products are exact f32 ones of the E4M3 values, so the result is the
dequantized weight's product to f32 rounding (the reference rounds the dequantized weight to
bf16 first).

`GroupedFp8Config` holds the tiling; the row plan's blocks are the grid's fastest axis (what
`mosaic` measured best: consecutive programs stream different experts). On one H100 (2026-12-06,
results/kernels/moe_fp8_grouped_h100_2026-12-06/, Qwen3-Next-80B-A3B's layer, CUPTI, L2 cold) it
took 627 / 1317 / 1421 us at 32 / 512 / 2048 tokens, 2.4-2.6x the FP8 experts' bytes floor: 2.5x
faster than the Mosaic kernels on a dequantized bf16 copy of the experts (2599 / 3402 / 3495 us,
the copy included) and about as fast as those kernels on bf16 experts (1339 us at 512 tokens, in
another call on another H100 that day). The default tiling (128-column tiles, 8 warps) was 2-5%
faster there than 64-column gate/up tiles at 4 warps, and 1.3-1.5x faster than 32 / 64. Below 256 pairs the reference's gather form is faster
(`api.FP8_GROUPED_MIN_PAIRS`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops import weight_stream as ws
from mtp.ops.lowering import triton_compiler_params
from mtp.ops.moe import mosaic
from mtp.ops.moe.reference import check_inputs

STEP = ws.SCALE_BLOCK  # contraction columns a loop step: one scale block


@dataclasses.dataclass(frozen=True)
class GroupedFp8Config:
    """The kernels' tiling: ``tile_i`` / ``tile_h`` output columns of a gate/up and of a down program
    (powers of two from 16 to 128, so that a tile lies in one row of scale blocks); Triton's
    ``num_warps`` and ``num_stages``."""

    tile_i: int = 128
    tile_h: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def check(self) -> None:
        ws.check_tiling(self, ("tile_i", "tile_h"), 16, ws.SCALE_BLOCK)


def unsupported(x, gate, up, down, config: GroupedFp8Config | None = None) -> str | None:
    """Why the kernels cannot take these (well-formed) inputs, or None."""
    cfg = config or GroupedFp8Config()
    if x.dtype != jnp.bfloat16:
        return f"x is {x.dtype}; the kernels take bfloat16 activations"
    for name, w, rows in (("gate", gate, cfg.tile_i), ("up", up, cfg.tile_i), ("down", down, cfg.tile_h)):
        if not ws.is_fp8(w):
            return f"{name} is a {type(w).__name__}; the kernels take block-scaled FP8 experts (BlockFp8Weight)"
        if why := ws.fp8_unsupported(w, rows, f"the experts' {name}"):
            return why
    return None


def _kernel(expert_ref, a_ref, *refs, count, experts, tile_n, steps, epilogue):
    """Block ``program_id(0)``'s output columns ``[n0, n0 + tile_n)`` for each of the ``count``
    weights (``(values, scales)`` ref pairs), through ``epilogue``. A block of the sentinel expert
    ``experts`` writes nothing: its rows are never read."""
    *weights, o_ref = refs
    pairs = [tuple(weights[2 * j:2 * j + 2]) for j in range(count)]
    e, n0 = expert_ref[0], pl.program_id(1) * tile_n

    @pl.when(e < experts)
    def _():
        def step(s, accs):
            k0 = pl.multiple_of(s * STEP, STEP)
            a = a_ref[:, pl.ds(k0, STEP)]
            out = []
            for acc, (v_ref, s_ref) in zip(accs, pairs):
                tile = v_ref[e, pl.ds(n0, tile_n), pl.ds(k0, STEP)].astype(jnp.bfloat16)
                part = jax.lax.dot_general(a, tile, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                out.append(acc + part * s_ref[e, n0 // STEP, s])
            return tuple(out)

        zeros = tuple(jnp.zeros((a_ref.shape[0], tile_n), jnp.float32) for _ in pairs)
        o_ref[...] = epilogue(*jax.lax.fori_loop(0, steps, step, zeros)).astype(o_ref.dtype)


def grouped_matmul(block_expert, a, weights, epilogue, *, tile_n, num_blocks, shared_rows, cfg, name,
                   tiling: GroupedFp8Config, interpret: bool):
    """`mosaic._grouped_matmul`'s contract for FP8 ``weights`` (each ``[E, W, K]``), ``shared_rows`` False."""
    if shared_rows:
        raise ValueError("the FP8 grouped GEMMs take the sorted 'blocks' layout")
    rows, kdim = cfg.block_rows, a.shape[1]
    e, n_out, _ = weights[0].shape
    args = [leaf for w in weights for leaf in ws.operands(w)]
    return pl.pallas_call(
        functools.partial(_kernel, count=len(weights), experts=e, tile_n=tile_n, steps=kdim // STEP,
                          epilogue=epilogue),
        grid=(num_blocks, n_out // tile_n),
        in_specs=[pl.BlockSpec((1,), lambda b, c: (b,)), pl.BlockSpec((rows, kdim), lambda b, c: (b, 0))]
        + [pl.no_block_spec] * len(args),
        out_specs=pl.BlockSpec((rows, tile_n), lambda b, c: (b, c)),
        out_shape=jax.ShapeDtypeStruct((num_blocks * rows, n_out), a.dtype),
        interpret=interpret, name=f"{name}_fp8",
        **triton_compiler_params(interpret, num_warps=tiling.num_warps, num_stages=tiling.num_stages),
    )(block_expert, a, *args)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _routed_experts(x, expert_ids, expert_weights, gate, up, down, *, config, interpret):
    plan = mosaic.GroupedGemmConfig(layout="blocks", tile_i=config.tile_i, tile_h=config.tile_h)
    matmul = functools.partial(grouped_matmul, tiling=config, interpret=interpret)
    return mosaic.grouped_ffn(matmul, x, expert_ids, expert_weights, gate, up, down, config=plan)


def routed_experts_fp8(x, expert_ids, expert_weights, gate, up, down, *, impl="pallas",
                       config: GroupedFp8Config | None = None):
    """The routed experts' weighted sum, f32 ``[N, H]``, for block-scaled FP8 experts.

    The reference's arguments (`reference.routed_experts`), the weights `BlockFp8Weight` stacks.
    ``impl``: ``"pallas"`` (a GPU) or ``"interpret"`` (Pallas' interpreter, any backend). Raises
    ValueError for inputs the kernels cannot take (`unsupported`).
    """
    check_inputs(x, expert_ids, expert_weights, gate, up, down)
    if impl not in ("pallas", "interpret"):
        raise ValueError(f"impl={impl!r}: the kernel path runs 'pallas' or 'interpret'")
    cfg = config or GroupedFp8Config()
    cfg.check()
    if why := unsupported(x, gate, up, down, cfg):
        raise ValueError(f"FP8 grouped GEMMs: {why}")
    return _routed_experts(x, expert_ids, expert_weights, gate, up, down, config=cfg, interpret=impl == "interpret")
