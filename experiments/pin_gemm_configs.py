r"""Pins a program's GEMM configs to the candidates that run fastest in it, not in the autotuner.

XLA's GEMM autotuner times each fusion's candidate configs on buffers of its own, and its
timings do not separate the decode step's few-row GEMMs: the same HLO gets different
configs from one compile to the next, and the pick can run 20% slower in the program than
another candidate (results/kernels/kernels_h200.md, 2026-11-29). This tool measures the candidates
where they run:

1. compile the program once, dumping the autotuner's log (every candidate it timed, per
   fusion fingerprint) and its picks;
2. for r = 0 .. top_k - 1, compile with every GEMM fusion pinned to its r-th fastest
   candidate by the autotuner's own timing (``--xla_gpu_load_autotune_results_from``) and
   time each kernel of the program with CUPTI;
3. pin each fusion to the candidate whose kernel ran fastest, compile, time, and keep that
   results file: ``XLA_FLAGS=--xla_gpu_load_autotune_results_from=<out_dir>/pinned.textproto``
   then applies it to any run of the same program on the same GPU and XLA.

XLA reads ``XLA_FLAGS`` once per process and keeps autotuning results in the process, so
every compile is a subprocess of its own (``--worker``). Programs: ``ffn`` (the decode step's
FFN, `gemm_probe.ffn_program`, one layer at a time over 16 layers' weights) and
``decode`` (`bench_decode.py` part A's step on the 1.38B model).

  PYTHONPATH=. python3 experiments/pin_gemm_configs.py --program ffn|decode --out_dir $OUT [--top_k 6]
      [--reps 20] [--batches 1] [--context 2048]   (the last three are bench_decode.py's flags)

Writes ``pins.json`` (per fusion: every candidate's time in use, the autotuner's pick, the
pinned one) and ``pinned.textproto`` under ``--out_dir``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from absl import app, flags

from experiments.bench_decode import BIG, chained_verify_step, random_cache  # and its flags
from experiments.cli import refuse_flags_of
from experiments.gemm_probe import ffn_program, per_kernel_us

flags.DEFINE_enum("program", "ffn", ["ffn", "decode"], "What to compile and time.")
flags.DEFINE_integer("top_k", 6, "Candidates per GEMM fusion to time in use (the autotuner's fastest).",
                     lower_bound=1)
flags.DEFINE_string("worker", None, "Internal: compile and time once, writing per-kernel µs to this JSON file.")
FLAGS = flags.FLAGS

TRITON = "TRITON"


# ------------------------------------------------------------------ XLA's autotuning text protos


def blocks(text: str, name: str) -> list[str]:
    """The bodies of the top-level ``name { ... }`` blocks of a text proto, in order."""
    out, i = [], 0
    opener = re.compile(r"(?m)^(\s*)" + re.escape(name) + r" \{\s*$")
    while (m := opener.search(text, i)) is not None:
        depth, j = 1, m.end()
        while depth:
            k = min((p for p in (text.find("{", j), text.find("}", j)) if p >= 0), default=-1)
            if k < 0:
                raise ValueError(f"unbalanced braces after {name!r} at offset {m.start()}")
            depth += 1 if text[k] == "{" else -1
            j = k + 1
        out.append(text[m.end():j - 1])
        i = j
    return out


def field(text: str, name: str) -> str | None:
    """The first ``name: value`` of a text proto (quotes removed), or None."""
    m = re.search(r"(?m)^\s*" + re.escape(name) + r': "?([^"\n]*)', text)
    return m.group(1) if m else None


def gemm_candidates(log_text: str) -> dict[str, dict]:
    """Per GEMM fusion fingerprint: its name and its Triton candidates, fastest first by the autotuner.

    From ``--xla_gpu_dump_autotune_logs_to``: ``{fingerprint: {"fusion": name, "candidates":
    [(autotuner ns, config body), ...]}}``. Fusions without a Triton candidate (loop and
    reduction fusions, which XLA's block-level emitter tunes) are left out.
    """
    out = {}
    for prof in blocks(log_text, "instruction_profiles"):
        cands = []
        for cp in blocks(prof, "config_profiles"):
            config = blocks(cp, "config")[0]
            if field(config, "backend") == TRITON:
                cands.append((int(field(cp, "nanos")), config))
        if cands:
            hlo = field(prof, "hlo_text") or ""
            name = re.match(r"%?([\w.\-]+) =", hlo)
            out[field(prof, "hlo_fingerprint")] = {"fusion": name.group(1) if name else "?",
                                                   "candidates": sorted(cands, key=lambda c: c[0])}
    return out


def backend_version(log_text: str, backend: str = TRITON) -> str:
    for entry in blocks(log_text, "per_backend_versions"):
        if field(entry, "key") == backend:
            return field(entry, "value")
    raise ValueError(f"the autotuning log names no {backend} backend version")


def pin(results_text: str, choices: dict[str, str], version: str) -> str:
    """``results_text`` (``--xla_gpu_dump_autotune_results_to``) with the fusions in ``choices``
    (fingerprint -> config body) set to those configs, of backend ``version``."""
    entries = blocks(results_text, "entries")
    missing = set(choices) - {field(e, "hlo_fingerprint") for e in entries}
    if missing:
        raise ValueError(f"fingerprints not in the autotune results: {sorted(missing)}")
    out = []
    for entry in entries:
        fp = field(entry, "hlo_fingerprint")
        if fp in choices:
            old = blocks(entry, "optimal_config")[0]
            entry = entry.replace("optimal_config {" + old + "}", "optimal_config {" + choices[fp] + "}", 1)
            entry = re.sub(r'optimal_backend_version: "[^"]*"', f'optimal_backend_version: "{version}"', entry)
        out.append("entries {" + entry + "}\n")
    head = results_text[:results_text.index("entries {")] if "entries {" in results_text else ""
    return head + "".join(out)


def config_summary(config: str) -> str:
    """``block_m x block_n x block_k, split_k, stages, warps[, tma]`` of a Triton config body."""
    f = lambda k, d="1": field(config, k) or d
    return (f"{f('block_m')}x{f('block_n')}x{f('block_k')} split_k {f('split_k')} stages {f('num_stages')} "
            f"warps {f('num_warps')}{' tma' if f('is_tma_allowed', 'false') == 'true' else ''}")


# ------------------------------------------------------------------ one compile, timed (a subprocess)


def _program():
    """``(fn, arg_sets)`` of ``--program``, jitted."""
    import jax
    import jax.numpy as jnp

    if FLAGS.program == "ffn":
        chain, x, ws = ffn_program()
        return jax.jit(chain), [(x, ws[i:i + 1]) for i in range(len(ws))]
    from mtp.config import ModelConfig
    from mtp.model.params import init_params

    cfg = ModelConfig.from_hf(dict(BIG))
    params = init_params(cfg, jax.random.key(1), jnp.bfloat16)
    batch = int(FLAGS.batches[0])
    cache = random_cache(cfg, batch, FLAGS.context, 16, jnp.bfloat16, jax.random.key(2))
    tokens = jnp.zeros((batch, 1), jnp.int32)
    # The worker is a process of its own: it reads the MTP_* switches it inherited, once, here.
    return jax.jit(chained_verify_step(cfg, ExecutionConfig.from_environ(os.environ))), [((cache, tokens), params)]


def run_worker(path: str):
    fn, arg_sets = _program()
    times = per_kernel_us(fn, arg_sets, max(FLAGS.reps, len(arg_sets)))
    with open(path, "w") as f:
        json.dump({name: us * count for name, (count, us) in times.items()}, f)


def timed_compile(tag: str, xla_flags: str) -> dict[str, float]:
    """Compiles and times the program in a subprocess with ``xla_flags``: {kernel: µs per call}."""
    path = os.path.join(FLAGS.out_dir, f"times_{tag}.json")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip())
    cmd = [sys.executable, "-m", "experiments.pin_gemm_configs", f"--worker={path}", f"--program={FLAGS.program}",
           f"--reps={FLAGS.reps}", f"--batches={FLAGS.batches[0]}", f"--context={FLAGS.context}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {tag} compile failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.load(open(path))


def kernel_us(times: dict[str, float], fusion: str) -> float | None:
    """A fusion's kernel time from CUPTI's names (``gemm_fusion_dot.2`` runs as ``gemm_fusion_dot_2``)."""
    want = fusion.replace(".", "_")
    hits = [us for name, us in times.items() if name.replace(".", "_") == want]
    return hits[0] if hits else None


def main(argv):
    refuse_flags_of("experiments.bench_decode", {"batches", "context", "reps", "out_dir"})
    del argv
    if FLAGS.worker:
        return run_worker(FLAGS.worker)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    out = lambda name: os.path.join(FLAGS.out_dir, name)
    default = timed_compile("default", f"--xla_gpu_dump_autotune_logs_to={out('autotune_log.textproto')} "
                                       f"--xla_gpu_dump_autotune_results_to={out('default.textproto')}")
    log_text, results_text = open(out("autotune_log.textproto")).read(), open(out("default.textproto")).read()
    gemms = gemm_candidates(log_text)
    version = backend_version(log_text)
    picks = {e_fp: blocks(e, "optimal_config")[0] for e in blocks(results_text, "entries")
             if (e_fp := field(e, "hlo_fingerprint")) in gemms}
    report = {fp: {"fusion": g["fusion"], "autotuner_pick": config_summary(picks.get(fp, "")),
                   "default_us": kernel_us(default, g["fusion"]), "candidates": []} for fp, g in gemms.items()}
    for r in range(FLAGS.top_k):
        choices = {fp: g["candidates"][r][1] for fp, g in gemms.items() if r < len(g["candidates"])}
        if not choices:
            break
        path = out(f"rank{r}.textproto")
        with open(path, "w") as f:
            f.write(pin(results_text, choices, version))
        times = timed_compile(f"rank{r}", f"--xla_gpu_load_autotune_results_from={path}")
        for fp, config in choices.items():
            report[fp]["candidates"].append({"rank": r, "config": config_summary(config),
                                             "autotuner_ns": gemms[fp]["candidates"][r][0],
                                             "in_use_us": kernel_us(times, gemms[fp]["fusion"]),
                                             "program_kernel_sum_us": sum(times.values())})
        print(f"rank {r}: kernel sum {sum(times.values()):.1f} µs", flush=True)
    best = {}
    for fp, rep in report.items():
        timed = [c for c in rep["candidates"] if c["in_use_us"] is not None]
        if timed:
            top = min(timed, key=lambda c: c["in_use_us"])
            best[fp] = gemms[fp]["candidates"][top["rank"]][1]
            rep["pinned"] = top["config"]
    with open(out("pinned.textproto"), "w") as f:
        f.write(pin(results_text, best, version))
    pinned = timed_compile("pinned", f"--xla_gpu_load_autotune_results_from={out('pinned.textproto')}")
    for fp, rep in report.items():
        rep["pinned_us"] = kernel_us(pinned, rep["fusion"])
    summary = {"program": FLAGS.program, "default_kernel_sum_us": sum(default.values()),
               "pinned_kernel_sum_us": sum(pinned.values()), "fusions": report}
    with open(out("pins.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for rep in report.values():
        print(f"{rep['fusion']}: autotuner {rep['autotuner_pick']} {rep['default_us']} µs -> pinned "
              f"{rep.get('pinned')} {rep['pinned_us']} µs; in use by rank: "
              + ", ".join(f"{c['rank']}: {c['in_use_us']}" for c in rep["candidates"]))
    print(f"kernel sum: default {summary['default_kernel_sum_us']:.1f} µs, pinned "
          f"{summary['pinned_kernel_sum_us']:.1f} µs")


if __name__ == "__main__":
    FLAGS.set_default("out_dir", "runs/pin_gemm_configs")
    FLAGS.set_default("batches", ["1"])
    app.run(main)
