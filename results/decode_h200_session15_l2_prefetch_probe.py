"""Session 15's probe (results/decode_h200.md): does pulling the next GEMM's weight into L2
during a small kernel shorten the GEMM by more than the pull costs?

Scenario A (the Gated DeltaNet's out_proj): a 32-program Triton kernel that reads and writes a
2 MB f32 state per layer (as `gdn_step` does), then y[2, 4096] @ W[4096, 2048] (16.8 MB).
Scenario B (the FFN's gate + up): a 2-program row kernel (as `add_rms_norm`), then
y[2, 2048] @ W[2048, 11264] (46 MB). 12 layers with distinct weights (more than the L2), steps
back to back in a fori_loop; the median wall time per layer. ``gemm=False`` drops the GEMM
(what the pull costs the small kernel); ``hot=True`` gives every layer one weight, which stays
in L2 (what the GEMM could gain).

Three ways of pulling, each measured on the H200:
* ``pf_progs``: extra programs in the small kernel load W's first bytes
  (``eviction_policy="evict_last"``) and keep them alive with a masked store;
* ``tma``: a separate Mosaic GPU kernel issues TMA bulk prefetches to L2
  (`plgpu.async_prefetch`) and exits;
* ``asm_progs``: PTX ``prefetch.global.L2::evict_last`` per 128-byte line, from the small
  kernel's own programs (``asm_progs=0``) or extra ones, through ``l2_prefetch`` below.

    PYTHONPATH=. python3 results/decode_h200_session15_l2_prefetch_probe.py [A] [B] [loads] [tma] [asm]
"""
import functools, sys, time, os
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

INTERPRET = jax.default_backend() == "cpu"
if not INTERPRET:
    from jax.experimental.pallas import triton as plt

from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as tl
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as sp
from jax._src.state import types as state_types
from jax._src.state.indexing import NDIndexer

l2_prefetch_p = jax_core.Primitive("l2_prefetch")
l2_prefetch_p.multiple_results = True


@l2_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree):
    return [], {state_types.WriteEffect(0)}


@state_discharge.register_discharge_rule(l2_prefetch_p)
def _discharge(ctx, *args_flat, args_tree):
    return (None,) * len(args_flat), []


