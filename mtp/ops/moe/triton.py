"""The MoE FFN of a decode or verify step: two weight-streaming Triton kernels that route, the shared expert riding along.

A step of 1-16 tokens routes each to ``k`` experts (``P = N k`` pairs: 8 at one token of
Qwen3.5-35B-A3B, 10 of Qwen3-Next-80B-A3B), so the layer is a stream of the selected experts'
weights with a few rows beside them. XLA runs it as ten kernels a layer (softmax, top-k and the
weights after the router; the gathered gate/up product, the SiLU product, the down product; the
shared expert's gate, sigmoid and GEMMs; the combine), each a launch and a gap. Here they are two,
the shared expert one more pair of each token:

1. ``gate_up`` (grid: ``P + N`` pairs x ``I / block_i``): a program finds its pair's expert, from
   the routing it is given (`routed_experts_stream`) or from the router's bf16 logits (`moe_stream`:
   the pair's expert by as many integer maxes over packed (logit, id) keys as its rank, in every
   program, since a routing kernel of its own would be a launch), streams the expert's ``gate``
   and ``up`` rows ``[o0, o0 + block_i)`` in place in chunks of ``chunk`` columns, multiplies them by the token's row and sums along the chunk
   in f32 (a multiply and a reduction: a dot would pad the one row to 16), and writes
   ``h = r(silu(r(g)) * r(u))`` (``r``: a rounding to bf16, the reference's) as bf16 ``[P + N, I]``;
   routing, the pair's first program also writes the pair's expert id and weight.
2. ``down`` (grid: ``P + N`` pairs x ``H / block_h``): the same stream over ``down``'s rows
   ``[o0, o0 + block_h)`` against the pair's ``h``, written as the expert's bf16 output ``[P + N, H]``.

XLA then takes the combine: each token's ``k`` outputs weighted by the routing and summed in f32,
plus the shared expert's output times its gate, in the reference's order, fused with the residual
add after it. Each output element's sum runs over the contraction in the same chunks whatever the
token count, so a verify's token computes what a decode step's would. On one H100 (2026-12-06,
results/real_shape/moe_stream_h100_2026-12-06/) the layer alone took 24.4 against XLA's 29.6 µs
(bf16) and 17.7 against 27.4 µs (FP8) at one token; in the models, the 35B decode step ran 1.12x and
the 80B FP8 step 1.34x faster. The kernels are Triton-lowered because the work is multiply-and-sum
on a few rows (no matmul) and because a Pallas Triton call sits inside XLA's CUDA graphs, where a
Mosaic GPU call does not (JAX 0.11.2).

Block-scaled FP8 weights (`mtp.ops.fp8.BlockFp8Weight`, 128 x 128 blocks) stream their E4M3 values:
a program's rows lie in one row of scale blocks, so the token's chunk is multiplied by the chunk's
scales (one per 128 columns) first and the product needs no per-element scale; the values convert
to f32 exactly. bf16 and FP8 weights mix freely. A shared expert of another width than the routed
ones (``Is != I``) takes its own rows of ``h``; the grid spans the wider.

The grid fills the chip by its rows: at one token of the 35B, ``9 x 512 / 8 = 576`` gate/up
programs and ``9 x 2048 / 16 = 1152`` down programs. `StreamConfig` holds the tiling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops import weight_stream as ws
from mtp.ops.lowering import triton_compiler_params
from mtp.ops.moe.reference import RouterLogits, SharedExpert

MAX_TOKENS = 16  # the rows of a decode or verify step; more go to the grouped GEMMs
GATE_UP_KERNEL = "moe_stream_gate_up"  # the gate/up kernel's name (a profile's); routing in it, its ids are output 1


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """The kernels' tiling: static, so one config is one compiled pair of kernels.

    ``block_i`` / ``block_h``: output rows of a gate/up and of a down program (powers of two; with
    FP8 weights at most 128, one row of scale blocks); ``chunk``: contraction columns per loop step
    (a power of two; the largest power of two dividing the contraction and at most ``chunk`` is
    used); ``num_warps`` / ``num_stages``: Triton's, for both kernels.
    """

    block_i: int = 8
    block_h: int = 16
    chunk: int = 512
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        ws.check_tiling(self, ("block_i", "block_h"))
        ws.check_tiling(self, ("chunk",), ws.MIN_CHUNK, counts=())


class RouterSpec(NamedTuple):
    """What the gate/up kernel needs to route by itself: `RouterLogits`' static fields."""

    experts: int
    k: int
    normalize: bool


def _chunk_of(n: int, cfg: StreamConfig) -> int:
    return ws.chunk_of(n, cfg.chunk)


