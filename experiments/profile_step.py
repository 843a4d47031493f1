r"""Where a real-shape decode step's time goes: CUPTI kernel times per kernel group, each against its floor.

    PYTHONPATH=. python3 -m experiments.profile_step --out_dir=$OUT [--model=qwen3_next_80b_a3b:fp8]
        [--widths=1,4] [--variants=base:,moe_ref:MTP_KERNELS=moe=reference] [--steps_per_call=8 --reps=7]
    PYTHONPATH=. python3 -m experiments.profile_step --model=tiny_qwen35_moe:fp8 --out_dir=/tmp/p   # a CPU check

The step is `bench_real_shape`'s: `bench_decode.chained_verify_step(cfg, execution)` (K = 1 is the
plain decode step, K > 1 a verify) in `bench_real_shape.steps_program`'s ``fori_loop``, with the routing of its own
tokens carried out (`bench_real_shape.routing_of`) for the floor; random weights made on the device
(`bench_real_shape.device_params`, a seed fixes them) and a random cache of ``--context`` positions.

Per step width and variant (a variant is a name and ``MTP_*`` variables that set its
`mtp.execution.ExecutionConfig`, e.g. ``moe_ref:MTP_KERNELS=moe=reference``; the first is the
baseline; the step is compiled with the config's decode-loop XLA options, as the loops run it), it
reports

* the step's time, the slope between calls of ``--steps`` and 4x as many steps, the variants'
  calls interleaved (`experiments.timing.interleaved_slopes`), and its active-bytes floor over the copy bandwidth
  measured in the same run (`bench_real_shape`'s floor);
* one call's CUPTI kernels (L2 cold before it, `cupti.kernel_timings`), per step: the kernel count,
  the summed kernel time and the rest of the step (launch gaps and idle), and per kernel group
  (`GROUPS`: routed experts, shared expert, routing, attention, GDN step, conv, norms, projections
  (the FP8 GEMMs), LM head, other) the µs, the launches, the bytes the group must read or write
  (`group_floors`) and the ratio of the µs to those bytes over the copy bandwidth;
* the kernels by source line (`bench_decode.kernel_sources`), the projections by weight shape,
  and the first step's kernels in launch order, so that a gap can be read kernel by kernel.

Pallas kernels are told apart by the names their ``pallas_call`` gives them (``fp8_w8a16_OUTxIN``,
``gdn_step``, ...); XLA's fusions by the model source their HLO records (where the HLO keeps none,
as XLA's GPU fusions of the MoE's gather form often do, a fusion lands in "other" under its output
shape).

Results go to ``out_dir`` as ``results.json`` (rewritten after every row) and ``results.md``. On the
H200 image ``ml_collections`` (which `bench_real_shape` imports) is missing: carry its wheel
(``.whl/``, `/work/.library/device/README.md`). The 80B FP8 weights take 76 GiB; each variant and
width is one ~20 s compile.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import cupti
from experiments.bench_decode import (abstract, chained_verify_step, greedy_loop_ms, kernel_sources, random_cache,
                                      source_of)
from experiments.bench_real_shape import (DTYPE, PAGE, ModelSpec, at_depth, cache_bytes, device_params,
                                          distinct_experts, expert_bytes, grow_memory_pool_on_demand, is_fp8,
                                          lm_head_bytes, load_model_config, steps_program, tensor_bytes,
                                          with_routing)
from experiments.ceilings import copy_bandwidth, median_seconds
from experiments.results_io import provenance, write_atomic, write_json
from experiments.timing import interleaved_slopes
from mtp.execution import ExecutionConfig
from mtp.model import params as P

FLAGS = flags.FLAGS
# --out_dir, --context (KV positions in the cache), --reps (interleaved timed calls of each length per
# variant) and --steps_per_call (steps of the shorter timed call; the longer runs 4x as many) are
# `bench_decode`'s flags.
flags.DEFINE_string("model", "qwen3_next_80b_a3b:fp8", "A `bench_real_shape.ModelSpec` entry (config[:fp8]).")
flags.DEFINE_integer("layers", 0, "Layers to run (0: the published depth).", lower_bound=0)
flags.DEFINE_list("widths", ["1", "4"], "Step widths K at batch 1: 1 is the plain decode step, K > 1 a verify.")
flags.DEFINE_list("variants", ["base:"], "name:VAR=value;VAR=value ... each built with the ExecutionConfig those MTP_* variables "
                  "set (the first is the baseline the others are compared with).")
flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
flags.DEFINE_bool("greedy_loop", False, "Also time each variant's plain greedy loop at batch 1 (ms a token after a "
                  "--context prompt, --loop_tokens and twice as many; `bench_decode.greedy_loop_ms`) and its "
                  "kernels per token: the decode step as users run it, CUDA graph and all.")
flags.DEFINE_string("tree_commit", "", "The git commit the copied tree was made from (a copy has no .git).")

GROUPS = ("routed experts", "shared expert", "routing", "attention", "GDN step", "conv", "norms",
          "projections (FP8 GEMMs)", "LM head", "other")

# Pallas kernels by the name their pallas_call gives them (a profile shows that, not the HLO op).
_NAMED = (("gdn_step", "GDN step"), ("conv_step", "conv"),
          ("add_rms_norm", "norms"), ("attn_prologue", "attention"), ("paged_attention", "attention"),
          ("mosaic_gpu", "attention"), ("moe_", "routed experts"))


def group_of(kernel: str, source: str) -> str:
    """The kernel group (``GROUPS``) of a launched kernel, from its name or its model source chain."""
    if kernel.startswith("fp8_w8a16"):  # the FP8 GEMM kernel: its caller's source (`profile_kernels`) says whose
        return "shared expert" if ("mlp:" in source or "moe:" in source) else "projections (FP8 GEMMs)"
    for prefix, group in _NAMED:
        if prefix in kernel:
            return group
    s = source
    if any(k in s for k in ("routed_experts", "expert_ffn", "take_experts", "combine:")):
        return "routed experts"
    if "route:" in s:
        return "routing"
    if "mlp:" in s or "moe:" in s:
        return "shared expert"
    if "lm_head" in s:
        return "LM head"
    if "rms_norm" in s:
        return "norms"
    if any(k in s for k in ("linear:", "w8a16", "dense_rows", "dense:", "dense_columns", "matmul:")):
        return "projections (FP8 GEMMs)"
    if any(k in s for k in ("paged_attention", "attn_prologue", "write_pages", "merge_splits")):
        return "attention"
    if "gdn_step" in s:
        return "GDN step"
    if "conv_step" in s:
        return "conv"
    return "other"


def projection_of(kernel: str, source: str) -> str:
    """Which projection a projections-group kernel serves: the GDN layer's or the attention's."""
    if kernel.startswith("fp8_w8a16"):
        return kernel.split("__")[0]
    where = "GDN" if ("gdn_layer" in source or "project:" in source or "out_project" in source) else (
        "attention" if "attention" in source else "?")
    shape = source.split("->")[-1].strip()
    return f"XLA {where} {shape}"


def group_floors(cfg, weights: str, experts: list[int], width: int, context: int) -> dict[str, int]:
    """The bytes each kernel group must move in one step of ``width`` tokens at batch 1.

    Weights read once (the routed experts its own routing selected, counted once per layer); the
    attention's KV of ``context`` positions; the Gated DeltaNet and conv states read once and
    written once per position (`bench_real_shape.cache_bytes`'s split); norms and the rest by
    their weights (their activations are a few KB).
    """
    out = dict.fromkeys(GROUPS, 0)
    for name, shape in P.param_shapes(cfg, include_mtp=False).items():
        b = tensor_bytes(name, shape, weights)
        if P.is_expert_stack(name):
            continue  # the selected experts: below
        if "shared_expert" in name:
            out["shared expert"] += b
        elif name.endswith("mlp.gate.weight"):
            out["routing"] += b
        elif "norm" in name:
            out["norms"] += b
        elif name.endswith(("conv1d.weight",)):
            out["conv"] += b
        elif name.endswith(("A_log", "dt_bias")):
            out["GDN step"] += b
        elif name.startswith("model.layers."):
            out["projections (FP8 GEMMs)"] += b
        elif name == "model.embed_tokens.weight":
            out["other"] += width * shape[1] * 2  # an embedding lookup reads its rows
    out["LM head"] = lm_head_bytes(cfg) + width * cfg.vocab_size * 4  # weight + f32 logits
    out["routed experts"] = sum(experts) * expert_bytes(cfg, weights)
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    out["attention"] = cache_bytes(cfg, 1, context, n_attn, 0)
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * 2
    out["GDN step"] += (1 + width) * n_lin * rec
    out["conv"] += (1 + width) * n_lin * conv
    return out


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, sets = text.partition(":")
    env = dict(kv.split("=", 1) for kv in filter(None, sets.split(";")))
    if bad := [k for k in env if not k.startswith("MTP_")]:
        raise SystemExit(f"--variants {text!r}: {bad} are not MTP_* variables")
    return name, env


def variant_execution(env: dict[str, str]) -> ExecutionConfig:
    """A variant's `ExecutionConfig`: this process's ``MTP_*`` variables with the variant's own on top."""
    return ExecutionConfig.from_environ({**os.environ, **env})


def profile_kernels(compiled, state, params, steps, where):
    """One call's CUPTI kernels per step: totals, groups, sources, projections, the first step's kernels in order."""
    box = []

    def call(s, p, n):
        box.append(compiled(s, p, n))
        return box[-1]

    timings = cupti.kernel_timings(call, (state, params, jnp.int32(steps)))
    state = box[-1]
    per_step = len(timings) / steps
    named = [(name, ms, source_of(where, name)) for name, ms in timings]
    # A Pallas kernel has no HLO source of its own; the FP8 GEMM's partial sum right after it does.
    fixed = []
    for i, (name, ms, src) in enumerate(named):
        if src.startswith("?") and i + 1 < len(named) and name.startswith("fp8_w8a16"):
            src = "(kernel) " + named[i + 1][2]
        fixed.append((name, ms, src))
    groups = {g: [0, 0.0] for g in GROUPS}
    sources, projections = {}, {}
    for name, ms, src in fixed:
        g = group_of(name, src)
        groups[g][0] += 1
        groups[g][1] += ms
        key = f"{name[:40]} | {src}" if src.startswith("?") else src
        e = sources.setdefault(key, [g, 0, 0.0])
        e[1] += 1
        e[2] += ms
        if g == "projections (FP8 GEMMs)":
            p = projections.setdefault(projection_of(name, src), [0, 0.0])
            p[0] += 1
            p[1] += ms
    first = fixed[:int(round(per_step))]
    prof = {
        "kernels_per_step": per_step,
        "kernel_ms_per_step": sum(ms for _, ms in timings) / steps,
        "groups": {g: {"launches": n / steps, "us": 1e3 * ms / steps} for g, (n, ms) in groups.items()},
        "by_source": sorted(([k, g, n / steps, 1e3 * ms / steps] for k, (g, n, ms) in sources.items()),
                            key=lambda r: -r[3]),
        "projections": sorted(([k, n / steps, 1e3 * ms / steps] for k, (n, ms) in projections.items()),
                              key=lambda r: -r[2]),
        "first_step_in_order": [[n[:48], round(1e3 * ms, 2), group_of(n, s), s[:120]] for n, ms, s in first],
    }
    return prof, state


def main(argv):
    del argv
    grow_memory_pool_on_demand()
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        cupti.start()  # before any CUDA graph exists, or the loop's kernels go untraced
    spec = ModelSpec.parse(FLAGS.model)
    base_cfg = load_model_config(spec.name)
    cfg = at_depth(base_cfg, FLAGS.layers or base_cfg.num_hidden_layers)
    variants = [parse_variant(v) for v in FLAGS.variants]
    widths = [int(w) for w in FLAGS.widths]
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"provenance": provenance({k: FLAGS[k].value for k in ("model", "layers", "widths", "variants", "context",
                                                                    "steps_per_call", "reps", "seed", "tree_commit")}),
            "device": str(jax.devices()[0].device_kind), "rows": [], "errors": []}
    bw, _ = copy_bandwidth((1 << 30) if on_gpu else (1 << 22))
    data["copy_bandwidth_TBps"] = bw / 1e12
    t = time.perf_counter()
    params = device_params(cfg, FLAGS.seed, weights=spec.weights)
    jax.block_until_ready(params)
    data["weights_s"] = time.perf_counter() - t
    params_abs = abstract(params)
    k_route = cfg.num_experts_per_tok
    for width in widths:
        def make_state(width=width):
            cache = random_cache(cfg, 1, FLAGS.context, PAGE, DTYPE, jax.random.key(2))
            return cache, jnp.ones((1, width), jnp.int32)

        state_abs = jax.eval_shape(make_state)
        progs, boxes = {}, {}
        for name, env in variants:
            execution = variant_execution(env)
            step, routed_abs = with_routing(chained_verify_step(cfg, execution), k_route, state_abs, params_abs)
            t = time.perf_counter()
            try:  # compiled with the decode loops' XLA options, as the loops run the step
                compiled = steps_program(step, execution.loop_compiler_options()).lower(
                    routed_abs, params_abs, jax.ShapeDtypeStruct((), jnp.int32)).compile()
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, the rest run
                data["errors"].append(f"{name} K={width} compile: {type(e).__name__}: {e}"[:3000])
                print(data["errors"][-1], flush=True)
                continue
            progs[name] = (compiled, time.perf_counter() - t)
            boxes[name] = [(make_state(), tuple(jnp.zeros(r.shape, r.dtype) for r in routed_abs[1]))]

        def call_of(name, n):
            def call():
                t = time.perf_counter()
                boxes[name][0] = jax.block_until_ready(progs[name][0](boxes[name][0], params, jnp.int32(n)))
                return time.perf_counter() - t
            return call

        n = FLAGS.steps_per_call
        slopes = interleaved_slopes({v: {n: call_of(v, n), 4 * n: call_of(v, 4 * n)} for v in progs}, FLAGS.reps)
        for name, (compiled, compile_s) in progs.items():
            experts = distinct_experts(boxes[name][0][1], width)
            floors = group_floors(cfg, spec.weights, experts, width, FLAGS.context)
            floor_bytes = sum(floors.values())
            ms, ms_call = slopes[name]
            row = dict(what="decode" if width == 1 else f"verify K={width}", width=width, variant=name,
                       env=dict(variants)[name], layers=cfg.num_hidden_layers, model=spec.label, ms=ms,
                       ms_whole_call=ms_call, floor_ms=1e3 * floor_bytes / bw,
                       ratio_to_floor=ms * 1e-3 * bw / floor_bytes,
                       distinct_experts_mean=float(np.mean(experts)), compile_s=compile_s)
            if on_gpu:
                try:
                    where = kernel_sources(compiled.as_text(), depth=14)
                    prof, boxes[name][0] = profile_kernels(compiled, boxes[name][0], params, n, where)
                    for g, e in prof["groups"].items():
                        e["bytes"] = floors[g]
                        e["floor_us"] = 1e6 * floors[g] / bw
                        e["ratio_to_floor"] = e["us"] / e["floor_us"] if floors[g] else None
                    prof["gaps_us_per_step"] = 1e3 * (ms - prof["kernel_ms_per_step"])
                    row.update(prof)
                except Exception as e:  # noqa: BLE001 - the timing stands without its profile
                    row["profile_error"] = f"{type(e).__name__}: {e}"[:500]
            data["rows"].append(row)
            write_json(out / "results.json", data)
            print({k: v for k, v in row.items() if k in ("what", "variant", "ms", "floor_ms", "ratio_to_floor",
                                                          "kernels_per_step", "kernel_ms_per_step", "gaps_us_per_step",
                                                          "profile_error")}, flush=True)
        del progs, boxes
    if FLAGS.greedy_loop:
        loop_rows(cfg, params, spec, variants, data, out)
    md = markdown(data)
    write_atomic(out / "results.md", md)
    print(md, flush=True)
    sys.stdout.flush()
    os._exit(1 if data["errors"] else 0)