@tl.register_lowering(l2_prefetch_p)
def _lowering(ctx, *args_flat, args_tree):
    ptr, transforms = args_tree.unflatten(args_flat)
    block_info = ctx.block_infos[0]
    transforms = list(transforms)
    if len(transforms) != 1 or not isinstance(transforms[0], NDIndexer):
        raise NotImplementedError(f"l2_prefetch takes one indexer, got {transforms}")
    idx = transforms[0]
    ptrs = tl._compute_pointers_from_indices(ptr, block_info, idx)
    shape = idx.get_indexer_shape_static()
    res = ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32)) if shape else ir.IntegerType.get_signless(32)
    tt_dialect.elementwise_inline_asm([res], "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      constraints="=r,l", pure=False, packed_element=1, args=[ptrs])
    return []


def l2_prefetch(ref_view):
    ref, transforms = sp.get_ref_and_transforms(ref_view, None, "l2_prefetch")
    args_flat, args_tree = tree_util.tree_flatten((ref, transforms))
    l2_prefetch_p.bind(*args_flat, args_tree=args_tree)


def cparams(nw):
    return {} if INTERPRET else {"compiler_params": plt.CompilerParams(num_warps=nw, num_stages=1)}

def load(ref, policy):
    if INTERPRET or policy is None:
        return ref[...]
    return plt.load(ref, eviction_policy=policy)

def small_kernel(x, s, w, *, work, pf_rows, pf_progs, policy, tile_rows=16, unroll=2, nw=8, asm_lines=0, asm_progs=0):
    """y = work programs' output; s updated; prefetch programs read w[:pf_rows]."""
    b, xw = x.shape
    n_s, srow = s.shape  # work programs own rows of s
    wl = w.reshape(-1, 64)  # one row per 128-byte line
    w = w.reshape(-1, 1024)  # a bitcast: Triton tiles must be powers of two
    wr, wc = w.shape
    per_prog = pf_rows // max(pf_progs, 1)
    out_cols = xw // work

    def kernel(x_ref, s_ref, w_ref, wl_ref, y_ref, s_out, flag_ref):
        p = pl.program_id(0)
        if asm_lines:
            n_progs = asm_progs or work
            per = asm_lines // n_progs
            chunk = min(per, 4096)

            def issue(q):
                for c in range(per // chunk):
                    l2_prefetch(wl_ref.at[pl.ds(q * per + c * chunk, chunk), 0])

            pl.when(p >= work if asm_progs else p < work)(lambda: issue(p - work if asm_progs else p))

        @pl.when(p < work)
        def _():
            xs = x_ref[0, pl.ds(p * out_cols, out_cols)].astype(jnp.float32)
            chunk = 1024
            acc = jnp.zeros((chunk,), jnp.float32)
            for c in range(srow // chunk):
                v = s_ref[p, pl.ds(c * chunk, chunk)]
                v2 = v * 0.999 + 1e-3
                s_out[p, pl.ds(c * chunk, chunk)] = v2
                acc = acc + v2
            tot = jnp.sum(acc)
            y_ref[0, pl.ds(p * out_cols, out_cols)] = (xs * 0.5 + tot * 1e-6).astype(y_ref.dtype)
            y_ref[1, pl.ds(p * out_cols, out_cols)] = (xs * 0.25).astype(y_ref.dtype)

        if pf_progs:
            @pl.when(p >= work)
            def _():
                q = p - work
                acc = jnp.full((wc,), -jnp.inf, jnp.float32)
                for i in range(per_prog // tile_rows):  # unrolled: every load in flight at once
                    t = load(w_ref.at[pl.ds(q * per_prog + i * tile_rows, tile_rows), :], policy)
                    acc = jnp.maximum(acc, jnp.max(t.astype(jnp.float32), axis=0))
                red = jnp.max(acc)
                @pl.when(red > 1e30)
                def _():
                    flag_ref[...] = jnp.full(flag_ref.shape, red, jnp.float32)

    full = lambda a: pl.BlockSpec(a.shape, lambda p: (0,) * a.ndim)
    flag = jax.ShapeDtypeStruct((16,), jnp.float32)
    return pl.pallas_call(
        kernel, grid=(work + pf_progs + asm_progs,),
        in_specs=[full(x), full(s), full(w), full(wl)],
        out_specs=[full(x), full(s), pl.BlockSpec((16,), lambda p: (0,))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(s.shape, s.dtype), flag],
        input_output_aliases={1: 1}, interpret=INTERPRET, **cparams(nw),
    )(x, s, w, wl)

_FIRST = [None]


def tma_prefetch(w, dep, rows, ctas):
    """A Mosaic GPU kernel that only asks the TMA unit to pull w[:rows] into L2, and exits."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    wr, wc = w.shape
    box_r, box_c = min(rows, 256), min(wc, 256)
    nbr, nbc = rows // box_r, wc // box_c
    total = nbr * nbc
    ctas = max(d for d in range(1, min(ctas, total) + 1) if total % d == 0)
    per = total // ctas
    if w is _FIRST[0]:
        print(f"  tma prefetch {rows * wc * 2 / 1e6:.1f} MB: {total} boxes of {box_r}x{box_c}, {ctas} CTAs", flush=True)

    def kernel(w_ref, dep_ref, o_ref):
        i = lax.axis_index("p")
        for k in range(per):
            b = i * per + k
            plgpu.async_prefetch(w_ref.at[pl.ds((b // nbc) * box_r, box_r), pl.ds((b % nbc) * box_c, box_c)])

    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(ctas,),
                        grid_names=("p",))
    return call(w, dep)


def asm_args(scn, w, pf_bytes, asm_progs):
    """Lines to prefetch: a power of two per program, at most pf_bytes and all of w."""
    if asm_progs < 0:
        return {}
    n = asm_progs or scn["work"]
    lines = min(int(pf_bytes // 128), w.size // 64) // n
    per = 1 << (lines.bit_length() - 1)
    if w is _FIRST[0]:
        print(f"  asm prefetch {per * n * 128 / 1e6:.1f} MB: {n} programs x {per} lines", flush=True)
    return dict(asm_lines=per * n, asm_progs=asm_progs)


def make_step(scn, pf_bytes, pf_progs, policy, gemm=True, tile_rows=16, unroll=2, nw=8, tma=0, asm_progs=-1):
    def step(carry, params):
        x, states, flags = carry
        new_states = []
        for s, w in zip(states, params):
            rows = 0
            if pf_progs and asm_progs < 0:
                total = w.size // 1024
                quantum = pf_progs * tile_rows * unroll
                rows = min(max(1, round(pf_bytes / 2048 / quantum)) * quantum, total - total % quantum)
            _FIRST[0] = params[0]
            if tma:
                t_rows = min(w.shape[0], int(pf_bytes // (w.shape[1] * 2)) // 256 * 256)
                token = tma_prefetch(w, x, t_rows, tma)
                x, token = lax.optimization_barrier((x, token))
                flags = flags + token[0] * 0
            if pf_progs and w is params[0]:
                print("  prefetch rows", rows, "of", w.size // 1024, f"= {rows * 2048 / 1e6:.1f} MB")
            y, s2, f = small_kernel(x, s, w, work=scn["work"], pf_rows=rows, pf_progs=pf_progs if rows else 0,
                                    policy=policy, tile_rows=tile_rows, unroll=unroll, nw=nw,
                                    **asm_args(scn, w, pf_bytes, asm_progs))
            new_states.append(s2)
            flags = flags + f[0]
            if not gemm:
                x = y * 0.5
                continue
            out = jnp.dot(y, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            reps = x.shape[1] // out.shape[1] if x.shape[1] >= out.shape[1] else None
            x = (jnp.tile(out, (1, reps)) if reps else out[:, :x.shape[1]]) * 0.5
        return x, tuple(new_states), flags
    return step

def run(scn, label, pf_bytes=0, pf_progs=0, policy=None, steps=10, reps=9, hot=False, **kw):
    L, xw, wr, wc = scn["L"], scn["xw"], scn["wr"], scn["wc"]
    key = jax.random.key(0)
    params = tuple(jax.random.normal(jax.random.fold_in(key, 0 if hot else i), (wr, wc), jnp.bfloat16) * 0.02 for i in range(L))
    if hot:
        params = (params[0],) * L
    states = tuple(jax.random.normal(jax.random.fold_in(key, 100 + i), (scn["work"], scn["srow"]), jnp.float32)
                   for i in range(L))
    x = jax.random.normal(jax.random.fold_in(key, 999), (2, xw), jnp.bfloat16)
    step = make_step(scn, pf_bytes, pf_progs, policy, **kw)
    loop = jax.jit(lambda c, p: lax.fori_loop(0, steps, lambda _, c: step(c, p), c), donate_argnums=0)
    carry = (x, states, jnp.zeros((), jnp.float32))
    for _ in range(2):
        carry = jax.block_until_ready(loop(carry, params))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        carry = jax.block_until_ready(loop(carry, params))
        ts.append(time.perf_counter() - t)
    us = 1e6 * float(np.median(ts)) / steps / L
    print(f"{scn['name']:3s} {label:44s} {us:8.2f} us/layer  (x sum {float(jnp.sum(carry[0].astype(jnp.float32))):.3g})", flush=True)
    return us

if __name__ == "__main__":
    if INTERPRET:
        A = dict(name="A", L=2, work=4, srow=2048, xw=256, wr=256, wc=128)
        run(A, "none"); run(A, "pf", pf_bytes=256 * 128 * 2, pf_progs=4, policy="evict_last")
        sys.exit()
    A = dict(name="A", L=12, work=32, srow=16384, xw=4096, wr=4096, wc=2048)
    B = dict(name="B", L=12, work=2, srow=2048, xw=2048, wr=2048, wc=11264)
    args = sys.argv[1:]
    which = [a for a in args if a in ("A", "B")] or ["A", "B"]
    forms = [a for a in args if a in ("loads", "tma", "asm")] or ["loads", "tma", "asm"]
    variants = []  # (label, keyword arguments of run), as timed in session 15
    if "loads" in forms:
        variants += [(f"loads {mb}MB p={p} t={t}", dict(pf_bytes=mb * 1e6, pf_progs=p, policy="evict_last",
                                                          tile_rows=t, unroll=1, nw=4))
                     for mb, p, t in ((8, 128, 8), (16.7, 128, 8), (16.7, 256, 8), (16.7, 128, 16))]
    if "tma" in forms:
        variants += [(f"tma {mb}MB ctas={c}", dict(pf_bytes=mb * 1e6, tma=c))
                     for mb, c in ((8, 32), (16.7, 32), (16.7, 128), (33, 64))]
    if "asm" in forms:
        variants += [(f"asm {mb}MB " + (f"{p} extra programs" if p else "work programs"),
                      dict(pf_bytes=mb * 1e6, asm_progs=p))
                     for mb, p in ((8.4, 0), (16.8, 0), (16.8, 64), (33.6, 0), (33.6, 128))]
    for rnd in range(2):
        for scn in (A, B):
            if scn["name"] not in which:
                continue
            run(scn, "none")
            run(scn, "none, kernel only", gemm=False)
            if rnd == 0:
                run(scn, "none, one weight for all layers (hot L2)", hot=True)
            for label, kw in variants:
                if scn["name"] == "A" and kw["pf_bytes"] > 17e6:
                    continue
                run(scn, label, **kw)
                run(scn, label + " kernel only", gemm=False, **kw)
