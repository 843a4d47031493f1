"""The routed-expert FFN as a grouped GEMM in Pallas Mosaic GPU (Hopper: TMA + wgmma).

``routed_experts_mosaic`` computes what the reference ``mtp.ops.moe.reference.routed_experts``
defines (``mtp.ops.moe.routed_experts`` dispatches to it),

    out[n] = sum_j w[n, j] * rnd(down_e @ rnd(rnd(silu(rnd(gate_e @ x_n))) * rnd(up_e @ x_n))),
    e = expert_ids[n, j],

(``rnd``: a rounding to ``x``'s dtype; f32 accumulation; f32 out), reading each selected
expert's weights once per block of rows routed to it and no other expert's weights.

How it computes it: a row plan (XLA), two Mosaic GPU kernels, a combine (XLA).

1. The row plan puts the ``P = N k`` (token, slot) pairs into *blocks* of ``block_rows`` (64)
   rows, each block belonging to one expert (``block_expert[b]``; the sentinel ``E`` marks a
   block that does nothing), in one of two layouts:

   * ``"tokens"`` (``plan_slots``, N <= 64: decode, verify, propose): one block per selected
     expert, in ascending expert order, each reading *every* token row (``x`` itself, rows
     past N TMA zero-fill); pair ``(n, j)``'s result is row ``slot * 64 + n``. No sort and
     no gather: the plan is a few fused compare-reductions over ``[P, E]``.
   * ``"blocks"`` (``plan_rows``, any N): the pairs sorted by expert, each expert's rows
     starting a fresh block (vLLM's ``moe_align_block_size`` layout), ``x`` gathered into it
     (padding rows repeat token 0: computed, never read). The blocks number at most
     ``min(E, P) + P // 64`` (a sum of ceilings), a static bound.
2. ``moe_gate_up`` (grid: blocks x ``I / tile_i`` column tiles): a program streams its
   expert's ``gate`` and ``up`` rows for its columns through a ``stages``-deep TMA ring
   beside the block's rows, two wgmmas per k step (one step in flight), and applies the
   activation in its epilogue, ``h = rnd(rnd(silu(rnd(g))) * rnd(u))``: no ``[rows, 2I]``
   intermediate, no second pass.
3. ``moe_down`` (blocks x ``H / tile_h``): ``y = rnd(h_block @ down_e.T)``.
4. The combine: ``out[n] = sum_j w[n, j] * y[row(n, j)]`` in f32, a gather of the P rows.

An expert with ``c`` rows is streamed ``ceil(c / 64)`` times ("blocks") or once ("tokens").
Both kernels are one ``_grouped_matmul``.

Why this form. At decode and verify (10-320 pairs) the op is a weight stream (Qwen3-Next:
6.3 MB an expert). wgmma's 64-row tile spends tensor work on rows that are not there, but a
64 x 64 x 64 k step runs ~4x faster than its weight tile arrives at one SM's share of the
bandwidth, so it hides behind the stream. At a 2048-token chunk Qwen3-Next's FFN is still
bound by bytes: every expert is touched (3.2 GB: 0.78 ms at the measured 4.1 TB/s) while
its FLOPs take 0.17 ms at XLA's 750 TFLOP/s, so the same kernels serve there; "50% of the
bf16 peak over the active FLOPs" (0.34 ms) lies below that bytes floor at this shape.

Measured (2026-12-02, one H200, ``experiments/bench_moe.py``: CUPTI device time of the whole
op, L2 evicted before each call, weights rotated; results/kernels/moe_kernels_h200.md; floor = the
active experts' bytes over the copy bandwidth measured in the same run), Qwen3-Next's shape,
uniform routing, the default config:

  | tokens | 1 | 4 | 32 | 256 | 2048 | 2048 skewed |
  |---|---|---|---|---|---|---|
  | this op, us (x floor) | 42.6 (2.79) | 94.6 (1.55) | 414 (1.12) | 964 (1.25) | 1086 (1.39) | 1224 (1.57) |
  | tokamax.ragged_dot 0.0.17, us | 77.3 | 140 | 443 | 829 | 1022 | 1203 |

Choices, each measured there:

* The grid's fastest axis is the blocks (``columns_minor=False``): consecutive programs
  stream different experts' weights. With the column tiles fastest (a block's programs side
  by side, sharing its rows in L2) the op was equal at 1-4 tokens and 1.11x, 1.36x and
  1.33x slower at 32, 256 and 2048 tokens (the down kernel at 32 tokens: 182 vs 139 us).
* The ``"tokens"`` layout up to 64 tokens: the sorted layout's plan (a sort, scatters, a
  binary search of ~18 small kernels) cost 44 of its 68 us at one token; the tokens layout's
  plan and combine are 5 small kernels, 11 us.
* ``tile_k`` 64 with 4 stages: 128-wide k steps (3 stages) were 0.95-1.03x as fast.
  64-row blocks: 128-row ones were 1.2-1.45x slower at every size (tensor work, and twice
  the rows read per program).
* ``tile_i`` 32 while fewer than 132 programs would stream gate/up, else 64; at one token
  ``tile_i=128, tile_h=256`` (column-fastest order) measured 38.5 against 43.0 us, equal
  at 4 tokens and 1.03x faster at 32: not yet measured with the blocks-fastest order.

Where the time goes (same run): at one token the gate/up kernel streams its 42 MB at 1.8
TB/s (160 programs of 256 KB) and the down kernel at 2.5 TB/s, and the plan and combine take
11 us: the 1.5x goal at 1-2 tokens needs the few experts' weights spread over more programs
(split-K with f32 partials) and a cheaper combine. At 2048 tokens the kernels stream at
3.8 TB/s (gate/up 559 us, down 291 us, as tokamax's two kernels: 549 and 298 us); the gap to
tokamax is the gather of ``x`` into the padded layout (130 us: its ~53k rows, against
tokamax's 51 us for the 20k rows of its 8-aligned packing) and the sort (32 us, the same).

Tuning is explicit: ``GroupedGemmConfig`` with ``default_config`` the heuristic;
``routed_experts_mosaic(config=...)`` takes any other. Inputs the kernels cannot take are
named by ``unsupported``; the api sends those to the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.ops.lowering import swizzle_transforms
from mtp.ops.moe.reference import check_inputs

_SMEM_LIMIT = 232_448 - 4096  # bytes per block, less headroom for barriers and Mosaic's scratch
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


LAYOUTS = ("tokens", "blocks")


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """The kernels' row layout and tiles (static: one compile per config).

    layout: ``"tokens"``: a block per selected expert, each reading all ``N <= block_rows``
      token rows (decode, verify, propose); ``"blocks"``: the pairs sorted by expert into
      blocks of ``block_rows`` rows (any N). See the module docstring.
    block_rows: rows of a block (one warpgroup's wgmma M: 64, or 128 as two 64-row halves).
    tile_i: ``gate`` and ``up`` output columns a ``gate_up`` program owns (each; a multiple of 8).
    tile_h: ``down`` output columns a ``down`` program owns.
    tile_k: the reduction step of both kernels (64: one 128-byte swizzled bf16 row).
    stages: the TMA ring depth (lowered to what shared memory holds).
    columns_minor: the column tiles of a block are the grid's fastest axis (the programs
      sharing a block's rows run side by side); False (the default, measured faster): the
      blocks are.
    """

    layout: str = "blocks"
    block_rows: int = 64
    tile_i: int = 64
    tile_h: int = 128
    tile_k: int = 64
    stages: int = 4
    columns_minor: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: choose one of {', '.join(LAYOUTS)}")
        if self.block_rows not in (64, 128):
            raise ValueError(f"block_rows={self.block_rows}: choose 64 or 128 (wgmma rows)")
        for name in ("tile_i", "tile_h"):
            v = getattr(self, name)
            if v < 8 or v % 8 or v > 256:
                raise ValueError(f"{name}={v}: a multiple of 8 in [8, 256] (wgmma columns)")
        if self.tile_k not in (32, 64, 128):
            raise ValueError(f"tile_k={self.tile_k}: choose 32, 64 or 128")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages}: at least 1")


def _widest_tile(dim: int, widest: int) -> int:
    """The widest multiple of 8 up to ``widest`` that divides ``dim`` (8 when none does)."""
    return next((t for t in range(widest, 7, -8) if dim % t == 0), 8)


def default_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> GroupedGemmConfig:
    """The plan's heuristic (the measurements behind it: the module docstring).

    Up to 64 tokens every selected expert's block reads all the token rows (``"tokens"``:
    no sort, no gather); beyond, the pairs are sorted into blocks. With few blocks
    (``min(E, N k)``) a 32-column ``gate_up`` tile gives more programs streaming weights at
    once (64 columns measured the same at 1-8 tokens).
    """
    blocks = min(num_experts, num_tokens * top_k)
    tile_i = _widest_tile(inter, 64)
    if blocks * (inter // tile_i) < 132 and inter % 32 == 0:
        tile_i = 32
    return GroupedGemmConfig(layout="tokens" if num_tokens <= 64 else "blocks", tile_i=tile_i,
                             tile_h=_widest_tile(hidden, 128))


def unsupported(x, expert_ids, expert_weights, gate, up, down, config: GroupedGemmConfig | None = None) -> str | None:
    """Why the kernels cannot take these (well-formed) inputs, or None when they can."""
    if any(hasattr(wt, "dequantize") for wt in (gate, up, down)):
        return "quantized expert weights: the Mosaic GPU routed-expert kernels read 16-bit weights"
    n, h = x.shape
    e, i, _ = gate.shape
    dtypes = {jnp.dtype(a.dtype) for a in (x, gate, up, down)}
    if len(dtypes) != 1 or jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
        return ("the Mosaic GPU routed-expert kernels need x, gate, up and down in one 16-bit "
                f"float dtype (bfloat16 or float16); got x {x.dtype}, gate {gate.dtype}, "
                f"up {up.dtype}, down {down.dtype}")
    if n < 1:
        return f"x must have at least one row; got shape {x.shape}"
    cfg = config or default_config(n, expert_ids.shape[1], e, h, i)
    if cfg.layout == "tokens" and n > cfg.block_rows:
        return (f"N={n} tokens: the 'tokens' layout reads every token row in one block of "
                f"block_rows={cfg.block_rows}; take the 'blocks' layout")
    if h % cfg.tile_k or i % cfg.tile_k:
        return (f"H={h} and I={i} must be multiples of tile_k={cfg.tile_k} (the kernels' "
                "reduction step)")
    if i % cfg.tile_i:
        return f"I={i} must be a multiple of tile_i={cfg.tile_i}"
    if h % cfg.tile_h:
        return f"H={h} must be a multiple of tile_h={cfg.tile_h}"
    return None


# ------------------------------------------------------------------ the row plan


def num_blocks_bound(num_pairs: int, num_experts: int, block_rows: int) -> int:
    """Blocks the plan can use at most: ``sum_e ceil(c_e / B) <= #{c_e > 0} + P // B``."""
    return min(num_experts, num_pairs) + num_pairs // block_rows


