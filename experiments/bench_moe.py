"""Checks and times one layer's routed-expert FFN on a GPU: XLA's forms, the grouped-GEMM
kernels (``mtp.ops.moe.mosaic``) and tokamax, each against its floors.

Shapes: Qwen3-Next-80B-A3B (E = 512, top-10, H = 2048, I = 512) and Qwen3.5-35B-A3B
(E = 256, top-8), bf16 or Qwen's block-scaled FP8 (``--dtype``), at ``--tokens`` tokens; routing
drawn from ``--seed``, uniform over the experts or skewed (Zipf popularity, exponent ``--skew``),
k distinct experts a token, softmax weights. ``--shared`` adds each shape's shared expert (width
512, its gate value drawn per token) to every variant, so that a variant is the layer's whole FFN.

Variants: ``dense`` (every expert on every token, weighted), the reference's two sparse forms
(``mtp.ops.moe.reference``: ``gather``, the selected experts' weights gathered per pair;
``segments``, the pairs sorted into tiles of one expert, a batched GEMM over the tiles),
``mosaic`` (the kernels, ``default_config``; FP8 experts dequantized whole before them, timed) and ``mosaic:<field>=<value>/...`` for each
``--configs`` entry (those fields of ``GroupedGemmConfig`` changed), ``tokamax``
(``mtp.ops.moe.tokamax``, if it imports; its weight layout made beforehand, untimed), ``stream``
(the weight-streaming kernels of ``mtp.ops.moe.triton``, the shared expert among their pairs) and
``stream:<field>=<value>/...`` for each ``--stream_configs`` entry (fields of ``StreamConfig``),
``fp8_grouped`` (FP8 experts only: the grouped GEMMs of ``mtp.ops.moe.triton_grouped``, reading the
8-bit values) and ``fp8_grouped:<field>=<value>/...`` for each ``--fp8_grouped_configs`` entry,
``routed`` (the same kernels routing in the gate/up kernel from bf16 router logits that select the
row's experts and weights, ``mtp.ops.moe.triton.moe_stream``: what a model's decode step runs), and
``before`` (the gather form with the shared expert through `mtp.model.layers.mlp`'s GEMM layout: the
MoE layer as it ran before the shared expert joined the op). The forms without a shared expert of
their own (``gather``, ``segments``, ``mosaic``) add the op reference's (`reference.shared_expert`).
Every variant is first compared with the reference (``reference.routed_experts``, in the form
it picks) on the same inputs (relative error; a variant over ``--max_err`` is not timed).

Floors, from ceilings measured in the same run: the active bytes (distinct experts
touched x an expert's bytes) over the device-to-device copy bandwidth (bytes read plus
written, torch's ``copy_`` of 1 GiB), and the active FLOPs (``6 P H I`` for ``P = N k``
pairs) over XLA's bf16 GEMM rate at 8192^3 on random data.

Timing: CUPTI device time (the sum of one call's kernels) after a read that evicts the
L2 (``experiments.cupti``), median of ``--reps`` calls rotating through ``--weight_sets``
copies of the weights; and the wall time of back-to-back calls (median of 5 loops).

  PYTHONPATH=. python3 experiments/bench_moe.py --out_dir $OUT

Writes ``moe_bench.json`` and ``moe_bench.md`` under ``--out_dir`` after every row.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import traceback
from typing import NamedTuple

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import cupti
from experiments.ceilings import copy_bandwidth
from experiments.results_io import write_atomic, write_json
from mtp.execution import ExecutionConfig
from mtp.model import layers
from mtp.ops import fp8
from mtp.ops.moe import mosaic, reference, triton_grouped
from mtp.ops.moe import tokamax as tokamax_backend
from mtp.ops.moe import triton as stream

SHAPES = {
    "qwen3_next": dict(experts=512, top_k=10, hidden=2048, inter=512, shared=512),
    "qwen35": dict(experts=256, top_k=8, hidden=2048, inter=512, shared=512),
    "tiny": dict(experts=16, top_k=4, hidden=256, inter=128, shared=128),  # --small: a CPU check in interpret mode
}

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", os.environ.get("OUT", "/tmp/bench_moe"), "Where results go.")
flags.DEFINE_list("shapes", ["qwen3_next", "qwen35"], f"Model shapes, of {', '.join(SHAPES)}.")
flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16", "32", "256", "2048"], "Token counts N.")
flags.DEFINE_list("routings", ["uniform", "skewed"], "Routing kinds: uniform, skewed.")
flags.DEFINE_list("skewed_tokens", ["32", "256", "2048"], "Token counts the skewed routing runs at.")
flags.DEFINE_float("skew", 1.2, "Zipf exponent of the skewed routing's expert popularity.")
flags.DEFINE_list("variants", ["dense", "gather", "segments", "mosaic", "tokamax"], "Variants to run.")
flags.DEFINE_list("configs", [], "Extra mosaic configs, each GroupedGemmConfig fields over default_config's, "
                  "e.g. tile_k=128/stages=3.")
flags.DEFINE_list("fp8_grouped_configs", [], "Extra FP8 grouped-GEMM configs, each GroupedFp8Config fields "
                  "over its defaults, e.g. tile_i=128/num_warps=8.")
flags.DEFINE_list("stream_configs", [], "Extra stream configs, each StreamConfig fields over its defaults, "
                  "e.g. block_i=32/chunk=1024.")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp8"], "The experts' storage: bf16, or block-scaled FP8 (Qwen's).")
flags.DEFINE_bool("shared", False, "Add the shape's shared expert to every variant (the layer's whole FFN).")
flags.DEFINE_integer("dense_max_tokens", 256, "Time the dense form only up to this many tokens.")
flags.DEFINE_integer("gather_max_tokens", 32, "Time the gather form only up to this many tokens.")
flags.DEFINE_integer("reps", 10, "Timed calls per variant.", lower_bound=1)
flags.DEFINE_integer("weight_sets", 2, "Weight copies the timed calls rotate through.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Routing and input seed.")
flags.DEFINE_float("max_err", 2e-2, "Largest relative error to the reference a timed variant may have.")
flags.DEFINE_bool("small", False, "The tiny shape in Pallas' interpret mode, no timing: a CPU check.")


# ------------------------------------------------------------------ inputs and forms


class Routing(NamedTuple):
    """A row's routing, given (``ids [n, k]`` int32, ``weights [n, k]`` f32) and as a router's bf16
    logits ``[n, e]`` that select those experts with those weights (to bf16's precision)."""

    ids: jax.Array
    weights: jax.Array
    logits: jax.Array


def routing(rng, n, e, k, kind, skew) -> Routing:
    """k distinct experts a token (Gumbel top-k), softmax weights; the other experts' logits sit
    far below, so that the top-k's renormalised softmax is the weights."""
    log_pop = np.zeros(e) if kind == "uniform" else -skew * np.log(np.arange(1, e + 1))
    if kind not in ("uniform", "skewed"):
        raise ValueError(f"routing {kind!r}: choose uniform or skewed")
    scores = log_pop[None, :] + rng.gumbel(size=(n, e))
    ids = np.argsort(-scores, axis=1)[:, :k]
    top = rng.standard_normal((n, k))
    w = np.exp(top) / np.exp(top).sum(axis=1, keepdims=True)
    logits = np.full((n, e), -30.0) + rng.standard_normal((n, e))
    np.put_along_axis(logits, ids, top, axis=1)
    return Routing(jnp.asarray(ids, jnp.int32), jnp.asarray(w, jnp.float32), jnp.asarray(logits, jnp.bfloat16))


def make_weights(key, e, h, i, dtype=jnp.bfloat16):
    kg, ku, kd = jax.random.split(key, 3)
    gate = (jax.random.normal(kg, (e, i, h), jnp.float32) / np.sqrt(h)).astype(dtype)
    up = (jax.random.normal(ku, (e, i, h), jnp.float32) / np.sqrt(h)).astype(dtype)
    down = (jax.random.normal(kd, (e, h, i), jnp.float32) / np.sqrt(i)).astype(dtype)
    return gate, up, down


def weight_set(key, s, quantized: bool):
    """``(gate, up, down, shared_gate, shared_up, shared_down)``: the routed experts' stacks and a
    shared expert of the shape's width, bf16 or block-scaled FP8 (quantized one tensor at a time)."""
    ws = make_weights(key, s["experts"], s["hidden"], s["inter"])
    shared = tuple(w[0] for w in make_weights(jax.random.fold_in(key, 1), 1, s["hidden"], s["shared"]))
    q = (lambda w: jax.block_until_ready(fp8.quantize(w))) if quantized else (lambda w: w)
    return tuple(q(w) for w in ws + shared)


def shared_of(ws, shared_weight):
    """The weight set's shared expert with each token's gate value, or None (``shared_weight`` None)."""
    return None if shared_weight is None else reference.SharedExpert(*ws[3:6], shared_weight)


def with_shared(routed_fn):
    """A routed-only form plus the op reference's shared expert (when the row has one)."""
    def run(x, r, ws, shared_weight):
        out = routed_fn(x, r.ids, r.weights, *ws[:3])
        shared = shared_of(ws, shared_weight)
        return out if shared is None else out + reference.shared_expert(x, shared)
    return run


def before_form(x, r, ws, shared_weight):
    """The gather form, the shared expert through `layers.mlp` (its GEMM layout) and its gated add."""
    out = reference.routed_experts_gather(x, r.ids, r.weights, *ws[:3])
    if shared_weight is None:
        return out
    p = {name: {"weight": wt} for name, wt in zip(("gate_proj", "up_proj", "down_proj"), ws[3:6])}
    return out + shared_weight[:, None] * layers.mlp(p, x, ExecutionConfig()).astype(jnp.float32)


@jax.jit
def dense_form(x, ids, w, gate, up, down):
    """Every expert on every token (the reference's expert FFN over all E), weighted by the routing."""
    e = gate.shape[0]
    routing_w = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32) * w[..., None], axis=1)  # [N, E]
    y = reference.expert_ffn(jnp.broadcast_to(x, (e,) + x.shape), gate, up, down)  # [E, N, H]
    return jnp.einsum("ne,enh->nh", routing_w, y.astype(jnp.float32))


