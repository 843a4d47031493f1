r"""The drafter-context ablation: cold, blind, rebuild, carry and the multi-slot carry.

    python -m experiments.carry_ablation [--config configs/carry_ablation.py] \
        [--config.num_sessions=-1] [--config.out_dir=...]

Serves the embedded default model's multi-turn evaluation sessions under every
drafter policy, the policies interleaved wave by wave so that their timings are
side by side (`harness.run_policies_interleaved`), plus a plain-greedy reference;
checks every policy's tokens equal the reference's, and reports per policy, split
into each session's first turn and its later turns (JSON keys ``cold`` and ``warm``):
TTFT, decode tokens/s, verify steps, accepted tokens per step, mean acceptance
length, per-position acceptance and drafter rows prefilled / adopted / appended;
with paired bootstrap 95% intervals for ``carry - blind`` and ``carry - rebuild`` (over fewer
than `analysis.MIN_BOOTSTRAP_SESSIONS` sessions, each interval says it means little). Writes
``results.json`` (with the run's provenance: commit, packages, devices, command line, config),
``results.md`` and two PNGs to ``out_dir``, and names them at the end.
"""

from __future__ import annotations

import os
import pathlib
import platform
import time

import jax
import numpy as np
from absl import app, logging

from configs import carry_ablation as config_module
from experiments import cli
from experiments.harness import (eos_id, greedy_reference, index_turns, load_experiment, lossless,
                                 lossless_reference, run_policies_interleaved)
from experiments.results_io import provenance, write_atomic, write_json
from mtp import runtime
from mtp.analysis import MIN_BOOTSTRAP_SESSIONS, interval_caveat, paired_bootstrap, summarize
from mtp.metrics import AcceptanceStats
from mtp.serving import EngineConfig
from mtp.execution import ExecutionConfig
from mtp.speculative import SpecConfig

_CONFIG = cli.define_config("configs/carry_ablation.py", "The experiment's config file; its fields are listed above.")
# The results' split of a policy's turns, as tables and plots name it: "cold" and "warm" are the
# JSON keys, which a reader of a table would take for the policy named cold.
SPLITS = {"cold": "first turn", "warm": "later turns"}
COMPARISONS = (("carry", "blind"), ("carry", "rebuild"), ("carry_multi_B2", "carry_single_B2"))