def plan_rows(expert_ids, num_experts: int, block_rows: int):
    """``(pos [N, k], block_expert [blocks], row_token [blocks * block_rows])`` (int32).

    Pairs sorted by expert (stable: token order inside an expert), each expert's rows
    from the start of a fresh block. ``block_expert`` is ``num_experts`` for blocks past
    the used ones; ``row_token`` names the token a row holds (0 for padding rows).
    """
    n, k = expert_ids.shape
    p = n * k
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    nb = num_blocks_bound(p, num_experts, block_rows)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    blocks = (counts + (block_rows - 1)) // block_rows
    block_end = jnp.cumsum(blocks)
    block_first = block_end - blocks
    pair_first = jnp.cumsum(counts) - counts
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = jnp.arange(p, dtype=jnp.int32) - pair_first[sorted_e]
    pos = jnp.zeros((p,), jnp.int32).at[order].set(block_first[sorted_e] * block_rows + rank)
    # Block b's expert: how many experts' blocks end at or before b (one fused compare-sum,
    # where a binary search measured ~18 small kernels on the H200).
    block_expert = _count_at_most(block_end, nb)
    row_token = jnp.zeros((nb * block_rows,), jnp.int32).at[pos].set(
        jnp.arange(p, dtype=jnp.int32) // k)
    return pos.reshape(n, k), block_expert.astype(jnp.int32), row_token


def _count_at_most(cumulative, n: int):
    """``[n]``: for each ``b < n``, the entries of the non-decreasing ``cumulative`` that are ``<= b``."""
    b = jnp.arange(n, dtype=jnp.int32)[:, None]
    return jnp.sum((cumulative[None, :] <= b).astype(jnp.int32), axis=1)


def plan_slots(expert_ids, num_experts: int, block_rows: int):
    """``(rows [N, k], slot_expert [slots])`` of the ``"tokens"`` layout (int32).

    Slot s is the s-th selected expert in ascending order (``num_experts`` past the
    selected ones), its block holding every token's row: pair ``(n, j)`` reads row
    ``slot * block_rows + n``. Dense compare-reductions over ``[P, E]`` and ``[slots, E]``,
    no sort: a handful of fused kernels at decode sizes.
    """
    n, k = expert_ids.shape
    e = jnp.arange(num_experts, dtype=jnp.int32)
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    present = jnp.any(flat[:, None] == e[None, :], axis=0).astype(jnp.int32)
    selected_upto = jnp.cumsum(present)  # slot of expert e, plus one, where selected
    slot_expert = _count_at_most(selected_upto, min(num_experts, n * k))
    slot = selected_upto[expert_ids] - 1
    return slot * block_rows + jnp.arange(n, dtype=jnp.int32)[:, None], slot_expert


# ------------------------------------------------------------------ the kernels


def _stages_that_fit(stages: int, per_stage: int, fixed: int, steps: int) -> int:
    stages = max(1, min(stages, steps))
    while stages > 1 and stages * per_stage + fixed > _SMEM_LIMIT:
        stages -= 1
    if stages * per_stage + fixed > _SMEM_LIMIT:
        raise ValueError(f"one stage ({per_stage} bytes) plus the output tile ({fixed}) exceed "
                         f"the shared memory limit ({_SMEM_LIMIT}); narrow the tiles")
    return stages


def _grouped_matmul(block_expert, a, weights, epilogue, *, tile_n, num_blocks, shared_rows,
                    cfg: GroupedGemmConfig, name: str):
    """``[num_blocks * block_rows, W]`` in ``a``'s dtype: for each used block b (expert e),
    ``epilogue(*(a_rows @ w[e, cols].T for w in weights))`` over ``tile_n``-column tiles.

    ``a_rows`` are block b's rows of ``a``, or its first ``block_rows`` rows for every
    block (``shared_rows``: the ``"tokens"`` layout; rows past ``a``'s end are TMA zero-fill).
    The weights (each ``[E, W, K]``) stream through one TMA ring with ``a``'s tiles, one
    wgmma a weight per k step, one step's wgmmas in flight. A block whose expert is the
    sentinel ``E`` does nothing.
    """
    kdim = a.shape[1]
    e, n_out, _ = weights[0].shape
    br, tn, tk = cfg.block_rows, tile_n, cfg.tile_k
    dtype = a.dtype
    nw = len(weights)
    nk = kdim // tk
    item = jnp.dtype(dtype).itemsize
    stages = _stages_that_fit(cfg.stages, (br + nw * tn) * tk * item, br * tn * item, nk)
    delay = 1 if stages > 1 else 0
    in_tr = swizzle_transforms(tk, dtype)

    def body(be_ref, a_ref, *refs, o_smem):
        w_refs, o_ref = refs[:nw], refs[nw]
        ci = lax.axis_index("c")
        bi = lax.axis_index("b")
        ex = be_ref[bi]

        @pl.when(ex < e)
        def _():
            rows = pl.ds(bi * br, br)
            # A traced 0 for shared rows: a window past a's last row is TMA zero-fill.
            a_block = ci * 0 if shared_rows else bi
            cols = pl.ds(ci * tn, tn)

            def scope(*accs):
                def step(_, a_smem, *w_smems):
                    for acc, w_smem in zip(accs, w_smems):
                        plgpu.wgmma(acc, a_smem, w_smem.T)
                    plgpu.wgmma_wait(delay)

                spec = lambda r, block: plgpu.BlockSpec((r, tk), lambda k: (block, k), transforms=in_tr,
                                                        delay_release=delay)
                plgpu.emit_pipeline(step, grid=(nk,), in_specs=[spec(br, a_block)] + [spec(tn, 0)] * nw,
                                    max_concurrent_steps=stages,
                                    )(a_ref, *(w.at[ex, cols] for w in w_refs))
                return tuple(acc[...] for acc in accs)

            accs = pl.run_scoped(scope, *(plgpu.ACC((br, tn), jnp.float32) for _ in range(nw)))
            o_smem[...] = epilogue(*accs).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, cols])
            plgpu.wait_smem_to_gmem(0)

    grid, names = (n_out // tn, num_blocks), ("c", "b")
    if not cfg.columns_minor:
        grid, names = grid[::-1], names[::-1]
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_blocks * br, n_out), dtype),
        grid=grid,
        grid_names=names,
        scratch_types=dict(o_smem=plgpu.SMEM((br, tn), dtype, transforms=swizzle_transforms(tn, dtype))),
        kernel_name=name,
    )(block_expert, a, *weights)