def parse_fields(text: str, cls, flag: str, convert=lambda name, value: int(value)) -> dict:
    """``"a=1/b=2"`` (a ``--flag`` entry): fields of the dataclass ``cls`` and their values."""
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for item in text.split("/"):
        name, _, value = item.partition("=")
        if name not in fields:
            raise ValueError(f"--{flag} entry {text!r}: no {cls.__name__} field {name!r}; the fields "
                             f"are {', '.join(sorted(fields))}")
        out[name] = convert(name, value)
    return out


def parse_config(text):
    """``"tile_k=128/stages=3"``: fields of ``GroupedGemmConfig`` that override ``default_config``'s."""
    def convert(name, value):
        return value if name == "layout" else (value in ("1", "true", "True")) if name == "columns_minor" else int(value)
    return parse_fields(text, mosaic.GroupedGemmConfig, "configs", convert)


def parse_stream_config(text):
    """``"block_i=32/chunk=1024"``: a ``StreamConfig`` with those fields over its defaults."""
    return stream.StreamConfig(**parse_fields(text, stream.StreamConfig, "stream_configs"))


def _mosaic(overrides, impl):
    """The grouped-GEMM kernels; FP8 experts dequantized whole first (timed), as the api hands them over."""
    def run(x, ids, w, gate, up, down):
        gate, up, down = (reference.in_dtype(t, x.dtype) for t in (gate, up, down))
        cfg = mosaic.default_config(x.shape[0], ids.shape[1], gate.shape[0], x.shape[1], gate.shape[1])
        cfg = dataclasses.replace(cfg, **overrides)
        return mosaic.routed_experts_mosaic(x, ids, w, gate, up, down, impl=impl, config=cfg)
    return run


