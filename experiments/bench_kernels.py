"""Checks and times the project's Pallas kernels on a GPU against XLA and JAX's own kernel.

Each kernel is first compared with its pure-JAX reference on the GPU (relative
error), then timed. Timing is device time from CUPTI (the sum of the kernels one
call launches), median over many calls, each after a read that evicts the 50 MB L2
(`experiments.cupti`; without it, inputs under 50 MB were timed warm, up to 20% fast);
if CUPTI is unavailable, the mean of a back-to-back loop of calls is used, rotating
among input sets whose total exceeds the L2, and the table says so.

``--only chain`` asks what a Pallas kernel costs inside XLA's CUDA graphs: chains of tiny
ops (XLA fusions, Mosaic GPU kernels, Triton kernels, and mixes) timed by wall clock per
call and by CUPTI per kernel; the difference per op is what the graph adds around each.

``--only prefill`` times the fc op where the model runs it: one drafter append
(``mtp_head.append_rows`` on the 1.38B-shaped model of ``bench_decode.py``, batch 1, 2 and 4)
with the fc kernel and with XLA's fc, at each ``--prefill_rows`` a sequence: a full
prefill chunk (512) and the smaller buckets a carry's tail append takes (64, 128, 256).

``--only gdn`` checks and times the fused Gated DeltaNet decode step against XLA running
the model's own functions. Besides the kernels, ``--only gemv`` times XLA's own small-row GEMMs on the decode
model's projection shapes, as is and with the rows zero-padded: the measurement
behind ``mtp.model.gemm_layout.dense``'s one-row padding. ``--only merged`` times one input against
the projections the step merges (separate dots, concatenated in the trace, one weight), and
``--only ffn_chain`` the step's FFN alone (`experiments.gemm_probe`), per kernel: what the
decode step's GEMMs cost outside the step (results/kernels/kernels_h200.md, 2026-11-29);
``--only gemm_context`` the FFN's gate + up GEMM alone, after its norm, before its SiLU
product, with the down GEMM after or beside it, and in the FFN layer (which neighbour makes it
slower than alone).

  PYTHONPATH=. python3 experiments/bench_kernels.py --out_dir $OUT [--quick]
      [--only fc|prefill|pa|gemv|merged|ffn_chain|gemm_context|gdn|chain]

Writes ``kernels.json`` and ``kernels.md`` under ``--out_dir``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import time
import traceback
import warnings

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model import gemm_layout
from mtp.model.params import init_params
from mtp.model.prepared import prepare_params
from mtp.mtp_head import APPEND_BUCKETS, PREFILL_CHUNK, DrafterCache, append_rows
from mtp.ops.fc_gemm import fc_gemm_reference, fold_fc_weight, normed_embed_rows, row_mean_squares
from mtp.ops.fc_gemm import mosaic as fc_mosaic
from mtp.ops.gdn_step import gdn_step, gdn_step_reference
from mtp.ops.gdn_step.triton import gdn_steps_triton
from mtp.ops.lowering import num_sms
from mtp.ops.norms import rms_norm
from mtp.ops.paged_attention import paged_attention, paged_attention_reference
from mtp.ops.paged_attention.mosaic import paged_attention_mosaic

from experiments import cupti
from experiments.cli import require_ints
from experiments.model_shapes import BIG, SMALL
from experiments.results_io import write_atomic, write_json
from experiments.gemm_probe import ffn_program, gate_up_contexts, per_kernel_us

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Correctness plus the goal shapes only.")
flags.DEFINE_string("out_dir", os.environ.get("OUT", "/tmp/bench_kernels"), "Where results go.")
flags.DEFINE_integer("reps", 30, "Timed calls per variant.", lower_bound=1)
flags.DEFINE_integer("page_size", 16, "KV page size in tokens.", lower_bound=1)
flags.DEFINE_enum("only", "all", ["all", "fc", "prefill", "pa", "gemv", "merged", "ffn_chain", "gemm_context",
                                   "gdn", "chain"],
                  "Which kernels to check and time (gemv, merged, ffn_chain: XLA's few-row GEMMs; see above).")
flags.DEFINE_list("gemv_rows", ["1"], "Small-row GEMMs: the row counts M to time.")
flags.DEFINE_integer("pad_rows", gemm_layout.PAD_ROWS, "Small-row GEMMs: pad M up to this many rows.", lower_bound=1)
flags.DEFINE_integer("gemv_rotate_mb", None, "Small-row GEMMs: rotate the weights through copies of this "
                     "many MB in all, at most 256 copies (default: 4x L2, at most 16); a decode step of the 1.38B "
                     "model streams ~2800 MB between two reads of one weight.", lower_bound=1)
flags.DEFINE_integer("fc_max_m", None, "fc GEMM: only the rows with M up to this (default: all).", lower_bound=1)
flags.DEFINE_list("prefill_rows", [str(c) for c in APPEND_BUCKETS],
                  "Drafter prefill: rows a sequence per append_rows call (a full chunk is "
                  f"{PREFILL_CHUNK}; a carry's tail append takes the smallest bucket that holds it).")
flags.DEFINE_list("fc_shapes", None, "fc GEMM: only these M:H rows, e.g. 32:4096,2048:4096 (default: all).")
flags.DEFINE_list("pa_batches", None, "Paged attention: only these batch sizes (default: all).")
flags.DEFINE_string("pa_heads", None, "Paged attention: only this (Hq,Hkv,D), e.g. 16,2,256.")
flags.DEFINE_list("gdn_warps", [], "Fused Gated DeltaNet step: also time the kernel at these num_warps "
                  "(default: gdn_step.default_num_warps).")
flags.DEFINE_bool("small", False, "fc and gemv only, tiny shapes (Pallas interpret mode): a CPU check "
                  "that the script runs end to end (timings meaningless).")
require_ints("gemv_rows", 1, what="row counts")
require_ints("pa_batches", 1, what="batch sizes")
require_ints("gdn_warps", 1, 32, what="warps per program")
require_ints("prefill_rows", 1, PREFILL_CHUNK, what="rows a sequence per drafter append")

L2_BYTES = 50 * 2**20
ROTATE_BYTES = 4 * L2_BYTES
_CUPTI = {"ok": None}


def _copies(set_bytes, least=2, most=16, total=ROTATE_BYTES):
    """How many copies of an input set to rotate through so that together they span ``total`` bytes."""
    return max(least, min(most, math.ceil(total / set_bytes)))


def _time(fn, arg_sets, reps):
    """Median device time (s) of fn over rotating argument sets; (time, method)."""
    for a in arg_sets[:2]:
        jax.block_until_ready(fn(*a))
    if _CUPTI["ok"] is not False:
        try:
            seconds, _ = cupti.median_seconds(fn, arg_sets, reps)
            _CUPTI["ok"] = True
            return seconds, "cupti"
        except Exception as e:  # noqa: BLE001 - any profiler failure means: fall back
            logging.warning("CUPTI timing unavailable (%s); using wall-clock loops", e)
            _CUPTI["ok"] = False
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = None
        for i in range(reps):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples), "wall"


def _rel_err(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _safe(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - a failing variant must not end the run
        logging.error("%s failed: %s", getattr(fn, "__name__", fn), e)
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


# ------------------------------------------------------------------ fc GEMM


def bench_fc(m, h, reps, variants=None):
    """Checks, then times, the fc kernel path against XLA.

    "ours" is what the model runs per call: ``fc_gemm_folded`` on the load-time folded
    weight with the embed rows already normalised (for M <= SMALL_M the split-K kernel and one
    XLA fusion that sums its splits; above, the hidden rows' sum-of-squares kernel and the GEMM).
    The model normalises its embed rows inside the embedding gather, from the per-token table
    ``row_mean_squares``, so here they are made beforehand and not counted, as the XLA dot's
    normalised input is not; variant ``embed_raw`` is the form before that (both halves' norms
    in the pre-pass).
    "XLA dot" is ``jnp.dot`` alone on an input already normalised and concatenated;
    "unfused" is the reference (norm + concat + dot), what ``impl="reference"`` runs.
    """
    key = jax.random.key(m * 7 + h)
    ks = jax.random.split(key, 6)
    w_bytes = 2 * h * h * 2
    set_bytes = 2 * w_bytes + 2 * m * h * 2  # raw and folded weight
    n_sets = _copies(set_bytes, least=1, most=8)
    sets = []
    for s in range(n_sets):
        kk = jax.random.split(ks[s % 6], 5)
        e = jax.random.normal(kk[0], (m, h), jnp.bfloat16)
        hd = (2.0 * jax.random.normal(kk[1], (m, h))).astype(jnp.bfloat16)
        ne = (0.1 * jax.random.normal(kk[2], (h,))).astype(jnp.bfloat16)
        nh = (0.1 * jax.random.normal(kk[3], (h,))).astype(jnp.bfloat16)
        w = (jax.random.normal(kk[4], (h, 2 * h)) / math.sqrt(2 * h)).astype(jnp.bfloat16)
        e_n = normed_embed_rows(e, row_mean_squares(e), 1e-6)
        sets.append((e, hd, ne, nh, w, fold_fc_weight(ne, nh, w), e_n))
    eps = 1e-6
    flops = 2.0 * m * (2 * h) * h
    floor_bytes = w_bytes + 2 * m * h * 2 + m * h * 2
    res = {"M": m, "H": h, "flops": flops, "min_bytes": floor_bytes}

    ref_fn = jax.jit(lambda e, hd, ne, nh, w: fc_gemm_reference(e, hd, ne, nh, w, eps=eps))
    ref_sets = [s[:5] for s in sets]
    our_sets = [(s[0], s[6], s[1], s[5]) for s in sets]
    base_kw = {"acc": "two"} if FLAGS.small else {}  # the interpreter has no accumulator stores

    def ours(e, e_n, hd, wf, embed_normed=True, **kw):
        return fc_mosaic.fc_gemm_folded(e_n if embed_normed else e, hd, wf, eps=eps, embed_normed=embed_normed,
                                        **{**base_kw, **kw})

    want = ref_fn(*ref_sets[0])
    res["rel_err"] = _rel_err(ours(*our_sets[0]), want)
    # XLA's dot alone, on an input already normalised and concatenated (not counted).
    xs = [(jnp.concatenate([rms_norm(s[0], s[2], eps), rms_norm(s[1], s[3], eps)], -1), s[4]) for s in sets]
    dot_fn = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
    t_ours, method = _time(ours, our_sets, reps)
    t_dot, _ = _time(dot_fn, xs, reps)
    # XLA's autotuner picks the dot's tiles per compile (results/kernels/kernels_h200.md,
    # 2026-11-29 and 2026-11-30).
    res["xla_dot_config"] = re.findall(r'"triton_gemm_config":\{[^}]*\}|custom_call_target="__cublas[\w$]*"',
                                       dot_fn.lower(*xs[0]).compile().as_text())
    t_ref, _ = _time(ref_fn, ref_sets, reps)
    res.update(t_ours=t_ours, t_xla_dot=t_dot, t_xla_unfused=t_ref, timing=method)
    # Where "ours" spends its time (M > SMALL_M): the row sum-of-squares kernel alone, beside
    # XLA's own reduction of the same sums (what it replaced).
    if m > fc_mosaic.SMALL_M:
        pre_fn = jax.jit(lambda e, e_n, hd, wf: jnp.stack([lax.rsqrt(row_mean_squares(e) + eps),
                                                           lax.rsqrt(row_mean_squares(hd) + eps)]))
        res["t_row_rsqrt_xla"] = _time(pre_fn, our_sets, reps)[0]
        tc, sp, st = fc_mosaic.plan_sumsq(m, h, num_sms())
        sumsq = lambda *xs: fc_mosaic.row_sumsq(*xs, m_pad=-(-m // 128) * 128, tile_c=tc, splits=sp, stages=st)
        res["t_row_sumsq_kernel"] = _time(jax.jit(lambda e, e_n, hd, wf: sumsq(hd)), our_sets, reps)[0]
        res["t_row_sumsq_kernel_both"] = _time(jax.jit(lambda e, e_n, hd, wf: sumsq(e, hd)), our_sets, reps)[0]
    for name, kw in (variants or {}).items():
        r = _safe(lambda: (_rel_err(ours(*our_sets[0], **kw), want),
                           _time(lambda *a: ours(*a, **kw), our_sets, reps)[0]))
        res[f"variant {name}"] = r if isinstance(r, dict) else {"rel_err": r[0], "t": r[1]}
    del sets, xs, our_sets, ref_sets
    return res


def fc_variants(m, h):
    """Tile/stage alternatives timed beside the default plan."""
    raw = {"embed_raw": dict(embed_normed=False)}  # the form before the per-token embed norms, at every M
    if m >= 2048:
        v = {**raw, "two_acc_64x2_s5": dict(acc="two"), "sumsq_c128_s3": dict(sumsq=(128, None, 3)),
             "sumsq_c128_8_splits": dict(sumsq=(128, 8, 2)),
             "sumsq_c256_8_splits": dict(sumsq=(256, 8, 2)), "sumsq_1_split": dict(sumsq=(256, 1, 2)),
             "side_by_side_128x128": dict(split="n"), "stacked_64x256_s3": dict(stages=3)}
        if m == 12288 and h == 4096:
            v.update({"rescale_s3": dict(stages=3), "rescale_n64_s6": dict(tile_n=64, stages=6)})
        return v
    if m > fc_mosaic.SPLITK_MAX_M:  # a drafter-prefill chunk (512 rows a sequence): fewer tiles than SMs by default
        return {**raw, "n256": dict(tile_n=256), "n128_s4": dict(tile_n=128, stages=4), "n128_s6": dict(tile_n=128, stages=6),
                "n64_s4": dict(tile_n=64, stages=4), "n64_s6": dict(tile_n=64, stages=6),
                "n64_s8": dict(tile_n=64, stages=8), "sumsq_c128_8_splits": dict(sumsq=(128, 8, 2))}
    if m > 64:  # a carry's tail append: the split-K stream (its plan and others) beside the GEMM's
        splitk = dict(small_m=fc_mosaic.SPLITK_MAX_M)
        return {**raw, "gemm": dict(small_m=64), "splitk": splitk,
                **{f"splitk_k{k}": dict(splitk, k_splits=k) for k in (2, 4, 8, 16) if h % (k // 2 * 64) == 0},
                **({"splitk_n64": dict(splitk, tile_n=64), "splitk_n128": dict(splitk, tile_n=128)} if m <= 128 else {})}
    # The split-K path (M <= 64, the propose step): plan alternatives (tile_n, K splits, stages).
    v = {**raw, "s3": dict(stages=3), "s4": dict(stages=4)}
    if h == 2048:
        v.update({"k4": dict(k_splits=4), "k16_s4": dict(k_splits=16, stages=4),
                  "n256_k16_s3": dict(tile_n=256, k_splits=16, stages=3),
                  "n256_k8_s3": dict(tile_n=256, k_splits=8, stages=3)})
    if h == 4096:
        v.update({"k8": dict(k_splits=8), "n256_k8_s3": dict(tile_n=256, k_splits=8, stages=3),
                  "n256_k16_s3": dict(tile_n=256, k_splits=16, stages=3),
                  "n256_k4_s3": dict(tile_n=256, k_splits=4, stages=3)})
    return v


# ------------------------------------------------------------------ drafter prefill (the fc op in use)


@functools.cache
def _prefill_model():
    """The benchmark model (``model_shapes.BIG``, or ``SMALL`` with --small), random bf16 weights,
    the fc weight folded as at load."""
    cfg = ModelConfig.from_hf(SMALL if FLAGS.small else BIG)
    params = prepare_params(init_params(cfg, jax.random.key(1), jnp.bfloat16), fold_fc=True)
    return cfg, params


def bench_prefill(batch, rows, reps, page=16):
    """One drafter-prefill chunk, ``mtp_head.append_rows``, with the fc kernel and with XLA's fc.

    The fc op where the model runs it: ``rows`` pair keys a sequence (``PREFILL_CHUNK``), so
    M = batch x rows, followed by the layer's input norm, the k/v projections, k norm, RoPE
    and the page writes, which every path shares. The kernel runs as the model loads it (the
    embed rows normalised in the embedding gather from the per-token table) and, beside it,
    without the table (``t_fc_kernel_embed_raw``: both halves' norms in its pre-pass). Two
    interleaved rounds; the drafter K and V the paths write must agree to bf16 precision.
    """
    cfg, params = _prefill_model()
    blocks = rows // page + 1
    dcache = DrafterCache.create(cfg, batch, batch * blocks, page, blocks, jnp.bfloat16)
    dcache = dcache.replace(block_tables=jnp.arange(batch * blocks, dtype=jnp.int32).reshape(batch, blocks))
    sets = []
    for s in range(4):
        k1, k2 = jax.random.split(jax.random.key(10 + s))
        tokens = jax.random.randint(k1, (batch, rows), 0, cfg.vocab_size, jnp.int32)
        hiddens = (2.0 * jax.random.normal(k2, (batch, rows, cfg.hidden_size))).astype(jnp.bfloat16)
        sets.append((dcache, tokens, hiddens, jnp.zeros((batch,), jnp.int32), jnp.full((batch,), rows, jnp.int32)))
    # Jitted here without donation, so that every timed call can reuse its cache.
    raw = params.replace(fc=params.fc.replace(embed_mean_square=None))
    paths = {"t_xla_fc": ("reference", params), "t_fc_kernel": ("pallas", params),
             "t_fc_kernel_embed_raw": ("pallas", raw)}
    fns = {key: jax.jit(lambda dc, nt, hs, fk, n, impl=impl, p=p: append_rows(
        cfg, p, dc, nt, hs, fk, n, execution=ExecutionConfig.everywhere(impl))) for key, (impl, p) in paths.items()}
    ref, ker, ker_raw = (fns[key](*sets[0]).kv for key in paths)
    res = {"B": batch, "rows": rows, "M": batch * rows,
           "rel_err_k": _rel_err(ker.k[0], ref.k[0]), "rel_err_v": _rel_err(ker.v[0], ref.v[0]),
           "rel_err_k_embed_raw": _rel_err(ker_raw.k[0], ref.k[0])}
    for _ in range(2):
        for key, fn in fns.items():
            res.setdefault(key, []).append(_time(fn, sets, reps)[0])
    return res


# ------------------------------------------------------------------ small-row GEMMs (decode)

# The 1.38B Qwen3-Next-shaped model of experiments/bench_decode.py (hidden 2048):
# its per-layer projections, [N, K] = [out, in], and what each is.
GEMV_SHAPES = [(12288, 2048, "in_proj_qkvz"), (2048, 4096, "out_proj / o_proj"),
               (5632, 2048, "gate / up"), (11264, 2048, "gate+up concatenated"),
               (2048, 5632, "down"), (8192, 2048, "q_proj (+gate)"), (512, 2048, "k / v"),
               (64, 2048, "in_proj_ba"), (151936, 2048, "LM head")]


def bench_gemv(m, n, k, reps):
    """XLA's ``[M, K] @ [N, K].T`` as is vs with the rows zero-padded (``dense``'s rule).

    Weights rotate among copies that together exceed L2 several times, as the layers
    of a decode step do: a step reads every weight once.
    """
    w_bytes = n * k * 2
    if FLAGS.gemv_rotate_mb:
        n_sets = _copies(w_bytes, most=256, total=FLAGS.gemv_rotate_mb * 2**20)
    else:
        n_sets = _copies(w_bytes)
    ks = jax.random.split(jax.random.key(n + k + m), 2 * n_sets)
    sets = [(jax.random.normal(ks[2 * i], (m, k), jnp.bfloat16),
             (jax.random.normal(ks[2 * i + 1], (n, k)) / math.sqrt(k)).astype(jnp.bfloat16))
            for i in range(n_sets)]
    as_is = jax.jit(gemm_layout.linear)
    padded = jax.jit(functools.partial(gemm_layout.padded_linear, rows_to=max(m, FLAGS.pad_rows)))
    res = {"M": m, "N": n, "K": k, "w_bytes": w_bytes, "padded_to": max(m, FLAGS.pad_rows), "copies": n_sets,
           "rel_err": _rel_err(padded(*sets[0]), as_is(*sets[0]))}
    reps = max(reps, n_sets)  # every copy is read in turn
    res["t_padded"], res["timing"] = _time(padded, sets, reps)
    res["t_xla"] = _time(as_is, sets, reps)[0]
    del sets
    return res


# The decode step's projections of one input, as the 1.38B model merges them ([N, K] each).
MERGED_FAMILIES = {"gate + up": [(5632, 2048), (5632, 2048)],
                   "in_proj_qkvz + in_proj_ba": [(12288, 2048), (64, 2048)],
                   "q_proj + k_proj + v_proj": [(8192, 2048), (512, 2048), (512, 2048)]}


def bench_merged(m, family, reps):
    """One input times several weights, three ways, all XLA: separate dots (XLA's dot merger
    may join them), the weights concatenated inside the trace (``gemm_layout.dense_columns``), and
    one weight concatenated beforehand (a load-time layout). TB/s = weight bytes / time.
    """
    shapes = MERGED_FAMILIES[family]
    k = shapes[0][1]
    w_bytes = sum(n * kk * 2 for n, kk in shapes)
    n_sets = _copies(w_bytes)
    sets = []
    for i in range(n_sets):
        ks = jax.random.split(jax.random.key(1000 * i + m), len(shapes) + 1)
        ws = [(jax.random.normal(kk, s) / math.sqrt(k)).astype(jnp.bfloat16) for kk, s in zip(ks[1:], shapes)]
        sets.append((jax.random.normal(ks[0], (m, k), jnp.bfloat16), ws, jnp.concatenate(ws, axis=0)))
    variants = {
        "separate dots": (jax.jit(lambda x, ws: [gemm_layout.linear(x, w) for w in ws]), lambda s: (s[0], s[1])),
        "concatenated in the trace": (jax.jit(lambda x, ws: gemm_layout.linear(x, jnp.concatenate(ws, axis=0))),
                                      lambda s: (s[0], s[1])),
        "one weight": (jax.jit(gemm_layout.linear), lambda s: (s[0], s[2])),
    }
    res = {"M": m, "family": family, "w_bytes": w_bytes}
    for name, (fn, args) in variants.items():
        res[name] = _time(fn, [args(s) for s in sets], reps)[0]
    del sets
    return res


def bench_ffn_chain(reps, num_layers=16, m=2):
    """The decode step's FFNs alone (``ffn_program``), back to back, against one FFN alone.

    XLA's few-row GEMMs measured 20-40% slower per call inside the decode step than timed
    alone (2026-11-29), which came from the alone timings' warm L2 (results/kernels/kernels_h200.md,
    2026-11-30). The per-kernel CUPTI times compare one FFN with a chain of them, under three
    of XLA's command-buffer settings.
    """
    chain, x, ws = ffn_program(num_layers, m)
    loop_options = {k: v.replace(",WHILE,CONDITIONAL", "")
                    for k, v in ExecutionConfig(loop_graph="1").loop_compiler_options().items()}
    settings = {"XLA defaults": {}, "the decode loop's (concurrent)": loop_options,
                "no command buffers": {"xla_gpu_enable_command_buffer": ""}}
    out = {"M": m, "layers": num_layers, "w_bytes_per_layer": 3 * x.shape[1] * ws[0][2].shape[1] * 2}
    for name, opts in settings.items():
        # One layer at a time rotates through the layers' weights (together 16x the L2).
        for what, arg_sets in (("one layer", [(x, ws[i:i + 1]) for i in range(num_layers)]), ("chain", [(x, ws)])):
            fn = jax.jit(chain, compiler_options=opts)
            out[f"{name}: {what}"] = _safe(per_kernel_us, fn, arg_sets, max(reps, num_layers))
    return out


# ------------------------------------------------------------------ fused Gated DeltaNet step


def _gdn_one_step(mixed, qkvz, ba, valid, state, *rest, **kw):
    """The fused kernel on one token per sequence (decode), with kernel options ``kw`` (num_warps)."""
    y, states = gdn_steps_triton(mixed[:, None], qkvz, ba, valid[:, None], state, *rest, **kw)
    return y[:, 0], states[:, 0]


def bench_gdn(b, nk, nv, d, reps):
    """The fused decode step vs XLA running the model's own functions, one layer's worth.

    TB/s counts the f32 state read and written (the step's dominant bytes).
    """
    state_bytes = 2 * b * nv * d * d * 4
    n_sets = _copies(state_bytes)
    sets = []
    for i in range(n_sets):
        ks = jax.random.split(jax.random.key(100 * b + i), 8)
        bf = lambda x: x.astype(jnp.bfloat16)
        sets.append((bf(jax.random.normal(ks[0], (b, (2 * nk + nv) * d))),
                     bf(jax.random.normal(ks[1], (b, 2 * (nk + nv) * d))), bf(jax.random.normal(ks[2], (b, 2 * nv))),
                     jnp.ones((b,), bool),
                     0.3 * jax.random.normal(ks[4], (b, nv, d, d), jnp.float32),
                     jax.random.normal(ks[5], (nv,)), jax.random.normal(ks[6], (nv,)),
                     bf(1 + 0.1 * jax.random.normal(ks[7], (d,)))))
    kw = dict(num_k_heads=nk, eps=1e-6)
    ours = jax.jit(functools.partial(gdn_step, impl="pallas", **kw))
    ref = jax.jit(functools.partial(gdn_step_reference, **kw))
    (y, s), (y_r, s_r) = ours(*sets[0]), ref(*sets[0])
    res = {"B": b, "nk": nk, "nv": nv, "D": d, "state_bytes": state_bytes,
           "rel_err_y": _rel_err(y, y_r), "rel_err_state": _rel_err(s, s_r)}
    res["t_ours"], res["timing"] = _time(ours, sets, reps)
    res["t_xla"] = _time(ref, sets, reps)[0]
    for w in map(int, FLAGS.gdn_warps):
        res[f"t_ours_warps{w}"] = _time(jax.jit(functools.partial(_gdn_one_step, num_warps=w, **kw)), sets, reps)[0]
    return res


# ------------------------------------------------------------------ paged attention


def _pa_sets(b, ctx, nq, hq, hkv, d, page):
    pages_per_seq = ctx // page
    need = b * pages_per_seq
    page_bytes = 2 * page * hkv * d * 2  # K and V
    n_sets = _copies(need * page_bytes, least=1)
    num_pages = need * n_sets
    key = jax.random.key(b * 1000 + ctx + nq)
    ks = jax.random.split(key, 4 + n_sets)
    k_pages = jax.random.normal(ks[0], (num_pages, page, hkv, d), jnp.bfloat16)
    v_pages = jax.random.normal(ks[1], (num_pages, page, hkv, d), jnp.bfloat16)
    perm = jax.random.permutation(ks[2], num_pages).astype(jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    sets = []
    for s in range(n_sets):
        bt = perm[s * need:(s + 1) * need].reshape(b, pages_per_seq)
        q = jax.random.normal(ks[4 + s], (b, nq, hq, d), jnp.bfloat16)
        sets.append((q, k_pages, v_pages, bt, lengths))
    return sets


def bench_pa(b, ctx, nq, hq, hkv, d, page, reps, with_jax=True, split_sweep=()):
    sets = _pa_sets(b, ctx, nq, hq, hkv, d, page)
    kv_bytes = 2.0 * b * ctx * hkv * d * 2
    res = {"B": b, "ctx": ctx, "Q": nq, "Hq": hq, "Hkv": hkv, "D": d, "kv_bytes": kv_bytes}
    ref_fn = jax.jit(paged_attention_reference)
    ours = lambda *a, **kw: paged_attention_mosaic(*a, scale=None, gate=None, **kw)
    res["rel_err"] = _rel_err(ours(*sets[0]), ref_fn(*sets[0]))
    res["t_ours"], res["timing"] = _time(ours, sets, reps)
    res["t_xla_ref"] = _safe(lambda: _time(ref_fn, sets, reps)[0])
    if with_jax and nq == 1:
        def jax_kernel_run():
            from jax.experimental.pallas.ops.gpu import paged_attention as jpa

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kt = jnp.transpose(sets[0][1], (2, 0, 1, 3))
                vt = jnp.transpose(sets[0][2], (2, 0, 1, 3))
                jsets = [(s[0][:, 0], kt, vt, s[3], s[4]) for s in sets]
                fn = jax.jit(jpa.paged_attention)
                err = _rel_err(fn(*jsets[0]), ref_fn(*sets[0])[:, 0])
                t = _time(fn, jsets, reps)[0]
                del kt, vt
                return {"rel_err": err, "t": t}
        res["jax_pallas"] = _safe(jax_kernel_run)
    for name, kw in split_sweep:
        r = _safe(lambda: _time(lambda *a: ours(*a, **kw), sets, reps)[0])
        res[f"t_{name}"] = r
    del sets
    return res


def check_pa_ragged(reps):
    """Correctness on ragged lengths, partial pages, idle slots, Q > 1 and the gate."""
    out = []
    for (hq, hkv, d) in ((16, 2, 256), (32, 8, 128)):
        for nq in (1, 4):
            b, page, max_blocks = 6, FLAGS.page_size, 160
            key = jax.random.split(jax.random.key(hq + nq), 6)
            num_pages = b * max_blocks
            q = jax.random.normal(key[0], (b, nq, hq, d), jnp.bfloat16)
            g = jax.random.normal(key[5], (b, nq, hq, d), jnp.bfloat16)
            kp = jax.random.normal(key[1], (num_pages, page, hkv, d), jnp.bfloat16)
            vp = jax.random.normal(key[2], (num_pages, page, hkv, d), jnp.bfloat16)
            bt = jax.random.randint(key[3], (b, max_blocks), 0, num_pages, jnp.int32)
            lengths = jnp.array([0, 2, 17, 1000, 2047, 2560], jnp.int32)
            o = paged_attention(q, kp, vp, bt, lengths, gate=g, impl="pallas")
            r = paged_attention_reference(q, kp, vp, bt, lengths, gate=g)
            of = np.asarray(o, np.float32)
            out.append({"Hq": hq, "Hkv": hkv, "D": d, "Q": nq, "rel_err": _rel_err(o, r),
                        "finite": bool(np.isfinite(of).all()), "idle_zero": bool((of[0] == 0).all())})
    return out


# ------------------------------------------------------------------ launch chains


def _tiny_pallas(backend):
    """y = x * 1.0001 + 1 on one [8, 128] f32 block, as a one-program Pallas kernel."""
    from jax.experimental import pallas as pl

    out_type = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    if backend == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        def mosaic_body(x_ref, o_ref, smem, bar):
            plgpu.copy_gmem_to_smem(x_ref, smem, bar)
            plgpu.barrier_wait(bar)
            smem[...] = smem[...] * 1.0001 + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_ref)
            plgpu.wait_smem_to_gmem(0)

        return plgpu.kernel(mosaic_body, out_type=out_type, grid=(1,), grid_names=("g",),
                            scratch_types=dict(smem=plgpu.SMEM((8, 128), jnp.float32),
                                               bar=plgpu.Barrier(num_arrivals=1)))
    from jax.experimental.pallas import triton as pl_triton

    def triton_body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 1.0001 + 1.0

    return pl.pallas_call(triton_body, out_shape=out_type,
                          compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1))


def bench_chain(n, reps):
    """Per-op wall and kernel time of n-op chains; an optimisation barrier keeps ops apart."""
    xla = lambda x: x * 1.0001 + 1.0
    mosaic, triton = _tiny_pallas("mosaic_gpu"), _tiny_pallas("triton")
    chains = {"xla": [xla], "mosaic_gpu": [mosaic], "triton": [triton],
              "xla, mosaic_gpu": [xla, mosaic], "xla, triton": [xla, triton]}
    x0 = jnp.linspace(0.0, 1.0, 8 * 128, dtype=jnp.float32).reshape(8, 128)
    want = x0
    for _ in range(n):
        want = xla(want)
    out = []
    for name, ops in chains.items():
        def chain(x, ops=ops):
            for i in range(n):
                x = lax.optimization_barrier(ops[i % len(ops)](x))
            return x

        f = jax.jit(chain)
        r = {"chain": name, "ops": n, "rel_err": _rel_err(f(x0), want)}
        r["t_kernels"] = _time(f, [(x0,)], reps)[0]
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            y = x0
            for _ in range(reps):
                y = f(y)
            jax.block_until_ready(y)
            walls.append((time.perf_counter() - t0) / reps)
        r["t_wall"] = statistics.median(walls)
        out.append(r)
    return out


# ------------------------------------------------------------------ report


def _fmt_us(t):
    return f"{t * 1e6:.1f}" if isinstance(t, float) else "fail"


def _table(title, columns, rows, keys, cells):
    """A markdown section: ``title``, a table of ``columns``, one row per result.

    ``keys(r)``: the leading cells that name a result (kept for a failed one, followed by
    its error); ``cells(r)``: the rest of a good row.
    """
    lines = ["", f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        tail = [r["error"][:100]] if "error" in r else cells(r)
        lines.append("| " + " | ".join(str(c) for c in [*keys(r), *tail]) + " |")
    return lines


def _kernel_rows(named):
    """``{name: per_kernel_us result or error}`` as `_table` rows."""
    return [dict(v, name=k) if "error" in v else {"name": k, "kernels": v} for k, v in named.items()]


def _kernel_cells(kernels, by_time=False):
    """``per_kernel_us``'s ``{kernel: (launches, µs)}`` as one cell, in run order or costliest first."""
    items = sorted(kernels.items(), key=lambda kv: -kv[1][0] * kv[1][1]) if by_time else kernels.items()
    return "; ".join(f"{n[:40]}: {c} x {us:.1f}" for n, (c, us) in items)


def render(results):
    lines = [f"Device: {results['device']}; timing: {results.get('timing')}; date: {results['date']}"]
    lines += _table(
        "fc GEMM (fused norm + concat + dot)",
        ["M", "H", "rel err", "ours µs", "ours TFLOP/s", "XLA dot µs", "XLA norm+concat+dot µs",
         "ours / XLA dot (speed)", "ours / unfused (speed)"], results["fc"],
        lambda r: [r.get("M"), r.get("H")],
        lambda r: [f"{r['rel_err']:.1e}", _fmt_us(r["t_ours"]), f"{r['flops'] / r['t_ours'] / 1e12:.1f}",
                   _fmt_us(r["t_xla_dot"]), _fmt_us(r["t_xla_unfused"]), f"{r['t_xla_dot'] / r['t_ours']:.2f}x",
                   f"{r['t_xla_unfused'] / r['t_ours']:.2f}x"])
    var_lines = []
    for r in results["fc"]:
        for k, v in r.items():
            if k.startswith("variant ") and isinstance(v, dict):
                t = v.get("t")
                desc = (f"{_fmt_us(t)} µs ({r['t_xla_dot'] / t:.2f}x XLA dot), rel err {v['rel_err']:.1e}"
                        if isinstance(t, float) else v.get("error", "fail")[:120])
                var_lines.append(f"* M={r['M']}, H={r['H']}, {k[8:]}: {desc}")
        if r.get("xla_dot_config"):
            var_lines.append(f"* M={r['M']}, H={r['H']}, XLA dot's GEMM: {'; '.join(r['xla_dot_config'])}")
        for k, what in (("t_row_sumsq_kernel", "the hidden rows' sum-of-squares kernel alone"),
                        ("t_row_sumsq_kernel_both", "the same kernel over embed and hidden (variant embed_raw's)"),
                        ("t_row_rsqrt_xla", "XLA's row-rsqrt reduction alone (replaced)")):
            if isinstance(r.get(k), float):
                var_lines.append(f"* M={r['M']}, H={r['H']}, {what}: {_fmt_us(r[k])} µs")
    if var_lines:
        lines += ["", "fc variants and parts (default plan in the table above):", ""] + var_lines
    def pa_cells(r):
        tb = lambda t: f"{r['kv_bytes'] / t / 1e12:.2f}" if isinstance(t, float) else "fail"
        jp = r.get("jax_pallas", {})
        tj = jp.get("t") if isinstance(jp, dict) else None
        tx = r["t_xla_ref"]
        return [f"{r['Hq']},{r['Hkv']},{r['D']}", f"{r['rel_err']:.1e}", _fmt_us(r["t_ours"]), tb(r["t_ours"]),
                tb(tx), tb(tj) if tj else "-", f"{tj / r['t_ours']:.2f}x" if tj else "-",
                f"{tx / r['t_ours']:.2f}x" if isinstance(tx, float) else "-"]

    if results.get("prefill"):
        lines += _table(
            "drafter prefill chunk (`mtp_head.append_rows`): the fc kernel vs XLA's fc, two rounds",
            ["B", "rows", "M", "K, V rel err", "XLA fc µs", "fc kernel µs", "kernel / XLA fc (speed)",
             "kernel, raw embed µs", "kernel / raw-embed kernel (speed)"],
            results["prefill"], lambda r: [r["B"], r["rows"], r["M"]],
            lambda r: [f"{r['rel_err_k']:.1e}, {r['rel_err_v']:.1e}",
                       " / ".join(_fmt_us(t) for t in r["t_xla_fc"]), " / ".join(_fmt_us(t) for t in r["t_fc_kernel"]),
                       " / ".join(f"{a / b:.2f}x" for a, b in zip(r["t_xla_fc"], r["t_fc_kernel"])),
                       " / ".join(_fmt_us(t) for t in r["t_fc_kernel_embed_raw"]),
                       " / ".join(f"{a / b:.2f}x" for a, b in zip(r["t_fc_kernel_embed_raw"], r["t_fc_kernel"]))])
    lines += _table("paged attention (TB/s = K+V bytes read / time)",
                    ["B", "ctx", "Q", "Hq,Hkv,D", "rel err", "ours µs", "ours TB/s", "XLA ref TB/s",
                     "JAX Pallas TB/s", "ours / JAX", "ours / XLA"], results["pa"],
                    lambda r: [r.get("B"), r.get("ctx"), r.get("Q")], pa_cells)
    if results.get("gemv"):
        def gemv_cells(r):
            tb = lambda t: f"{r['w_bytes'] / t / 1e12:.2f}"
            return [_fmt_us(r["t_xla"]), tb(r["t_xla"]), r["padded_to"], _fmt_us(r["t_padded"]), tb(r["t_padded"]),
                    f"{r['t_xla'] / r['t_padded']:.2f}x"]

        lines += _table("small-row GEMMs, [M, K] @ [N, K].T: XLA as is vs rows zero-padded (TB/s = weight "
                        "bytes / time)", ["M", "N", "K", "what", "as is µs", "as is TB/s", "padded to", "padded µs",
                                          "padded TB/s", "padded / as is (speed)"], results["gemv"],
                        lambda r: [r["M"], r["N"], r["K"], r["what"]], gemv_cells)
    if results.get("merged"):
        def merged_cells(r):
            cell = lambda t: f"{_fmt_us(t)} ({r['w_bytes'] / t / 1e12:.2f})"
            return [cell(r[k]) for k in ("separate dots", "concatenated in the trace", "one weight")]

        lines += _table("merged projections (XLA): µs (TB/s of weight bytes)",
                        ["M", "family", "separate dots", "concatenated in the trace", "one weight"],
                        results["merged"], lambda r: [r["M"], r["family"]], merged_cells)
    if isinstance(results.get("ffn_chain"), dict) and "error" not in results["ffn_chain"]:
        r = results["ffn_chain"]
        lines += _table(f"the decode step's FFNs alone (M = {r['M']}): per-kernel µs, one layer vs {r['layers']} "
                        "layers back to back", ["XLA setting", "what", "kernel: launches x median µs"],
                        _kernel_rows({k: v for k, v in r.items() if isinstance(v, dict)}),
                        lambda row: row["name"].split(": "),
                        lambda row: [_kernel_cells(row["kernels"], by_time=True)])
    if results.get("gemm_context"):
        lines += _table("the FFN's gate + up GEMM in its contexts (`gemm_probe.gate_up_contexts`): per kernel, "
                        "launches x median µs", ["program", "kernels"], _kernel_rows(results["gemm_context"]),
                        lambda row: [row["name"]], lambda row: [_kernel_cells(row["kernels"])])
    if results.get("gdn"):
        lines += ["", "### fused Gated DeltaNet decode step (nk=16, nv=32, D=128; TB/s = state bytes / time)",
                  "", "| B | rel err y | rel err state | ours µs | ours TB/s | XLA µs | XLA TB/s | ours / XLA (speed) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["gdn"]:
            if "error" in r:
                lines.append(f"| {r['B']} | {r['error'][:100]} |")
                continue
            tb = lambda t: f"{r['state_bytes'] / t / 1e12:.2f}"
            lines.append(f"| {r['B']} | {r['rel_err_y']:.1e} | {r['rel_err_state']:.1e} | "
                         f"{_fmt_us(r['t_ours'])} | {tb(r['t_ours'])} | {_fmt_us(r['t_xla'])} | "
                         f"{tb(r['t_xla'])} | {r['t_xla'] / r['t_ours']:.2f}x |")
            lines += [f"|  | num_warps={k[len('t_ours_warps'):]} | | {_fmt_us(t)} | {tb(t)} | | | |"
                      for k, t in r.items() if k.startswith("t_ours_warps")]
    if results.get("pa_checks"):
        lines += ["", "### paged attention on ragged lengths (0, 2, 17, 1000, 2047, 2560), gated",
                  "", "| Hq,Hkv,D | Q | rel err | finite | idle slot zero |", "|---|---|---|---|---|"]
        for c in results["pa_checks"]:
            lines.append(f"| {c['Hq']},{c['Hkv']},{c['D']} | {c['Q']} | {c['rel_err']:.1e} | "
                         f"{c['finite']} | {c['idle_zero']} |")
    if results.get("extra"):
        lines += ["", "### sweeps", "", "```", json.dumps(results["extra"], indent=1), "```"]
    if isinstance(results.get("chain"), list):
        lines += ["", "### tiny-op chains inside one jitted call (per op, µs)", "",
                  "| chain | ops | rel err | wall / op | kernel time / op | wall - kernel, per op |",
                  "|---|---|---|---|---|---|"]
        for r in results["chain"]:
            n = r["ops"]
            lines.append(f"| {r['chain']} | {n} | {r['rel_err']:.1e} | {r['t_wall'] / n * 1e6:.2f} | "
                         f"{r['t_kernels'] / n * 1e6:.2f} | {(r['t_wall'] - r['t_kernels']) / n * 1e6:.2f} |")
    return "\n".join(lines)


def main(_):
    reps = FLAGS.reps
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    dev = jax.devices()[0]
    results = {"device": f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}",
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "fc": [], "pa": [], "extra": {}}
    page = FLAGS.page_size

    def save():
        results["timing"] = "cupti" if _CUPTI["ok"] else "wall"
        write_json(os.path.join(FLAGS.out_dir, "kernels.json"), results)
        write_atomic(os.path.join(FLAGS.out_dir, "kernels.md"), render(results) + "\n")

    run_pa = FLAGS.only in ("all", "pa") and not FLAGS.small
    if run_pa:
        logging.info("paged attention correctness on ragged lengths")
        results["pa_checks"] = _safe(check_pa_ragged, reps)
        if isinstance(results["pa_checks"], dict):
            results["extra"]["pa_checks_error"] = results.pop("pa_checks")
        save()

    # Goal shapes first, so that a quick run answers the goals.
    pa_shapes = [(8, 8192, 1, 32, 8, 128), (8, 8192, 4, 32, 8, 128),
                 (8, 8192, 1, 16, 2, 256), (8, 8192, 4, 16, 2, 256)]
    fc_shapes = [(8, 4096), (12288, 4096)]
    sweeps = {0: [(f"splits{n}", dict(splits=n)) for n in (2, 4, 8, 16)]
              + [("bkv64", dict(block_kv=64)), ("bkv64_s2", dict(block_kv=64, splits=2)),
                 ("bkv128_s1st", dict(stages=1))],
              2: [(f"splits{n}", dict(splits=n)) for n in (4, 16, 17, 32)]}
    if not FLAGS.quick:
        for hq, hkv, d in ((32, 8, 128), (16, 2, 256)):
            for b in (1, 8, 32):
                for ctx in (2048, 8192, 32768):
                    for nq in (1, 4):
                        if (b, ctx, nq, hq, hkv, d) not in pa_shapes:
                            pa_shapes.append((b, ctx, nq, hq, hkv, d))
        fc_shapes += [(m, h) for h in (2048, 4096) for m in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 12288)
                      if (m, h) not in fc_shapes]
    if not run_pa:
        pa_shapes = []
    if FLAGS.fc_max_m is not None:
        fc_shapes = [(m, h) for m, h in fc_shapes if m <= FLAGS.fc_max_m]
    if FLAGS.fc_shapes:
        want = [tuple(int(v) for v in shape.split(":")) for shape in FLAGS.fc_shapes]
        if any(len(w) != 2 for w in want):
            raise app.UsageError(f"--fc_shapes={','.join(FLAGS.fc_shapes)}: each entry is M:H, e.g. 32:4096")
        fc_shapes = want
    if FLAGS.pa_batches or FLAGS.pa_heads:  # a partial table: no sweeps
        heads = tuple(int(v) for v in FLAGS.pa_heads.split(",")) if FLAGS.pa_heads else None
        batches = {int(b) for b in FLAGS.pa_batches} if FLAGS.pa_batches else None
        pa_shapes = [s for s in pa_shapes if (heads is None or s[3:] == heads)
                     and (batches is None or s[0] in batches)]
        sweeps = {}
    for i, (b, ctx, nq, hq, hkv, d) in enumerate(pa_shapes):
        logging.info("paged attention B=%d ctx=%d Q=%d heads=%s", b, ctx, nq, (hq, hkv, d))
        r = _safe(bench_pa, b, ctx, nq, hq, hkv, d, page, reps, split_sweep=sweeps.get(i, ()))
        if "error" in r:
            r.update(B=b, ctx=ctx, Q=nq)
        results["pa"].append(r)
        print(json.dumps(r, default=str), flush=True)
        save()
    if FLAGS.only in ("all", "gemv"):
        gemv_shapes = [(1, 256, 128, "tiny"), (4, 200, 256, "tiny")] if FLAGS.small else [
            (int(m), n, k, what) for m in FLAGS.gemv_rows for n, k, what in GEMV_SHAPES]
        for m, n, k, what in gemv_shapes:
            logging.info("small-row GEMM M=%d N=%d K=%d (%s)", m, n, k, what)
            r = _safe(bench_gemv, m, n, k, reps)
            r.update(M=m, N=n, K=k, what=what)
            results.setdefault("gemv", []).append(r)
            print(json.dumps(r, default=str), flush=True)
            save()
    if FLAGS.only == "merged":
        for m in (1, 2, 8) if not FLAGS.small else (2,):
            for family in MERGED_FAMILIES:
                r = _safe(bench_merged, m, family, reps)
                r.update(M=m, family=family)
                results.setdefault("merged", []).append(r)
                print(json.dumps(r, default=str), flush=True)
                save()
    if FLAGS.only == "ffn_chain":
        results["ffn_chain"] = r = _safe(bench_ffn_chain, reps)
        print(json.dumps(r, default=str), flush=True)
        save()
    if FLAGS.only == "gemm_context":
        results["gemm_context"] = r = {name: _safe(per_kernel_us, fn, arg_sets, max(reps, len(arg_sets)))
                                       for name, (fn, arg_sets) in gate_up_contexts().items()}
        print(json.dumps(r, default=str), flush=True)
        save()
    if FLAGS.only in ("all", "gdn") and not FLAGS.small:
        for b in (1, 8):
            logging.info("fused Gated DeltaNet step B=%d", b)
            r = _safe(bench_gdn, b, 16, 32, 128, reps)
            r.update(B=b)
            results.setdefault("gdn", []).append(r)
            print(json.dumps(r, default=str), flush=True)
            save()
    if FLAGS.only == "chain":
        results["chain"] = _safe(bench_chain, 48, reps)
        save()
    if FLAGS.only in ("pa", "prefill", "gemv", "merged", "ffn_chain", "gemm_context", "gdn", "chain"):
        fc_shapes = []
    if FLAGS.small and FLAGS.only in ("all", "fc"):
        fc_shapes = [(8, 256), (200, 256)]
    for m, h in fc_shapes:
        logging.info("fc GEMM M=%d H=%d", m, h)
        variants = fc_variants(m, h)
        if FLAGS.small:
            variants = {"embed_raw": dict(embed_normed=False), **({"s2": dict(stages=2)} if m > 64 else {"k2": dict(k_splits=2)})}
            variants = {k: {**v, "acc": "two"} for k, v in variants.items()}
        r = _safe(bench_fc, m, h, reps, variants)
        if "error" in r:
            r.update(M=m, H=h)
        results["fc"].append(r)
        print(json.dumps(r, default=str), flush=True)
        save()
    if FLAGS.only in ("all", "prefill"):
        cases = [(1, 128)] if FLAGS.small else [(b, int(r)) for r in FLAGS.prefill_rows for b in (1, 2, 4)]
        for batch, rows in cases:
            logging.info("drafter prefill chunk B=%d x %d rows", batch, rows)
            r = _safe(bench_prefill, batch, rows, reps)
            if "error" in r:
                r.update(B=batch, rows=rows, M=batch * rows)
            results.setdefault("prefill", []).append(r)
            print(json.dumps(r, default=str), flush=True)
            save()
    save()
    print(render(results), flush=True)


def _main(argv):
    if FLAGS.small:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return main(argv)
    return main(argv)


if __name__ == "__main__":
    app.run(_main)