def _plain(w) -> bool:
    """An array (or its abstract value), not a quantized weight with a ``dequantize``."""
    return hasattr(w, "dtype") and not hasattr(w, "dequantize")


def unsupported(x, gate, up, down, shared: SharedExpert | None = None, router: RouterLogits | None = None,
                config: StreamConfig | None = None) -> str | None:
    """Why the kernels cannot take these inputs (the reference then runs), or None; ``router``: the
    logits the gate/up kernel would route by (`moe_stream`)."""
    cfg = config or StreamConfig()
    if router is not None:
        e = router.experts
        if e & (e - 1) or not 1 <= router.k <= e:
            return f"{e} experts, top-{router.k}: the kernel routes over a power-of-two count of experts"
        if router.rows.ndim != 2 or router.rows.shape[0] < x.shape[0] or router.rows.shape[1] < e:
            return f"router rows {tuple(router.rows.shape)} do not hold {e} logits for each of {x.shape[0]} tokens"
        if router.rows.dtype != jnp.bfloat16:
            return f"router rows are {router.rows.dtype}; the kernel orders bfloat16 logits"
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x is {x.dtype} {tuple(x.shape)}; the kernels take bfloat16 [N, H]"
    if x.shape[0] > MAX_TOKENS:
        return f"{x.shape[0]} tokens: the kernels stream the experts for at most {MAX_TOKENS}"
    weights = [(gate, cfg.block_i), (up, cfg.block_i), (down, cfg.block_h)]
    if shared is not None:
        weights += [(shared.gate, cfg.block_i), (shared.up, cfg.block_i), (shared.down, cfg.block_h)]
    for w, rows in weights:
        if ws.is_fp8(w):
            if why := ws.fp8_unsupported(w, rows, "an FP8 expert weight"):
                return why
        elif not _plain(w) or jnp.dtype(w.dtype) != jnp.bfloat16:
            return f"a weight of type {type(w).__name__}; the kernels take bfloat16 arrays or BlockFp8Weight"
    e, i, h = gate.shape
    si = i if shared is None else shared.gate.shape[0]
    for name, n, block in (("I", i, cfg.block_i), ("the shared expert's I", si, cfg.block_i), ("H", h, cfg.block_h)):
        if n % block:
            return f"{name} = {n} is not a multiple of the block of {block} rows"
    for name, n in (("H", h), ("I", i), ("the shared expert's I", si)):
        if _chunk_of(n, cfg) < ws.MIN_CHUNK:
            return f"{name} = {n} has no power-of-two chunk of {ws.MIN_CHUNK} columns or more"
    return None


# ------------------------------------------------------------------ the kernels


def _bf16(a):
    return a.astype(jnp.bfloat16).astype(jnp.float32)


def _split(refs, counts):
    out, at = [], 0
    for n in counts:
        out.append(tuple(refs[at:at + n]))
        at += n
    return out


def _silu_product(g, u):
    g, u = _bf16(g), _bf16(u)
    return _bf16(g * jax.nn.sigmoid(g)) * u


_TAKEN = -(2 ** 31)  # an order key no logit has: a picked expert's key


def _order_keys(logits, ids):
    """int32 keys whose order is the logits' order, the lower id first among equal logits.

    A bf16 logit's f32 bits have 16 zero bits at the bottom; flipping the magnitude bits of a negative
    one makes the top 16 bits order as the value (``-0`` is made ``+0`` first: the two tie), and the
    bottom 16 bits hold ``65535 - id``. One integer max then finds the top logit and its id.
    """
    bits = jax.lax.bitcast_convert_type(jnp.where(logits == 0, 0.0, logits), jnp.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered & -65536) | (65535 - ids)


def _key_value(key):
    """The expert id and the (f32) logit an `_order_keys` key stands for."""
    top = key & -65536
    bits = (top ^ ((top >> 31) & 0x7FFFFFFF)) & -65536
    return 65535 - (key & 65535), jax.lax.bitcast_convert_type(bits, jnp.float32)


