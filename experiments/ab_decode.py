r"""Two variants of the decode benchmark, interleaved in one run: how this project states a speed-up.

Shared GPUs drift in speed from one minute to the next, so a number
from another run is no baseline. A variant is a source tree and an environment;
``bench_decode.py`` runs for each variant in turn, the first alternating by round (``old, new, new,
old, ...``: `ab_runs.round_order`), and the table
compares the means of the rounds. Two uses, on the GPU machine from the repository root:

    # one kernel off and on, in this tree
    PYTHONPATH=. python3 experiments/ab_decode.py \
        --old_env MTP_KERNELS=attn_prologue=reference --new_env MTP_KERNELS=attn_prologue=pallas
    # this tree against an older revision, unpacked first on the machine that has git:
    #   mkdir -p runs/old && git archive REV mtp experiments configs | tar -x -C runs/old
    PYTHONPATH=. python3 experiments/ab_decode.py --old_tree runs/old

Each ``--bench`` value is one ``bench_decode.py`` invocation per variant and round (the
default: part A's decode step at batch 1 and 8, then part B's loops at batch 1). A tree
without ``assets/`` (an archive of code only) gets a link to this tree's. Writes
``ab.json`` (every run's rows) and ``ab.md`` (the table) to ``--out_dir``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import statistics

from absl import app, flags, logging

from experiments.ab_runs import (VARIANTS, define_variant_flags, output_dir, round_order, run_in_tree, variant_trees,
                                 variants_header, write_report)

FLAGS = flags.FLAGS
define_variant_flags()
flags.DEFINE_integer("rounds", 2, "Rounds; each runs every --bench for old, then new.", lower_bound=1)
flags.DEFINE_multi_string("bench", ["--parts A --batches 1,8 --decode_only --reps 7",
                                    "--parts B --batches 1 --spec_ks 2 --reps 7"],
                          "bench_decode.py arguments of one invocation (repeatable).")
flags.DEFINE_string("bench_script", "experiments/bench_decode.py", "The benchmark, relative to each tree.")
flags.DEFINE_integer("timeout", 300, "Seconds per benchmark invocation.", lower_bound=1)
flags.DEFINE_string("out_dir", os.environ.get("OUT", "runs/ab_decode"), "Where ab.json / ab.md go.")

# (row field, whether larger is faster): part A rows carry ms per step, part B rows tokens/s.
METRICS = (("ms", False), ("tokens_per_s", True))


def schedule(rounds: int, benches: list[str]) -> list[tuple[int, str, int]]:
    """``(round, variant, bench index)`` in run order: within a round every bench of one variant, then
    of the other, the variant that starts alternating from round to round (`ab_runs.round_order`)."""
    return [(r, v, i) for r in range(1, rounds + 1) for v in round_order(r) for i in range(len(benches))]


def run_bench(tree: pathlib.Path, env: dict[str, str], args: str, out: pathlib.Path,
              bench_script: str, timeout: int) -> list[dict]:
    """One benchmark invocation in ``tree``; its rows ([] when it failed: the log says why)."""
    run_in_tree(tree, env, [bench_script, *shlex.split(args), f"--out_dir={out}"], out / "log.txt", timeout)
    results = out / "results.json"  # written after every measurement: a cut run keeps its rows
    return json.loads(results.read_text())["rows"] if results.exists() else []


def summarize(runs: list[dict]) -> list[dict]:
    """Per measurement (part, what, batch): each variant's values over the rounds, and new/old speed.

    ``runs``: ``{"variant", "round", "rows"}`` records. Speed is the ratio of the means,
    oriented so that > 1 means new is faster; kernel counts and kernel time come along
    where the rows carry them.
    """
    table: dict[tuple, dict] = {}
    for run in runs:
        for row in run["rows"]:
            metric = next(((m, up) for m, up in METRICS if m in row), None)
            if metric is None or "batch" not in row:
                continue
            key = (row["part"], row["what"], row["batch"])
            entry = table.setdefault(key, {"part": key[0], "what": key[1], "batch": key[2],
                                           "metric": metric[0], "higher_is_faster": metric[1],
                                           **{v: [] for v in VARIANTS},
                                           **{f"{v}_kernels": [] for v in VARIANTS},
                                           **{f"{v}_kernel_ms": [] for v in VARIANTS}})
            entry[run["variant"]].append(row[metric[0]])
            if "kernels" in row:
                entry[f"{run['variant']}_kernels"].append(row["kernels"])
                entry[f"{run['variant']}_kernel_ms"].append(row["kernel_sum_ms"])
    for entry in table.values():
        if entry["old"] and entry["new"]:
            old, new = statistics.mean(entry["old"]), statistics.mean(entry["new"])
            entry["speed"] = new / old if entry["higher_is_faster"] else old / new
    return list(table.values())


def markdown(entries: list[dict], header: str) -> str:
    fmt = lambda xs, unit: ", ".join(f"{x:,.4g}" for x in xs) + (f" {unit}" if xs else "—")
    lines = [header, "", "| part | what | batch | old | new | new / old (speed) | kernels old / new | "
             "kernel time old / new |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        unit = "ms" if e["metric"] == "ms" else "tok/s"
        speed = f"**{e['speed']:.3f}x**" if "speed" in e else "—"
        kernels = " / ".join(str(sorted(set(e[f"{v}_kernels"]))) for v in VARIANTS) if e["old_kernels"] else "—"
        ktime = " / ".join(fmt(e[f"{v}_kernel_ms"], "ms") for v in VARIANTS) if e["old_kernel_ms"] else "—"
        lines.append(f"| {e['part']} | {e['what']} | {e['batch']} | {fmt(e['old'], unit)} | "
                     f"{fmt(e['new'], unit)} | {speed} | {kernels} | {ktime} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    trees, envs = variant_trees(FLAGS.old_tree, FLAGS.new_tree, FLAGS.old_env, FLAGS.new_env, FLAGS.bench_script)
    out = output_dir(FLAGS.out_dir)
    runs = []
    for rnd, variant, i in schedule(FLAGS.rounds, FLAGS.bench):
        logging.info("round %d, %s: %s", rnd, variant, FLAGS.bench[i])
        rows = run_bench(trees[variant], envs[variant], FLAGS.bench[i], out / f"{variant}_{rnd}_{i}",
                         FLAGS.bench_script, FLAGS.timeout)
        runs.append({"variant": variant, "round": rnd, "bench": FLAGS.bench[i], "rows": rows})
        entries = summarize(runs)
        header = variants_header(trees, envs, f"{FLAGS.rounds} rounds, interleaved")
        write_report(out, trees, envs, markdown(entries, header), runs=runs, table=entries)
    print((out / "ab.md").read_text())


if __name__ == "__main__":
    app.run(main)