def loop_rows(cfg, params, spec, variants, data, out):
    """Each variant's plain greedy loop (batch 1): ms a token, and its CUPTI kernels per token."""
    for name, env in variants:
        try:
            ms, ms_call, prof = greedy_loop_ms(cfg, params, 1, FLAGS.context, FLAGS.loop_tokens, FLAGS.reps,
                                               profile=True, execution=variant_execution(env))
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the rest run
            data["errors"].append(f"{name} greedy loop: {type(e).__name__}: {e}"[:3000])
            continue
        row = dict(what="greedy loop", variant=name, env=dict(variants)[name], model=spec.label,
                   layers=cfg.num_hidden_layers, ms_per_token=ms, ms_whole_call=ms_call, **prof)
        if "kernel_sum_ms" in prof:
            row["gaps_us_per_token"] = 1e3 * (ms - prof["kernel_sum_ms"])
        data["rows"].append(row)
        write_json(out / "results.json", data)
        print({k: v for k, v in row.items() if k != "top_kernels"}, flush=True)


def loop_markdown(rows) -> list[str]:
    """The greedy-loop rows as one table, each against the first."""
    if not rows:
        return []
    base = rows[0]["ms_per_token"]
    lines = ["## The plain greedy loop, batch 1\n", "| variant | ms a token | x the first | kernels a token | "
             "kernel µs a token | µs between kernels |", "|---|---|---|---|---|---|"]
    for r in rows:
        kernels = f"{r['kernels']:.0f}" if "kernels" in r else r.get("profile_error", "")[:60]
        kernel_us = f"{1e3 * r['kernel_sum_ms']:.0f}" if "kernel_sum_ms" in r else ""
        gaps = f"{r['gaps_us_per_token']:.0f}" if "gaps_us_per_token" in r else ""
        lines.append(f"| `{r['variant']}` {r['env'] or ''} | {r['ms_per_token']:.3f} | "
                     f"{base / r['ms_per_token']:.3f}x | {kernels} | {kernel_us} | {gaps} |")
    return lines + [""]