def _tokamax(x, r, ws, shared_weight):
    """tokamax on its own weight layout (the set's entries from 6 on), the shared expert added."""
    out = tokamax_backend.routed_experts_tokamax(x, r.ids, r.weights, *ws[6:])
    shared = shared_of(ws, shared_weight)
    return out if shared is None else out + reference.shared_expert(x, shared)


def _stream(config, impl):
    return lambda x, r, ws, sw: stream.routed_experts_stream(x, r.ids, r.weights, *ws[:3], shared_of(ws, sw),
                                                             impl=impl, config=config)


def _fp8_grouped(config, impl):
    def run(x, ids, w, gate, up, down):
        return triton_grouped.routed_experts_fp8(x, ids, w, gate, up, down, impl=impl, config=config)
    return run


def _routed(impl):
    def run(x, r, ws, sw):
        router = reference.RouterLogits(r.logits, r.logits.shape[1], r.ids.shape[1], True)
        return stream.moe_stream(x, router, *ws[:3], shared_of(ws, sw), impl=impl)
    return run


def variants(n, interpret):
    """``{name: (fn(x, routing, weight_set, shared_weight), needs_tokamax_layout)}`` for N tokens."""
    impl = "interpret" if interpret else "pallas"
    out = {}
    if "dense" in FLAGS.variants and n <= FLAGS.dense_max_tokens:
        out["dense"] = (with_shared(dense_form), False)
    if "gather" in FLAGS.variants and n <= FLAGS.gather_max_tokens:
        out["gather"] = (with_shared(reference.routed_experts_gather), False)
    if "before" in FLAGS.variants and n <= FLAGS.gather_max_tokens:
        out["before"] = (before_form, False)
    if "segments" in FLAGS.variants:
        out["segments"] = (with_shared(reference.routed_experts_segments), False)
    if "mosaic" in FLAGS.variants:
        out["mosaic"] = (with_shared(_mosaic({}, impl)), False)
        for text in FLAGS.configs:
            out[f"mosaic:{text}"] = (with_shared(_mosaic(parse_config(text), impl)), False)
    if "stream" in FLAGS.variants and n <= stream.MAX_TOKENS:
        out["stream"] = (_stream(None, impl), False)
        for text in FLAGS.stream_configs:
            out[f"stream:{text}"] = (_stream(parse_stream_config(text), impl), False)
    if "fp8_grouped" in FLAGS.variants and FLAGS.dtype == "fp8":
        out["fp8_grouped"] = (with_shared(_fp8_grouped(None, impl)), False)
        for text in FLAGS.fp8_grouped_configs:
            cfg = triton_grouped.GroupedFp8Config(**parse_fields(text, triton_grouped.GroupedFp8Config,
                                                                 "fp8_grouped_configs"))
            out[f"fp8_grouped:{text}"] = (with_shared(_fp8_grouped(cfg, impl)), False)
    if "routed" in FLAGS.variants and n <= stream.MAX_TOKENS:
        out["routed"] = (_routed(impl), False)
    if "tokamax" in FLAGS.variants and not interpret and tokamax_backend.available() is None:
        out["tokamax"] = (_tokamax, True)
    return out


