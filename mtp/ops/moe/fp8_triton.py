"""Block-scaled FP8 routed experts at few tokens: two weight-streaming Triton kernels.

A decode or verify step routes 1-16 tokens to ``k`` experts each (``P = N k`` pairs: 10 at one
token of Qwen3-Next-80B-A3B, 40 at four). The op is then a stream of the selected experts' 8-bit
weights (3.1 MB an expert there). The reference's gather form (`reference.routed_experts_gather`)
gathers the pairs' FP8 weights into a new buffer and dequantizes them into XLA's batched dot;
on an H200 it took 20.6 µs at one token, 2.7x its 7.6 µs floor, and 64.2 µs at four
(results/kernels/fp8_few_rows_h200/results.md, 2026-12-02). Here nothing is gathered: each program
reads its pair's expert id and streams that expert's tiles in place, as `mtp.ops.fp8.triton`'s
dense kernel streams one weight.

1. ``gate_up`` (grid: pairs x ``I / block_i``): a program streams its expert's ``gate`` and ``up``
   rows ``[o0, o0 + block_i)`` in ``128``-column tiles, E4M3 converted to bf16 in registers (exact),
   Triton's dot with all the token rows (padded to 16, its smallest M; the pair's own row is picked
   after), each tile's partial scaled by its 128 x 128 block's ``scale_inv`` and summed in f32;
   its epilogue writes ``h = rnd(rnd(silu(rnd(g))) * rnd(u))`` (``rnd``: a rounding to bf16), the
   reference's roundings, as bf16 ``[P, I]``.
2. ``down`` (tokens x ``H / block_h``): a program takes its token's ``k`` pairs one after another,
   ``y = rnd(h_p @ down_e.T)`` the same way for its rows of ``H``, and sums them weighted by the
   routing weights in f32 (the combine), writing the op's f32 ``[N, H]`` itself.

One token's row is broadcast into the dot's 16 rows in registers; more tokens are padded to 16 by
XLA first. A shared expert of the routed experts' shape (Qwen3-Next's) can ride along as every
token's last pair, with its gate's ``sigmoid`` as the pair's weight (`routed_experts_fp8`'s
``shared``; `mtp.model.layers.moe` passes it): its three one-row GEMMs and the add then cost no
launches of their own.

`mtp.ops.moe.api` runs these kernels for op ``"moe_fp8"``, opt-in (`mtp.ops.dispatch.OPT_IN`) until
they are timed on a GPU: `experiments/profile_step.py` compares them in the 80B step and sweeps
`Fp8ExpertsConfig` alone.

Each selected expert's weights are read once per pair that selects it (a verify's tokens share few
experts: 38.9 distinct of 40 pairs at K = 4 on random weights), nothing is written but ``h`` (a
few KB) and the output. `Fp8ExpertsConfig` holds the tiling; `default_config` spreads the pairs'
tiles over about two programs per SM, as the dense kernel's does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.ops.fp8.reference import BlockFp8Weight
from mtp.ops.lowering import num_sms, triton_compiler_params

MAX_TOKENS = 16  # Triton's smallest dot M: every token row rides in one dot
SCALE_BLOCK = 128  # Qwen's checkpoints' only scale block
BLOCK_IN = 128  # the contraction tile: one scale block


@dataclasses.dataclass(frozen=True)
class Fp8ExpertsConfig:
    """The two kernels' tiling: ``block_i`` output rows of gate/up per program, ``block_h`` of down;
    each a power of two from 16 to 128. ``num_warps`` / ``num_stages``: Triton's, for both."""

    block_i: int = 32
    block_h: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def check(self) -> None:
        for name in ("block_i", "block_h"):
            b = getattr(self, name)
            if b < 16 or b > SCALE_BLOCK or b & (b - 1):
                raise ValueError(f"Fp8ExpertsConfig.{name}={b}: a power of two from 16 to {SCALE_BLOCK}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"Fp8ExpertsConfig {self}: num_warps and num_stages must be >= 1")


def _fewest_rows(pairs: int, out: int) -> int:
    """The largest power-of-two block (128 down to 16) that still gives ``pairs * out / block`` about
    two programs per SM (from 7/8 of the SMs on); 16 if none does."""
    want = 2 * (num_sms() * 7 // 8)
    block = SCALE_BLOCK
    while block > 16 and pairs * (out // block) < want:
        block //= 2
    return block


def default_config(tokens: int, k: int, inter: int, hidden: int) -> Fp8ExpertsConfig:
    """The tiling for ``tokens`` rows routed to ``k`` experts ``[I = inter, H = hidden]`` each: at one
    token of Qwen3-Next (10 pairs, I = 512, H = 2048) 16 gate/up rows (320 programs of 64 KB each) and
    16 down rows (128 programs, each streaming its token's 10 experts' 16 x 512 tiles: 80 KB); not
    yet swept on a GPU."""
    return Fp8ExpertsConfig(block_i=_fewest_rows(tokens * k, inter), block_h=_fewest_rows(tokens, hidden))


def unsupported(x, expert_ids, gate, up, down, shared=None) -> str | None:
    """Why the kernels cannot take these inputs (the reference then runs), or None.

    ``shared``: an optional shared expert ``(gate [I, H], up [I, H], down [H, I])`` run as every
    token's last pair (`routed_experts_fp8`).
    """
    ws = (gate, up, down) + (tuple(shared) if shared is not None else ())
    if not all(isinstance(w, BlockFp8Weight) for w in ws):
        return "the experts are not all BlockFp8Weight"
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x is {x.dtype} {tuple(x.shape)}; the kernels take bfloat16 [N, H]"
    if x.shape[0] > MAX_TOKENS:
        return f"{x.shape[0]} tokens: the kernels stream the experts for at most {MAX_TOKENS}"
    if any(jnp.dtype(w.values.dtype) != jnp.float8_e4m3fn for w in ws):
        return "the values are not all float8_e4m3fn"
    if any(tuple(w.block) != (SCALE_BLOCK, SCALE_BLOCK) for w in ws):
        return f"scale blocks other than ({SCALE_BLOCK}, {SCALE_BLOCK})"
    e, i, h = gate.shape
    if up.shape != (e, i, h) or down.shape != (e, h, i) or x.shape[1] != h:
        return f"shapes x {tuple(x.shape)}, gate {gate.shape}, up {up.shape}, down {down.shape} do not fit"
    if shared is not None and tuple(w.shape for w in shared) != ((i, h), (i, h), (h, i)):
        return (f"the shared expert's {[w.shape for w in shared]} are not the routed experts' "
                f"[{i}, {h}], [{i}, {h}], [{h}, {i}]")
    if i % SCALE_BLOCK or h % SCALE_BLOCK:
        return f"I = {i} and H = {h} must be multiples of {SCALE_BLOCK} (whole tiles, no masks)"
    return None


def _scaled_tile(rows, q_ref, s_ref, e, o0, k0, block):
    """``rows [16, BLOCK_IN] @ (q_ref[e, o0:o0 + block, k0:k0 + BLOCK_IN] * its block scale).T``, f32."""
    q = q_ref[e, pl.ds(o0, block), pl.ds(k0, BLOCK_IN)]
    scale = s_ref[e, o0 // SCALE_BLOCK, k0 // SCALE_BLOCK]
    part = jax.lax.dot_general(rows, q.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return part * scale


def _row(acc, r):
    """Row ``r`` of ``acc [16, n]`` (a masked sum: Triton has no dynamic row index of a value)."""
    pick = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0) == r
    return jnp.sum(jnp.where(pick, acc, 0.0), axis=0)


def _gate_up_kernel(ids_ref, tok_ref, x_ref, gq_ref, gs_ref, uq_ref, us_ref, *rest, hidden, block, slots, shared):
    """Pair ``program_id(0)``'s ``h`` for gate/up rows ``[o0, o0 + block)``: bf16 ``[1, block]``.

    With ``shared``, each token's last pair (slot ``slots - 1``) is the shared expert, whose
    weights are the refs after the routed ones (a leading axis of 1).
    """
    *shared_refs, h_ref = rest
    e, t = ids_ref[0, 0], tok_ref[0, 0]
    o0 = pl.program_id(1) * block
    one = x_ref.shape[0] == 1  # one token: its row broadcast into the dot's 16 (no padded copy of x)

    def run(gq, gs, uq, us, e):
        def body(j, acc):
            k0 = j * BLOCK_IN
            if one:
                rows = jnp.broadcast_to(x_ref[0, pl.ds(k0, BLOCK_IN)][None, :], (MAX_TOKENS, BLOCK_IN))
            else:
                rows = x_ref[:, pl.ds(k0, BLOCK_IN)]
            return (acc[0] + _scaled_tile(rows, gq, gs, e, o0, k0, block),
                    acc[1] + _scaled_tile(rows, uq, us, e, o0, k0, block))

        zeros = jnp.zeros((MAX_TOKENS, block), jnp.float32)
        g, u = jax.lax.fori_loop(0, hidden // BLOCK_IN, body, (zeros, zeros))
        bf16, f32 = jnp.bfloat16, jnp.float32
        g = _row(g, t).astype(bf16).astype(f32)
        u = _row(u, t).astype(bf16).astype(f32)
        act = (g * jax.nn.sigmoid(g).astype(bf16).astype(f32)).astype(bf16).astype(f32)  # silu, in bf16's steps
        h_ref[...] = (act * u).astype(h_ref.dtype)[None, :]

    if not shared:
        run(gq_ref, gs_ref, uq_ref, us_ref, e)
        return
    last = pl.program_id(0) % slots == slots - 1

    @pl.when(jnp.logical_not(last))
    def _routed():
        run(gq_ref, gs_ref, uq_ref, us_ref, e)

    @pl.when(last)
    def _shared():
        run(*shared_refs, 0)


def _down_kernel(ids_ref, w_ref, h_ref, dq_ref, ds_ref, *rest, slots, inter, block, shared):
    """Token ``program_id(0)``'s output for hidden rows ``[o0, o0 + block)``, its ``slots`` pairs
    summed in the program (the combine): f32 ``[1, block]``; with ``shared`` the last is the shared
    expert (the refs after the routed ones)."""
    *shared_refs, out_ref = rest
    n = pl.program_id(0)
    o0 = pl.program_id(1) * block
    out = jnp.zeros((block,), jnp.float32)
    for j in range(slots):  # static: the token's pairs one after another
        p = n * slots + j
        is_shared = shared and j == slots - 1
        dq, ds = shared_refs if is_shared else (dq_ref, ds_ref)
        e, weight = (0 if is_shared else ids_ref[0, p]), w_ref[0, p]
        base = (p // MAX_TOKENS) * MAX_TOKENS  # the pair's row of h sits in the 16-row block from here

        def body(i, acc, e=e, base=base, dq=dq, ds=ds):
            k0 = i * BLOCK_IN
            return acc + _scaled_tile(h_ref[pl.ds(base, MAX_TOKENS), pl.ds(k0, BLOCK_IN)], dq, ds, e, o0, k0, block)

        acc = jax.lax.fori_loop(0, inter // BLOCK_IN, body, jnp.zeros((MAX_TOKENS, block), jnp.float32))
        y = _row(acc, p - base).astype(jnp.bfloat16).astype(jnp.float32)  # the expert's output, rounded
        out = out + weight * y
    out_ref[...] = out[None, :]


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _routed_experts_fp8(x, expert_ids, expert_weights, gate, up, down, shared, *, config, interpret):
    n, k = expert_ids.shape
    e, inter, hidden = gate.shape
    ids, weights = expert_ids.astype(jnp.int32), expert_weights.astype(jnp.float32)
    shared_ws = ()
    if shared is not None:  # the shared expert as every token's last pair: its id unused, its weight given
        *shared_ws, shared_weight = shared
        shared_ws = tuple(jax.tree.map(lambda a: a[None], w) for w in shared_ws)  # [1, out, in]: one more stack
        ids = jnp.concatenate([ids, jnp.zeros((n, 1), jnp.int32)], axis=1)
        weights = jnp.concatenate([weights, shared_weight.reshape(n, 1).astype(jnp.float32)], axis=1)
    slots = ids.shape[1]
    pairs = n * slots
    padded = -(-pairs // MAX_TOKENS) * MAX_TOKENS
    tok = (jnp.arange(pairs, dtype=jnp.int32) // slots).reshape(pairs, 1)
    xp = x if n == 1 else jnp.pad(x, ((0, MAX_TOKENS - n), (0, 0)))
    per_pair = pl.BlockSpec((1, 1), lambda p, j: (p, 0))
    whole = lambda a: pl.BlockSpec(a.shape, lambda p, j: (0,) * a.ndim)
    wspecs = lambda *ws: [spec for w in ws for spec in (whole(w.values), whole(w.scale_inv))]
    wargs = lambda *ws: [a for w in ws for a in (w.values, w.scale_inv.astype(jnp.float32))]
    bi, bh = config.block_i, config.block_h
    params = triton_compiler_params(interpret, num_warps=config.num_warps, num_stages=config.num_stages)
    has_shared = bool(shared_ws)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, hidden=hidden, block=bi, slots=slots, shared=has_shared),
        grid=(pairs, inter // bi),
        in_specs=[per_pair, per_pair, whole(xp), *wspecs(gate, up), *wspecs(*shared_ws[:2])],
        out_specs=pl.BlockSpec((1, bi), lambda p, j: (p, j)),
        out_shape=jax.ShapeDtypeStruct((padded, inter), x.dtype),  # rows past P: never written, never picked
        interpret=interpret,
        name=f"fp8_experts_gate_up_{inter}x{hidden}",  # the kernel's name in a profile (CUPTI)
        **params,
    )(ids.reshape(pairs, 1), tok, xp, *wargs(gate, up), *wargs(*shared_ws[:2]))
    flat = lambda a: a.reshape(1, pairs)
    return pl.pallas_call(
        functools.partial(_down_kernel, slots=slots, inter=inter, block=bh, shared=has_shared),
        grid=(n, hidden // bh),
        in_specs=[whole(flat(ids)), whole(flat(weights)), whole(h), *wspecs(down), *wspecs(*shared_ws[2:])],
        out_specs=pl.BlockSpec((1, bh), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n, hidden), jnp.float32),
        interpret=interpret,
        name=f"fp8_experts_down_{hidden}x{inter}",
        **params,
    )(flat(ids), flat(weights), h, *wargs(down), *wargs(*shared_ws[2:]))


def routed_experts_fp8(x, expert_ids, expert_weights, gate, up, down, *, shared=None,
                       config: Fp8ExpertsConfig | None = None, interpret: bool = False) -> jax.Array:
    """`reference.routed_experts` of FP8 experts (f32 ``[N, H]``), streaming the selected experts in place.

    ``shared``: ``(gate [I, H], up [I, H], down [H, I], weight f32 [N])``, a shared expert of the
    routed experts' shape added as every token's last pair with its own weight (Qwen3-Next's
    ``sigmoid(shared_expert_gate(x))``): the result is then the routed output plus ``weight[n]``
    times the shared expert's (rounded to bf16 as `mtp.model.layers.mlp` rounds it), one op.

    Equal to the reference to f32 rounding of the products: the reference rounds each dequantized
    weight to bf16 before its dot, the kernels scale exact E4M3 products per block. Inputs must pass
    `unsupported`.
    """
    shared_ws = None if shared is None else tuple(shared[:3])
    why = unsupported(x, expert_ids, gate, up, down, shared_ws)
    if why:
        raise ValueError(f"fp8 routed-experts kernels: {why}")
    n, k = expert_ids.shape
    e, inter, hidden = gate.shape
    config = config or default_config(n, k + (shared is not None), inter, hidden)
    config.check()
    return _routed_experts_fp8(x, expert_ids, expert_weights, gate, up, down,
                               None if shared is None else tuple(shared), config=config, interpret=interpret)