def _markdown(report) -> str:
    lines = [f"# Drafter-context ablation\n\n{report['header']}\n",
             "| variant | turns | which turns | TTFT p50 ms | decode tok/s | verify steps | accepted/step | "
             "mean acc. len | per-position acceptance | drafter rows prefilled / adopted / appended | "
             "carry outcomes (turns) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        for split, shown in SPLITS.items():
            s = v[split]
            if not s["turns"]:
                continue
            pos = " / ".join(f"{p:.3f}" for p in s["acceptance_per_position"])
            # A disarmed carry says so (DESIGN §3: configured is not armed), never "no_carry".
            outcomes = ", ".join(f"{o} {n}" for o, n in s["carry_outcomes"].items())
            lines.append(f"| {name} | {s['turns']} | {shown} | {s['ttft_ms_p50']:.1f} | {s['decode_tokens_per_s']:.1f} "
                         f"| {s['verify_steps']} | {s['accepted_per_step']:.3f} | {s['mean_acceptance_length']:.3f} "
                         f"| {pos} | {s['drafter_rows_prefilled']} / {s['drafter_rows_adopted']} / "
                         f"{s['drafter_rows_appended']} | {outcomes} |")
    lines += ["", "Paired differences over later turns, 95% CI by a bootstrap over sessions (the acceptance "
              "length pooled over verify steps, as above; TTFT and wait as means per turn):", "",
              "| comparison | metric | difference | 95% CI | turns | sessions |", "|---|---|---|---|---|---|"]
    for key, cmp in report["comparisons"].items():
        for metric, r in cmp.items():
            caveat = interval_caveat(r)
            lines.append(f"| {key} | {metric} | {r['mean_diff']:+.4f} | [{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}]"
                         f"{f' **{caveat}**' if caveat else ''} | {r['pairs']} | {r['sessions']} |")
    lines += ["", f"Lossless: {report['lossless']}", ""]
    return "\n".join(lines)


# Line styles and markers that tell the policies apart where their series coincide (blind and the
# disarmed carry_single_B2 accept alike, as do cold and rebuild).
_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P"))
PLOTS = ("acceptance_by_turn.png", "ttft.png")


def _acceptance_by_turn(per_turn) -> dict:
    """``{policy: {turn index: (pooled mean acceptance length, its standard error over sessions,
    sessions)}}``: the point pooled over the verify steps of every session's turn i, as the table
    pools; the error over the sessions' own values of it (None below two sessions)."""
    out = {}
    for name, turns in per_turn.items():
        by_idx = {}
        for (sid, i), r in turns.items():
            by_idx.setdefault(i, []).append(r.stats.acceptance)
        out[name] = {}
        for i, accs in sorted(by_idx.items()):
            own = [a.mean_acceptance_length for a in accs if a.steps]
            err = float(np.std(own, ddof=1) / np.sqrt(len(own))) if len(own) > 1 else None
            out[name][i] = (sum(accs, AcceptanceStats()).mean_acceptance_length, err, len(accs))
    return out


def _plots(report, per_turn, out: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _acceptance_by_turn(per_turn)
    names = list(series)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for k, name in enumerate(names):
        pts = series[name]
        xs = np.array(sorted(pts)) + 0.08 * (k - (len(names) - 1) / 2)  # side by side where they coincide
        ys = [pts[i][0] for i in sorted(pts)]
        errs = [np.nan if pts[i][1] is None else pts[i][1] for i in sorted(pts)]
        same = [n for n in names[:k] if [p[0] for p in series[n].values()] == ys]
        style, marker = _STYLES[k % len(_STYLES)]
        ax.errorbar(xs, ys, yerr=errs, linestyle=style, marker=marker, markersize=5, capsize=2, linewidth=1.3,
                    label=name + (f" (= {same[0]})" if same else ""))
    turns = sorted({i for pts in series.values() for i in pts})
    counts = {i: max(series[n][i][2] for n in names if i in series[n]) for i in turns}
    ax.set_xticks(turns, [f"{i}\nn={counts[i]}" for i in turns])
    ax.set_xlabel("turn index (0: the session's first turn); n = sessions with that turn")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("Acceptance by turn, per drafter policy (bars: ±1 s.e. over sessions)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(title="policy", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.savefig(out / PLOTS[0], dpi=120, bbox_inches="tight")
    plt.close(fig)

    splits = {f"{SPLITS['cold']} of a session (nothing cached)": lambda i: i == 0,
              f"{SPLITS['warm']} (prefix cached)": lambda i: i > 0}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = list(report["variants"])
    for k, (label, in_split) in enumerate(splits.items()):
        xs = np.arange(len(names)) + 0.4 * k
        ms = [[1e3 * r.stats.ttft_s for (sid, i), r in per_turn[n].items() if in_split(i)] for n in names]
        med = np.array([np.median(m) if m else np.nan for m in ms])
        q = np.array([np.percentile(m, [25, 75]) if m else [np.nan, np.nan] for m in ms])
        ax.bar(xs, med, width=0.4, yerr=[med - q[:, 0], q[:, 1] - med], capsize=3, label=label,
               hatch="//" if k else None, edgecolor="black", linewidth=0.5)
        for x, m, top in zip(xs, ms, q[:, 1]):
            if m:
                ax.annotate(f"n={len(m)}", (x, top), textcoords="offset points", xytext=(0, 2), ha="center",
                            fontsize=7)
    ax.set_xticks(np.arange(len(names)) + 0.2, names, rotation=20, fontsize=8)
    ax.set_xlabel("drafter policy")
    ax.set_ylabel("TTFT (ms): median, bars the quartiles")
    ax.set_title("Time to first token per drafter policy (n = turns)", fontsize=10)
    ax.legend(title="turns", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.savefig(out / PLOTS[1], dpi=120, bbox_inches="tight")
    plt.close(fig)


def _compare(ta, tb, keys, c) -> dict:
    """``ta - tb`` over the turns ``keys``: acceptance length, TTFT and, of the TTFT, the wait on
    the device (the rest is host work), each with its interval (`analysis.paired_bootstrap`)."""
    def side(turns, field):
        return [field(turns[k].stats) for k in keys]

    def boot(field, den=None):
        return paired_bootstrap(side(ta, field), side(tb, field), [k[0] for k in keys], c.bootstrap_samples,
                                c.seed, *((side(ta, den), side(tb, den)) if den else ()))

    return {"mean_acceptance_length": boot(lambda s: s.acceptance.accepted, lambda s: s.acceptance.steps),
            "ttft_ms": boot(lambda s: 1e3 * s.ttft_s),
            "ttft_wait_ms": boot(lambda s: 1e3 * s.ttft_wait_s)}


def main(argv):
    del argv
    c = _CONFIG.value
    settings = runtime.configure_process(c.dtype)  # before anything starts JAX's backend
    logging.info("process settings: %s", settings.describe())
    start, origin = time.time(), provenance(c)  # the code and command as the run starts
    if not c.variants:
        raise app.UsageError("--config.variants: empty; give at least one (policy, batch_slots, carry_slots)")
    marconi = c.marconi_min_tokens
    execution = ExecutionConfig.from_environ(os.environ)
    cfg, params, mesh, sessions, prompts = load_experiment(c)
    max_new = max(t.max_new_tokens for s in sessions for t in s.turns)
    spec = SpecConfig(verify_width=c.verify_width, max_new_tokens=max_new, refeed_accepted=c.refeed_accepted,
                      eos_id=eos_id(cfg))
    total = sum(len(s.turns) for s in sessions)
    reference = lossless_reference(c.verify_width)
    logging.info("lossless reference over %d sessions, %d turns: %s", len(sessions), total, reference.description)
    ref = greedy_reference(cfg, params, sessions, prompts, c, max_new, "greedy reference", total, mesh,
                           reference.plain_width, execution)
    ecfgs = {name: EngineConfig(policy=policy, batch_slots=slots, carry_slots=carry_slots,
                                max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages,
                                mtp_quant=c.mtp_quant, rebuild_output_rows=c.rebuild_output_rows,
                                marconi_min_tokens=marconi, execution=execution)
             for name, (policy, slots, carry_slots) in c.variants.items()}
    per_turn, same = {}, {}
    for name, res in run_policies_interleaved(cfg, params, sessions, prompts, spec, ecfgs, total, mesh,
                                                     stint=c.stint).items():
        per_turn[name] = index_turns(res)
        same[name] = lossless(per_turn[name], ref)
        logging.info("%s: token-identical to plain greedy: %s", name, same[name])
    variants = {}
    for name, turns in per_turn.items():
        stats = [r.stats for _, r in sorted(turns.items())]
        cold = [s for (sid, i), s in zip(sorted(turns), stats) if i == 0]
        warm = [s for (sid, i), s in zip(sorted(turns), stats) if i > 0]
        variants[name] = {"cold": summarize(cold), "warm": summarize(warm)}
    comparisons = {}
    for a, b in COMPARISONS:
        if a not in per_turn or b not in per_turn:
            continue
        keys = [k for k in sorted(ref) if k[1] > 0 and k in per_turn[a] and k in per_turn[b]]  # a lost turn has no pair
        comparisons[f"{a} - {b}"] = _compare(per_turn[a], per_turn[b], keys, c)
    ok = all(same.values())
    few = len(sessions) < MIN_BOOTSTRAP_SESSIONS
    report = {
        "header": (f"{len(sessions)} sessions, {total} turns, K={c.verify_width}, mtp_quant={c.mtp_quant}, "
                   f"weight_quant={c.weight_quant}, "
                   f"prompt_mode={c.prompt_mode}, marconi_min_tokens={marconi}, dtype={c.dtype}, "
                   f"policies interleaved by {c.stint}; "
                   f"{platform.processor() or platform.machine()} on {jax.default_backend()}"
                   f"{f' (mesh tp={c.tp} x ep={c.ep})' if mesh is not None else ''}, "
                   f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, wall {time.time() - start:.0f} s; "
                   f"{settings.describe()}"
                   + (f". **{len(sessions)} sessions are too few for the bootstrap intervals below (a bootstrap "
                      f"over sessions needs at least {MIN_BOOTSTRAP_SESSIONS}): read them as unknown, and the "
                      f"differences as this run's only.**" if few else "")),
        **origin,
        "intervals": {"min_sessions": MIN_BOOTSTRAP_SESSIONS, "sessions": len(sessions), "too_few_sessions": few},
        "process_settings": settings.as_dict(),
        "lossless_reference": reference.description,
        "lossless": (f"every policy's tokens equal those of {reference.description}" if ok else
                     f"MISMATCH: {[n for n, v in same.items() if not v]} (against {reference.description})"),
        "lossless_by_variant": same,
        "variants": variants,
        "comparisons": comparisons,
        "turns": {n: [dict(session=k[0], turn=k[1], **r.stats.as_dict()) for k, r in sorted(t.items())]
                  for n, t in per_turn.items()},
    }
    out = pathlib.Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", report)
    md = _markdown(report)
    write_atomic(out / "results.md", md)
    _plots(report, per_turn, out)
    print(md)
    cli.wrote(out, ("results.json", "results.md", *PLOTS), f"wall {time.time() - start:.0f} s")
    if not ok:
        raise SystemExit("speculative output differs from plain greedy decoding")


if __name__ == "__main__":
    cli.run(main, _CONFIG, config_module)
