r"""The carry ablation under two variants, interleaved in one call: how this project compares TTFT
across XLA settings, environments or source trees.

Each round runs ``python -m experiments.carry_ablation`` once per variant as its own process
(old first in odd rounds, new first in even ones), and the table lists, run by run, the paired differences each process measured
between its policies (``carry - blind`` and the others: within one process, turn by turn) and
the policies' warm TTFT p50. Absolute TTFTs move ~20% between processes of one tree on the H200
(results/engine/engine_h200.md section 4), so the paired differences are what two variants are compared
by. On the GPU machine, from the repository root:

    # XLA's defaults (an empty XLA_FLAGS) against the graph-update flags the program sets on a GPU
    # by itself (mtp/runtime.py; results/engine/engine_h200.md section 5)
    PYTHONPATH=.:runs/pylib python3 experiments/ab_ablation.py --rounds 2 --old_env XLA_FLAGS=
    # this tree against an older revision (unpacked first: git archive REV mtp experiments configs)
    PYTHONPATH=.:runs/pylib python3 experiments/ab_ablation.py --old_tree runs/old

Writes ``ab.json`` (every run's summary) and ``ab.md`` (the table) to ``--out_dir``, after every run.
"""

from __future__ import annotations

import json
import os
import shlex

from absl import app, flags, logging

from experiments.ab_runs import (VARIANTS, define_variant_flags, output_dir, round_order, run_in_tree, variant_trees,
                                 variants_header, write_report)

FLAGS = flags.FLAGS
define_variant_flags()
flags.DEFINE_integer("rounds", 2, "Rounds; each runs both variants, the one that starts alternating.", lower_bound=1)
flags.DEFINE_string("ablation_args", "--config.num_sessions=30", "carry_ablation's arguments, for every run.")
flags.DEFINE_integer("timeout", 400, "Seconds per run.", lower_bound=1)
flags.DEFINE_string("out_dir", os.environ.get("OUT", "runs/ab_ablation"), "Where ab.json / ab.md go.")

SCRIPT = "experiments/carry_ablation.py"


def run_summary(report: dict) -> dict:
    """What one run measured: lossless or not, each policy's warm TTFT p50 and device wait, and each
    paired comparison's TTFT and wait differences (mean and 95% interval, ms)."""
    return {
        "lossless": all(report["lossless_by_variant"].values()),
        "warm_ttft_ms_p50": {n: v["warm"]["ttft_ms_p50"] for n, v in report["variants"].items() if v["warm"]["turns"]},
        "warm_wait_ms_p50": {n: v["warm"]["ttft_wait_ms_p50"] for n, v in report["variants"].items()
                             if v["warm"]["turns"]},
        "paired_ms": {f"{key} {metric}": (r["mean_diff"], *r["ci95"]) for key, cmp in report["comparisons"].items()
                      for metric, r in cmp.items() if metric in ("ttft_ms", "ttft_wait_ms")},
    }


def markdown(runs: list[dict], header: str) -> str:
    """One row per quantity, one column per variant: its runs' values in round order."""
    done = [r for r in runs if r["summary"] is not None]
    rows = {}  # row label -> (summary field, key), in the order first seen
    for r in done:
        rows.update({f"{k} (paired)": ("paired_ms", k) for k in r["summary"]["paired_ms"]})
    for r in done:
        rows.update({f"{n} warm TTFT p50": ("warm_ttft_ms_p50", n) for n in r["summary"]["warm_ttft_ms_p50"]})

    def cell(summary, field, key):
        v = summary[field].get(key)
        if v is None:
            return "—"
        return f"{v[0]:+.2f} [{v[1]:+.2f}, {v[2]:+.2f}]" if field == "paired_ms" else f"{v:.2f}"

    lines = [header, "", "| ms | " + " | ".join(f"{v} (runs in round order)" for v in VARIANTS) + " |",
             "|---|" + "---|" * len(VARIANTS)]
    for label, (field, key) in rows.items():
        cols = ["; ".join(cell(r["summary"], field, key) for r in done if r["variant"] == v) or "—" for v in VARIANTS]
        lines.append(f"| {label} | " + " | ".join(cols) + " |")
    failed = [f"{r['variant']} round {r['round']} ({r['rc']})" for r in runs if r["summary"] is None]
    lossy = [f"{r['variant']} round {r['round']}" for r in done if not r["summary"]["lossless"]]
    lines += ["", f"Failed runs: {', '.join(failed) or 'none'}. Not lossless: {', '.join(lossy) or 'none'}.", ""]
    return "\n".join(lines)


def main(argv):
    del argv
    trees, envs = variant_trees(FLAGS.old_tree, FLAGS.new_tree, FLAGS.old_env, FLAGS.new_env, SCRIPT)
    out = output_dir(FLAGS.out_dir)
    header = variants_header(trees, envs, f"`carry_ablation {FLAGS.ablation_args}`, {FLAGS.rounds} rounds, "
                                          "the first variant alternating")
    runs = []
    for rnd in range(1, FLAGS.rounds + 1):
        for variant in round_order(rnd):
            run_dir = out / f"{variant}_{rnd}"
            logging.info("round %d, %s", rnd, variant)
            argv = ["-m", "experiments.carry_ablation", *shlex.split(FLAGS.ablation_args),
                    f"--config.out_dir={run_dir}"]
            results = run_dir / "results.json"
            results.unlink(missing_ok=True)  # a results.json here is this run's, never an earlier call's
            rc = run_in_tree(trees[variant], envs[variant], argv, run_dir / "log.txt", FLAGS.timeout)
            # A run that was not lossless exits non-zero after writing its results: they are kept, and flagged.
            summary = run_summary(json.loads(results.read_text())) if results.exists() else None
            runs.append({"variant": variant, "round": rnd, "rc": rc, "summary": summary})
            write_report(out, trees, envs, markdown(runs, header), ablation_args=FLAGS.ablation_args, runs=runs)
    print((out / "ab.md").read_text())


if __name__ == "__main__":
    app.run(main)