def _routed_pair(l_ref, t, slot, picks, *, router: RouterSpec):
    """Token ``t``'s ``slot``-th expert by its router logits (row ``t`` of ``l_ref``, bf16), and its weight.

    `reference.route`'s routing: the top ``k`` in order, picked one at a time (an integer max over
    `_order_keys`, a reduction a pick), their softmax weights renormalised over the ``k`` (or over
    every expert), rounded to bf16. Every program of the pair needs its expert, and its weight only
    the one that writes it: a program picks ``picks`` experts (``slot + 1`` for the expert, ``k`` for
    the weight as well, 0 for none), since the picks before its loads are the kernel's latency.
    """
    ids = jax.lax.broadcasted_iota(jnp.int32, (router.experts,), 0)
    logits = l_ref[t, pl.ds(0, router.experts)].astype(jnp.float32)

    def pick(j, carry):
        keys, expert, top, mass, total = carry
        best = jnp.max(keys)
        e, value = _key_value(best)
        top = jnp.where(j == 0, value, top)
        m = jnp.exp(value - top)
        at_slot = j == slot
        return (jnp.where(keys == best, _TAKEN, keys), jnp.where(at_slot, e, expert), top,
                jnp.where(at_slot, m, mass), total + m)

    zero = jnp.float32(0)
    _, expert, top, mass, total = jax.lax.fori_loop(0, picks, pick,
                                                    (_order_keys(logits, ids), jnp.int32(0), zero, zero, zero))
    if not router.normalize:
        total = jnp.sum(jnp.exp(logits - top))
    return expert, _bf16(mass / total)