def activation(dtype):
    """The gate/up epilogue: ``rnd(rnd(silu(rnd(g))) * rnd(u))`` from the f32 accumulators."""
    rnd = lambda v: v.astype(dtype).astype(jnp.float32)

    def act(g, u):
        g, u = rnd(g), rnd(u)
        return rnd(g / (1.0 + jnp.exp(-g))) * u

    return act


def grouped_ffn(grouped_matmul, x, expert_ids, expert_weights, gate, up, down, *, config):
    """The routed experts' weighted sum through ``grouped_matmul``: the row plan, gate/up with the
    activation, down, and the combine. ``grouped_matmul`` has `_grouped_matmul`'s signature; the
    FP8 grouped GEMM (`mtp.ops.moe.triton_grouped`) is the other that plugs in."""
    n, k = expert_ids.shape
    e = gate.shape[0]
    shared = config.layout == "tokens"
    if shared:
        rows, block_expert = plan_slots(expert_ids, e, config.block_rows)
        xs = x
    else:
        rows, block_expert, row_token = plan_rows(expert_ids, e, config.block_rows)
        xs = x[row_token]
    kw = dict(num_blocks=block_expert.shape[0], shared_rows=shared, cfg=config)
    hs = grouped_matmul(block_expert, xs, (gate, up), activation(x.dtype), tile_n=config.tile_i,
                        name="moe_gate_up", **kw)
    ys = grouped_matmul(block_expert, hs, (down,), lambda y: y, tile_n=config.tile_h,
                        name="moe_down", **{**kw, "shared_rows": False})
    picked = ys[rows.reshape(-1)].astype(jnp.float32).reshape(n, k, -1)
    return jnp.einsum("nk,nkh->nh", expert_weights.astype(jnp.float32), picked)