# ------------------------------------------------------------------ ceilings and timing


def gemm_peak():
    """bf16 FLOP/s of XLA's 8192^3 GEMM on random data."""
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(k2, (8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t, _ = cupti.median_seconds(f, [(a, b)], 10)
    return 2 * 8192 ** 3 / t


def _wall(fn, arg_sets, reps):
    for a in arg_sets[:2]:
        jax.block_until_ready(fn(*a))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = None
        for r in range(reps):
            out = fn(*arg_sets[r % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples), "wall"


def _rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# ------------------------------------------------------------------ the run


def weight_bytes(w) -> int:
    """Bytes a weight (plain or block-scaled FP8) occupies: what streaming it once reads."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(w))


def bench_row(shape_name, n, kind, weight_sets, ceilings, interpret):
    s = SHAPES[shape_name]
    e, k, h, i = s["experts"], s["top_k"], s["hidden"], s["inter"]
    rng = np.random.default_rng([FLAGS.seed, n, 0 if kind == "uniform" else 1])
    r = routing(rng, n, e, k, kind, FLAGS.skew)
    ids, w = r.ids, r.weights
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    sw = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal(n))), jnp.float32) if FLAGS.shared else None
    distinct = int(np.unique(np.asarray(ids)).size)
    ws0 = weight_sets[0]
    expert_bytes = sum(weight_bytes(wt) for wt in ws0[:3]) // e
    shared_bytes = sum(weight_bytes(wt) for wt in ws0[3:6]) if FLAGS.shared else 0
    row = dict(shape=shape_name, tokens=n, routing=kind, dtype=FLAGS.dtype, shared=FLAGS.shared, pairs=n * k,
               distinct_experts=distinct, active_bytes=distinct * expert_bytes + shared_bytes,
               active_flops=6 * n * (k + FLAGS.shared) * h * i, variants={})
    if ceilings:
        row["floor_bytes_s"] = row["active_bytes"] / ceilings["copy_bytes_per_s"]
        row["floor_flops_s"] = row["active_flops"] / ceilings["gemm_flops_per_s"]
        row["floor_s"] = max(row["floor_bytes_s"], row["floor_flops_s"])
    ref = jax.jit(reference.routed_experts)(x, ids, w, *ws0[:3], shared_of(ws0, sw))
    for name, (fn, _) in variants(n, interpret).items():
        v = row["variants"][name] = {}
        try:
            jfn = fn if interpret else jax.jit(fn)  # interpret mode is switched on eagerly, per call
            t0 = time.perf_counter()
            out = jax.block_until_ready(jfn(x, r, ws0, sw))
            v["first_call_s"] = time.perf_counter() - t0  # compile included
            v["rel_err"] = _rel_err(out, ref)
            v["finite"] = bool(np.isfinite(np.asarray(out)).all())
            if not v["finite"] or v["rel_err"] > FLAGS.max_err or interpret:
                continue
            sets = [(x, r, ws, sw) for ws in weight_sets]
            t, kernels = cupti.median_seconds(jfn, sets, FLAGS.reps)
            v["device_s"] = t
            v["kernels"] = len(kernels)
            v["kernels_ms"] = [[name_, ms] for name_, ms in kernels]
            v["wall_s"], _ = _wall(jfn, sets, FLAGS.reps)
            if ceilings:
                v["over_floor"] = t / row["floor_s"]
        except Exception as ex:  # noqa: BLE001 - a failing variant must not end the run
            traceback.print_exc()
            v["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
    return row


def render(results):
    c = results.get("ceilings") or {}
    lines = [f"# Routed-expert FFN, one layer ({results['date']}, {results['device']})", ""]
    if c:
        lines += [f"Ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s ({c['copy_method']}), "
                  f"bf16 GEMM {c['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s (XLA 8192^3).", ""]
    names = []
    for r in results["rows"]:
        names += [v for v in r["variants"] if v not in names]
    lines.append("| shape | routing | N | experts | floor us (bytes / flops) | "
                 + " | ".join(f"{v} us (x floor, kernels)" for v in names) + " |")
    lines.append("|" + "---|" * (5 + len(names)))
    for r in results["rows"]:
        floor = (f"{r['floor_bytes_s'] * 1e6:.1f} / {r['floor_flops_s'] * 1e6:.1f}"
                 if "floor_s" in r else "-")
        cells = []
        for v in names:
            d = r["variants"].get(v)
            if d is None:
                cells.append("")
            elif "device_s" in d:
                ratio = f" ({d['over_floor']:.2f}x" if "over_floor" in d else " ("
                cells.append(f"{d['device_s'] * 1e6:.1f}{ratio}, {d['kernels']} kernels)")
            elif "error" in d:
                cells.append("error")
            else:
                cells.append(f"err {d.get('rel_err', float('nan')):.1e}")
        shape = f"{r['shape']} {r.get('dtype', 'bf16')}" + (" + shared" if r.get("shared") else "")
        lines.append(f"| {shape} | {r['routing']} | {r['tokens']} | {r['distinct_experts']} | {floor} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(_):
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    interpret = FLAGS.small
    shapes = ["tiny"] if interpret else FLAGS.shapes
    results = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   device=str(jax.devices()[0].device_kind), flags=FLAGS.flags_into_string(),
                   tokamax=tokamax_backend.available() or "importable", rows=[])
    if not interpret:
        bw, method = copy_bandwidth()
        results["ceilings"] = dict(copy_bytes_per_s=bw, copy_method=method, gemm_flops_per_s=gemm_peak())
        logging.info("ceilings %s", results["ceilings"])
    for shape_name in shapes:
        s = SHAPES[shape_name]
        keys = jax.random.split(jax.random.key(FLAGS.seed), FLAGS.weight_sets)
        weight_sets = []
        for key in keys[:1 if interpret else FLAGS.weight_sets]:
            ws = weight_set(key, s, FLAGS.dtype == "fp8")
            if "tokamax" in FLAGS.variants and not interpret and tokamax_backend.available() is None:
                ws = ws + tokamax_backend.tokamax_layout(*ws[:3])
            weight_sets.append(jax.block_until_ready(ws))
        for kind in FLAGS.routings:
            tokens = FLAGS.tokens if kind == "uniform" else [t for t in FLAGS.tokens if t in FLAGS.skewed_tokens]
            for n in (int(t) for t in tokens):
                row = bench_row(shape_name, n, kind, weight_sets, results.get("ceilings"), interpret)
                results["rows"].append(row)
                write_json(os.path.join(FLAGS.out_dir, "moe_bench.json"), results)
                write_atomic(os.path.join(FLAGS.out_dir, "moe_bench.md"), render(results))
                logging.info("%s %s N=%d: %s", shape_name, kind, n,
                             {v: (d.get("device_s"), d.get("rel_err"), d.get("error")) for v, d in
                              row["variants"].items()})
        del weight_sets
    print(render(results))
    if interpret:
        bad = [(r["tokens"], v, d) for r in results["rows"] for v, d in r["variants"].items()
               if "error" in d or not d.get("finite") or d["rel_err"] > FLAGS.max_err]
        if bad:
            raise SystemExit(f"variants off the reference: {bad}")


if __name__ == "__main__":
    app.run(main)