def _gate_up_kernel(route_ref, x_ref, *refs, counts, routed_pairs, k, rows, hidden, chunk, inter, shared_inter,
                    router):
    """Pair ``program_id(0)``'s ``h`` rows ``[o0, o0 + rows)``. Pair ``p < routed_pairs`` is token
    ``p // k``'s ``p % k``-th expert: its id in ``route_ref`` (a ``[1, 1]`` block), or with ``router``
    found from the router logits ``route_ref`` and written, with its weight, by the pair's first
    program. Pair ``routed_pairs + n`` is token ``n``'s shared expert. A program past its expert's
    ``inter`` (or ``shared_inter``) rows writes nothing: those columns of ``h`` are never read."""
    if router is None:
        *weights, h_ref = refs
    else:
        *weights, h_ref, id_ref, w_ref = refs
    gate, up, *shared = _split(weights, counts)
    p, j = pl.program_id(0), pl.program_id(1)
    o0, is_routed = j * rows, p < routed_pairs
    t = jnp.where(is_routed, p // k, p - routed_pairs)
    if router is None:
        e = route_ref[0, 0]
    else:
        writes = jnp.logical_and(is_routed, j == 0)
        picks = jnp.where(writes, k, jnp.where(is_routed, p % k + 1, 0))
        e, weight = _routed_pair(route_ref, t, p % k, picks, router=router)

        @pl.when(writes)
        def _():
            id_ref[...] = jnp.full((1, 1), e, jnp.int32)
            w_ref[...] = jnp.full((1, 1), weight, jnp.float32)

    run = functools.partial(ws.stream, rows=rows, contraction=hidden, chunk=chunk, out_ref=h_ref,
                            epilogue=_silu_product)
    pl.when(jnp.logical_and(is_routed, o0 < inter))(lambda: run((gate, up), e, t, x_ref, o0))
    if shared:
        pl.when(jnp.logical_and(p >= routed_pairs, o0 < shared_inter))(
            lambda: run((shared[0], shared[1]), 0, t, x_ref, o0))


def _down_kernel(e_ref, h_ref, *refs, counts, routed_pairs, rows, inter, shared_inter, chunks):
    """Pair ``program_id(0)``'s output rows ``[o0, o0 + rows)`` (bf16, the expert's rounding); the
    contraction runs over ``inter`` (``shared_inter`` for a shared pair) in ``chunks``' steps."""
    *weights, y_ref = refs
    down, *shared = _split(weights, counts)
    e, p, o0 = e_ref[0, 0], pl.program_id(0), pl.program_id(1) * rows
    run = functools.partial(ws.stream, rows=rows, out_ref=y_ref, epilogue=lambda y: y)
    if not shared:
        run((down,), e, p, h_ref, o0, contraction=inter, chunk=chunks[0])
        return
    is_shared = p >= routed_pairs
    pl.when(jnp.logical_not(is_shared))(lambda: run((down,), e, p, h_ref, o0, contraction=inter, chunk=chunks[0]))
    pl.when(is_shared)(lambda: run((shared[0],), 0, p, h_ref, o0, contraction=shared_inter, chunk=chunks[1]))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _experts(x, routing, gate, up, down, shared, *, config, interpret):
    """``routing``: ``(ids [N, k], weights [N, k])``, or a `RouterLogits` the gate/up kernel routes by."""
    n, h = x.shape
    e, i, _ = gate.shape
    fused = isinstance(routing, RouterLogits)
    k = routing.k if fused else routing[0].shape[1]
    si = i if shared is None else shared.gate.shape[0]
    routed = n * k
    pairs = routed + (0 if shared is None else n)
    # Pair p's [1, 1] block of the routed pairs' ids (and weights); a shared pair sees the last routed pair's.
    pair_spec = pl.BlockSpec((1, 1), lambda p, j: (0, jnp.minimum(p, routed - 1)))
    whole = pl.no_block_spec
    params = triton_compiler_params(interpret, num_warps=config.num_warps, num_stages=config.num_stages)

    up_ops = [ws.operands(gate), ws.operands(up)]
    down_ops = [ws.operands(down)]
    if shared is not None:
        up_ops += [ws.operands(ws.as_stack(shared.gate)), ws.operands(ws.as_stack(shared.up))]
        down_ops += [ws.operands(ws.as_stack(shared.down))]
    up_args, down_args = [a for o in up_ops for a in o], [a for o in down_ops for a in o]
    name = "fp8" if ws.is_fp8(gate) else "bf16"
    widest = max(i, si)
    h_shape = jax.ShapeDtypeStruct((pairs, widest), jnp.bfloat16)
    h_spec = pl.BlockSpec((1, config.block_i), lambda p, j: (p, j))
    if fused:
        route_in, route_spec = routing.rows, whole
        out_shape = (h_shape, jax.ShapeDtypeStruct((1, routed), jnp.int32),
                     jax.ShapeDtypeStruct((1, routed), jnp.float32))
        out_specs = (h_spec, pair_spec, pair_spec)
    else:
        route_in, route_spec = routing[0].reshape(1, routed).astype(jnp.int32), pair_spec
        out_shape, out_specs = h_shape, h_spec
    outs = pl.pallas_call(
        functools.partial(_gate_up_kernel, counts=[len(o) for o in up_ops], routed_pairs=routed, k=k,
                          rows=config.block_i, hidden=h, chunk=_chunk_of(h, config), inter=i, shared_inter=si,
                          router=RouterSpec(e, k, routing.normalize) if fused else None),
        grid=(pairs, widest // config.block_i),
        in_specs=[route_spec, whole] + [whole] * len(up_args),
        out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name=f"{GATE_UP_KERNEL}_{name}_{i}x{h}", **params,
    )(route_in, x, *up_args)
    h_act, ids, weights = outs if fused else (outs, route_in, routing[1])
    y = pl.pallas_call(
        functools.partial(_down_kernel, counts=[len(o) for o in down_ops], routed_pairs=routed,
                          rows=config.block_h, inter=i, shared_inter=si,
                          chunks=(_chunk_of(i, config), _chunk_of(si, config))),
        grid=(pairs, h // config.block_h),
        in_specs=[pair_spec, whole] + [whole] * len(down_args),
        out_specs=pl.BlockSpec((1, config.block_h), lambda p, j: (p, j)),
        out_shape=jax.ShapeDtypeStruct((pairs, h), jnp.bfloat16),
        interpret=interpret, name=f"moe_stream_down_{name}_{h}x{i}", **params,
    )(ids, h_act, *down_args)
    y = y.astype(jnp.float32)
    out = jnp.einsum("nk,nkh->nh", weights.reshape(n, k).astype(jnp.float32), y[:routed].reshape(n, k, h))
    if shared is not None:
        out = out + shared.weight.astype(jnp.float32)[:, None] * y[routed:]
    return out


def _checked(config: StreamConfig | None, x, gate, up, down, shared, router=None) -> StreamConfig:
    """The config to run (the default where None), checked, for inputs that pass `unsupported`."""
    cfg = config or StreamConfig()
    cfg.check()
    why = unsupported(x, gate, up, down, shared, router, cfg)
    if why:
        raise ValueError(f"moe stream kernels: {why}")
    return cfg


def routed_experts_stream(x, expert_ids, expert_weights, gate, up, down, shared: SharedExpert | None = None, *,
                          impl: str = "pallas", config: StreamConfig | None = None) -> jax.Array:
    """f32 ``[N, H]``: the routed experts' weighted sum (`reference`), plus ``shared``'s gated output.

    ``impl``: ``"pallas"`` (compiled for a GPU) or ``"interpret"`` (Pallas' interpreter, any
    backend). Inputs must pass `unsupported`.
    """
    cfg = _checked(config, x, gate, up, down, shared)
    return _experts(x, (expert_ids, expert_weights), gate, up, down, shared, config=cfg,
                    interpret=impl == "interpret")


def moe_stream(x, router: RouterLogits, gate, up, down, shared: SharedExpert | None = None, *,
               impl: str = "pallas", config: StreamConfig | None = None) -> jax.Array:
    """`routed_experts_stream` with the routing in the gate/up kernel: each program finds its pair's
    expert and weight from the router logits (`reference.route`'s rule), so that a decode step's
    softmax, top-k and weight kernels are not launched."""
    cfg = _checked(config, x, gate, up, down, shared, router)
    return _experts(x, router, gate, up, down, shared, config=cfg, interpret=impl == "interpret")