_routed_experts = jax.jit(functools.partial(grouped_ffn, _grouped_matmul), static_argnames=("config",))


def routed_experts_mosaic(x, expert_ids, expert_weights, gate, up, down, *, impl="pallas",
                          config: GroupedGemmConfig | None = None):
    """The routed experts' weighted sum, f32 ``[N, H]``, through the grouped-GEMM kernels.

    Same arguments as the reference ``routed_experts``: x ``[N, H]``, expert_ids int
    ``[N, k]`` (values in ``[0, E)``), expert_weights ``[N, k]``, gate/up ``[E, I, H]``,
    down ``[E, H, I]``. ``impl``: ``"pallas"`` (compiled, a GPU) or ``"interpret"``
    (Pallas' GPU interpreter, any backend; call it eagerly). ``config``: the tiles,
    ``default_config`` when None. Raises ValueError for inputs the kernels cannot take
    (``unsupported``) and, as the api does, for inputs of the wrong shape or dtype.
    """
    check_inputs(x, expert_ids, expert_weights, gate, up, down)
    if impl not in ("pallas", "interpret"):
        raise ValueError(f"impl={impl!r}: the kernel path runs 'pallas' or 'interpret'")
    n, h = x.shape
    e, i, _ = gate.shape
    cfg = config or default_config(n, expert_ids.shape[1], e, h, i)
    if why := unsupported(x, expert_ids, expert_weights, gate, up, down, cfg):
        raise ValueError(why)
    if impl == "interpret":
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return _routed_experts(x, expert_ids, expert_weights, gate, up, down, config=cfg)
    return _routed_experts(x, expert_ids, expert_weights, gate, up, down, config=cfg)