def markdown(data) -> str:
    prov = data["provenance"]
    lines = [f"# Decode step per kernel group\n\n{data['device']}, {prov['date_utc']}; copy bandwidth "
             f"{data['copy_bandwidth_TBps']:.2f} TB/s (read + written); tree {prov['config']['tree_commit']}\n"]
    base = {}
    lines += loop_markdown([r for r in data["rows"] if r["what"] == "greedy loop"])
    for r in data["rows"]:
        if r["what"] == "greedy loop":
            continue
        base.setdefault(r["width"], r)
        b = base[r["width"]]
        lines.append(f"## {r['model']}, {r['layers']} layers, {r['what']}, batch 1, variant `{r['variant']}` "
                     f"{r['env'] or ''}\n")
        lines.append(f"Step {r['ms']:.3f} ms ({r['ms_whole_call']:.3f} with a call's own cost), "
                     f"floor {r['floor_ms']:.3f} ms: "
                     f"**{r['ratio_to_floor']:.2f}x**; {r['distinct_experts_mean']:.1f} distinct experts a layer"
                     + (f"; {b['ms'] / r['ms']:.3f}x the speed of `{b['variant']}`" if r is not b else "") + "\n")
        if "groups" not in r:
            lines.append(f"(no profile: {r.get('profile_error', 'not a GPU')})\n")
            continue
        lines.append(f"{r['kernels_per_step']:.0f} kernels, {1e3 * r['kernel_ms_per_step']:.0f} µs of kernel time, "
                     f"{r['gaps_us_per_step']:.0f} µs between kernels, a step.\n")
        lines += ["| group | launches | µs | bytes (MB) | floor µs | x floor | µs over floor |",
                  "|---|---|---|---|---|---|---|"]
        for g, e in sorted(r["groups"].items(), key=lambda kv: -kv[1]["us"]):
            ratio = "" if e["ratio_to_floor"] is None else f"{e['ratio_to_floor']:.2f}"
            lines.append(f"| {g} | {e['launches']:.0f} | {e['us']:.0f} | {e['bytes'] / 1e6:.1f} | "
                         f"{e['floor_us']:.1f} | "
                         f"{ratio} | {e['us'] - e['floor_us']:.0f} |")
        lines.append(f"| between kernels | | {r['gaps_us_per_step']:.0f} | | | | {r['gaps_us_per_step']:.0f} |\n")
        lines += ["| projection | launches | µs |", "|---|---|---|"]
        lines += [f"| {k} | {n:.0f} | {us:.0f} |" for k, n, us in r["projections"]]
        lines += ["", "| source | group | launches | µs |", "|---|---|---|---|"]
        lines += [f"| `{k[:120]}` | {g} | {n:.0f} | {us:.1f} |" for k, g, n, us in r["by_source"][:30]]
        lines.append("")
    lines += [f"\nError: {e}" for e in data["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
