"""Pure-JAX reference of the routed-expert FFN, sparse in the experts.

For token rows ``x [N, H]``, each routed to ``k`` experts ``expert_ids [N, k]`` with weights
``expert_weights [N, k]`` (f32, already normalised and rounded as the model wants)::

    out[n] = sum_j expert_weights[n, j] * expert_{expert_ids[n, j]}(x[n])        (f32 [N, H])
    expert_e(v) = r(down_e @ (silu(r(gate_e @ v)) * r(up_e @ v)))

where every GEMM accumulates in f32 and ``r`` rounds to ``x``'s dtype, the product
``silu * up`` is taken in ``x``'s dtype and the weighted sum in f32: the roundings of a Hugging
Face expert module run in ``x``'s dtype. ``gate`` and ``up`` are ``[E, I, H]``, ``down`` is
``[E, H, I]`` (each expert in the ``[out, in]`` orientation of a Linear weight).

Two forms, both of which read only the selected experts' weights:

* **gather** (`routed_experts_gather`), for few (token, expert) pairs: a decode step, a verify,
  the MTP head's propose. Each of the ``P = N * k`` pairs gathers its expert's three weights and
  multiplies its token's row by them: P rows computed, P experts' weights read.
* **segments** (`routed_experts_segments`), for many pairs: prefill chunks, training. The pairs
  are sorted by expert and each expert's run is padded to whole tiles of ``T`` rows; one batched
  GEMM over the tiles reads each tile's expert once; the rows are then un-sorted and combined.
  With ``G = min(E, P)`` (the most experts P pairs can touch) there are at most
  ``(P + (T - 1) G) / T`` tiles, and `segment_rows`' ``T = ceil(P / G)`` keeps the rows computed
  under ``2 P`` and the expert weights read under ``2 G`` whatever the routing.

`routed_experts` picks the form by the static pair count (``GATHER_MAX_PAIRS``, capped at ``E``).
``jax.lax.ragged_dot`` is not used: XLA's CPU lowering (jax 0.11.2) evaluates every group over
all rows, a cost that follows the expert count (measured 2026-12-02 for 512 rows, K = 256,
N = 128, four groups holding rows: 25, 80 and 235 ms with 8, 64 and 256 groups).

A weight is an array, or a pytree whose array leaves all lead with the expert axis and that
has a ``dequantize()`` method giving the f32 ``[..., out, in]`` weight it stands for (the MTP
head's quantized experts, `mtp.ops.quantized`): the selected experts' leaves are gathered and only
those are dequantized. Every function here is differentiable in ``x``, ``expert_weights`` and
the (plain) weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# The most (token, expert) pairs the gather form takes, and never more than the experts there are;
# more go to the segments form. The gather form reads one expert per pair, the segments form at
# most two per expert touched, so the segments form pays once pairs share experts. Measured on
# this project's 2-core CPU under load from other jobs, so to within tens of percent (2026-12-02,
# `experiments/expert_scaling.py --form_pairs 8,16,32,64,128,256,512 --form_shape 512,256`, top-2,
# results/kernels/expert_scaling): with 8 experts the gather form wins only at 8 pairs (5.4 vs 12.0 ms)
# and loses 192 vs 18 ms at 32; with 256 experts the two stay within 1.6x of each other from 16
# to 512 pairs (gather 368 vs 596 ms at 64, 1328 vs 1012 ms at 256). Up to 64 a decode step or a
# small verify stays on the gather form, which needs no sort.
GATHER_MAX_PAIRS = 64


class SharedExpert(NamedTuple):
    """A MoE layer's shared expert, which every token runs beside its routed ones.

    ``gate``/``up`` ``[Is, H]`` and ``down`` ``[H, Is]`` (plain or quantized, as the routed
    experts), ``weight`` f32 ``[N]``: each token's gate value (Qwen3-Next's
    ``sigmoid(shared_expert_gate(x))``), which scales the expert's output before it joins the sum.
    """

    gate: Any
    up: Any
    down: Any
    weight: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows"], meta_fields=["experts", "k", "normalize"])
@dataclasses.dataclass(frozen=True)
class RouterLogits:
    """A MoE layer's router output, from which `route` picks each token's experts.

    ``rows``: the router GEMM's output ``[R, C]`` as it wrote it (`mtp.model.gemm_layout.dense_rows`:
    the tokens' rows first, perhaps padding rows after, and perhaps other projections' columns after
    the ``experts`` logits, such as a merged shared-expert gate), so that a kernel can read the
    logits in place; ``k`` experts a token, renormalised over the ``k`` when ``normalize``.
    """

    rows: jax.Array
    experts: int
    k: int
    normalize: bool


def route(router: RouterLogits, tokens: int, dtype) -> tuple[jax.Array, jax.Array]:
    """The first ``tokens`` rows' experts and weights: int32 ``[N, k]``, f32 ``[N, k]``.

    As Hugging Face's Qwen3-Next routes: an f32 softmax over the logits, the top ``k`` (the
    lower id first on a tie), renormalised over the ``k`` when ``normalize``, rounded to the
    activation ``dtype``.
    """
    logits = router.rows[:tokens, :router.experts].astype(jnp.float32)
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), router.k)
    if router.normalize:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_i.astype(jnp.int32), top_w.astype(dtype).astype(jnp.float32)


def _shape(weight) -> tuple[int, ...]:
    """The logical shape of a stacked expert weight, plain or quantized (``dequantize()``)."""
    if hasattr(weight, "dequantize"):
        return tuple(jax.eval_shape(lambda w: w.dequantize(), weight).shape)
    return tuple(weight.shape)


def check_inputs(x, expert_ids, expert_weights, gate, up, down, shared: SharedExpert | None = None) -> None:
    """Raise a ValueError that names the argument and its shape or dtype when the inputs do not fit."""
    if x.ndim != 2:
        raise ValueError(f"routed_experts: x must be [N, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != n or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"routed_experts: expert_ids must be integer [N={n}, k], got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape or expert_weights.dtype != jnp.float32:
        raise ValueError(f"routed_experts: expert_weights must be float32 {tuple(expert_ids.shape)} like "
                         f"expert_ids, got {expert_weights.dtype} {tuple(expert_weights.shape)}")
    g, u, d = _shape(gate), _shape(up), _shape(down)
    if len(g) != 3 or g[2] != h or u != g:
        raise ValueError(f"routed_experts: gate and up must be [E, I, H={h}], got gate {g}, up {u}")
    e, i, _ = g
    if d != (e, h, i):
        raise ValueError(f"routed_experts: down must be [E={e}, H={h}, I={i}], got {d}")
    if shared is not None:
        sg, su, sd = _shape(shared.gate), _shape(shared.up), _shape(shared.down)
        if len(sg) != 2 or sg[1] != h or su != sg or sd != (h, sg[0]):
            raise ValueError(f"routed_experts: the shared expert must be gate/up [Is, H={h}] and down [H, Is], "
                             f"got gate {sg}, up {su}, down {sd}")
        if shared.weight.shape != (n,) or shared.weight.dtype != jnp.float32:
            raise ValueError(f"routed_experts: the shared expert's weight must be float32 [N={n}], got "
                             f"{shared.weight.dtype} {tuple(shared.weight.shape)}")


def num_experts(weight) -> int:
    """``E`` of a stacked expert weight (its leaves' leading axis)."""
    return jax.tree.leaves(weight)[0].shape[0]


def take_experts(weight, index: jax.Array):
    """The experts ``index`` (int array of any shape) of a stacked weight, each leaf gathered."""
    return jax.tree.map(lambda leaf: leaf[index], weight)


def in_dtype(weight, dtype) -> jax.Array:
    """A (gathered) weight as an array of ``dtype``, dequantized first if it is quantized."""
    return (weight.dequantize() if hasattr(weight, "dequantize") else weight).astype(dtype)


def expert_ffn(rows: jax.Array, gate, up, down) -> jax.Array:
    """``rows [G, T, H]`` through expert ``g``'s FFN for each group ``g``, in ``rows``' dtype.

    ``gate``/``up`` ``[G, I, H]`` and ``down`` ``[G, H, I]`` are the groups' own experts
    (`take_experts`).
    """
    dt, f32 = rows.dtype, jnp.float32
    g = jnp.einsum("gth,gih->gti", rows, in_dtype(gate, dt), preferred_element_type=f32).astype(dt)
    u = jnp.einsum("gth,gih->gti", rows, in_dtype(up, dt), preferred_element_type=f32).astype(dt)
    return jnp.einsum("gti,ghi->gth", jax.nn.silu(g) * u, in_dtype(down, dt),
                      preferred_element_type=f32).astype(dt)


def combine(pair_out: jax.Array, expert_weights: jax.Array) -> jax.Array:
    """f32 ``[N, H]``: each token's ``k`` expert outputs ``pair_out [N, k, H]``, weighted and summed."""
    return jnp.einsum("nk,nkh->nh", expert_weights.astype(jnp.float32), pair_out.astype(jnp.float32))


def routed_experts_gather(x, expert_ids, expert_weights, gate, up, down) -> jax.Array:
    """The gather form (module docstring): each pair reads its own expert's weights."""
    n, k = expert_ids.shape
    ids = expert_ids.reshape(n * k)
    rows = jnp.repeat(x, k, axis=0)[:, None, :]  # pair p = (n, j) is row n * k + j
    out = expert_ffn(rows, take_experts(gate, ids), take_experts(up, ids), take_experts(down, ids))
    return combine(out.reshape(n, k, -1), expert_weights)


def segment_rows(pairs: int, experts: int) -> int:
    """Rows per tile of the segments form: the mean group size if every touchable expert is hit."""
    return max(1, math.ceil(pairs / max(1, min(experts, pairs))))


def routed_experts_segments(x, expert_ids, expert_weights, gate, up, down,
                            rows_per_tile: int | None = None) -> jax.Array:
    """The segments form (module docstring): pairs sorted by expert, a grouped GEMM over tiles.

    ``rows_per_tile`` defaults to `segment_rows`; any value gives the same result.
    """
    n, k = expert_ids.shape
    h = x.shape[-1]
    pairs, experts = n * k, num_experts(gate)
    t = rows_per_tile or segment_rows(pairs, experts)
    tiles = (pairs + (t - 1) * min(experts, pairs)) // t  # the bound on sum_e ceil(count_e / t)

    ids = expert_ids.reshape(pairs)
    order = jnp.argsort(ids, stable=True)  # pair indices, grouped by expert
    sorted_ids = ids[order]
    counts = jnp.bincount(ids, length=experts)
    tile_counts = (counts + t - 1) // t
    tile_end = jnp.cumsum(tile_counts)  # expert e owns tiles [tile_end[e] - tile_counts[e], tile_end[e])
    run_start = jnp.cumsum(counts) - counts  # where expert e's run starts among the sorted pairs
    rank = jnp.arange(pairs) - run_start[sorted_ids]
    slot = (tile_end - tile_counts)[sorted_ids] * t + rank  # each sorted pair's row in the tiles
    rows = jnp.zeros((tiles * t, h), x.dtype).at[slot].set(x[order // k], unique_indices=True)
    # Tiles past the last one in use hold zero rows; they are given the last expert (any would do).
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(tiles), side="right"), experts - 1)
    out = expert_ffn(rows.reshape(tiles, t, h), take_experts(gate, tile_expert),
                     take_experts(up, tile_expert), take_experts(down, tile_expert))
    sorted_out = out.reshape(tiles * t, h)[slot]
    pair_out = jnp.zeros_like(sorted_out).at[order].set(sorted_out, unique_indices=True)
    return combine(pair_out.reshape(n, k, h), expert_weights)


def shared_expert(x, shared: SharedExpert) -> jax.Array:
    """f32 ``[N, H]``: the shared expert's output on every row of ``x``, times each row's ``weight``."""
    lead = lambda w: jax.tree.map(lambda leaf: leaf[None], w)  # a stack of one expert
    y = expert_ffn(x[None], lead(shared.gate), lead(shared.up), lead(shared.down))[0]
    return shared.weight.astype(jnp.float32)[:, None] * y.astype(jnp.float32)


def routed_experts(x, expert_ids, expert_weights, gate, up, down, shared: SharedExpert | None = None) -> jax.Array:
    """The routed-expert FFN (module docstring), in the form that suits the static pair count,
    plus ``shared``'s gated output when given (after the routed sum, in f32)."""
    if expert_ids.size <= min(GATHER_MAX_PAIRS, num_experts(gate)):
        out = routed_experts_gather(x, expert_ids, expert_weights, gate, up, down)
    else:
        out = routed_experts_segments(x, expert_ids, expert_weights, gate, up, down)
    return out if shared is None else out + shared_expert(x, shared)
