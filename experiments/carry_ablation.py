r"""The drafter-context ablation: cold, blind, rebuild, carry and the multi-slot carry.

    python -m experiments.carry_ablation [--config configs/carry_ablation.py] \
        [--config.num_sessions=-1] [--config.out_dir=...]

Serves the embedded default model's multi-turn evaluation sessions under every
drafter policy, the policies interleaved wave by wave so that their timings are
side by side (`harness.run_policies_interleaved`), plus a plain-greedy reference;
checks every policy's tokens equal the reference's, and reports per policy, split
into cold (first) and warm turns:
TTFT, decode tokens/s, verify steps, accepted tokens per step, mean acceptance
length, per-position acceptance and drafter rows prefilled / adopted / appended;
with paired bootstrap 95% intervals for ``carry - blind`` and ``carry - rebuild``.
Writes ``results.json``, ``results.md`` and two PNGs to ``out_dir``.
"""

from __future__ import annotations

import pathlib
import platform
import time

import jax
import numpy as np
from absl import app, logging
from ml_collections import config_flags

from experiments.harness import (STINTS, environment, eos_id, greedy_reference, index_turns, load_experiment,
                                 lossless, lossless_reference, run_policies_interleaved)
from experiments.results_io import write_atomic, write_json
from mtp import carry as carry_lib
from mtp import runtime
from mtp.analysis import paired_bootstrap, summarize
from mtp.metrics import AcceptanceStats
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig

_CONFIG = config_flags.DEFINE_config_file("config", "configs/carry_ablation.py", "Experiment config.")
COMPARISONS = (("carry", "blind"), ("carry", "rebuild"), ("carry_multi_B2", "carry_single_B2"))


def _markdown(report) -> str:
    lines = [f"# Drafter-context ablation\n\n{report['header']}\n",
             "| variant | turns | split | TTFT p50 ms | decode tok/s | verify steps | accepted/step | "
             "mean acc. len | per-position acceptance | drafter rows prefilled / adopted / appended | "
             "carry outcomes (turns) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        for split in ("cold", "warm"):
            s = v[split]
            if not s["turns"]:
                continue
            pos = " / ".join(f"{p:.3f}" for p in s["acceptance_per_position"])
            # A disarmed carry says so (DESIGN §3: configured is not armed), never "no_carry".
            outcomes = ", ".join(f"{o} {n}" for o, n in s["carry_outcomes"].items())
            lines.append(f"| {name} | {s['turns']} | {split} | {s['ttft_ms_p50']:.1f} | {s['decode_tokens_per_s']:.1f} "
                         f"| {s['verify_steps']} | {s['accepted_per_step']:.3f} | {s['mean_acceptance_length']:.3f} "
                         f"| {pos} | {s['drafter_rows_prefilled']} / {s['drafter_rows_adopted']} / "
                         f"{s['drafter_rows_appended']} | {outcomes} |")
    lines += ["", "Paired differences over warm turns, 95% CI by a bootstrap over sessions (the acceptance "
              "length pooled over verify steps, as above; TTFT and wait as means per turn):", "",
              "| comparison | metric | difference | 95% CI | turns | sessions |", "|---|---|---|---|---|---|"]
    for key, cmp in report["comparisons"].items():
        for metric, r in cmp.items():
            lines.append(f"| {key} | {metric} | {r['mean_diff']:+.4f} | [{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}] "
                         f"| {r['pairs']} | {r['sessions']} |")
    lines += ["", f"Lossless: {report['lossless']}", ""]
    return "\n".join(lines)


def _plots(report, per_turn, out: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, turns in per_turn.items():
        by_idx = {}  # pooled over the verify steps of every session's turn i, as the table pools
        for (sid, i), r in turns.items():
            by_idx[i] = by_idx.get(i, AcceptanceStats()) + r.stats.acceptance
        xs = sorted(by_idx)
        ax.plot(xs, [by_idx[x].mean_acceptance_length for x in xs], marker="o", label=name)
    ax.set_xlabel("turn index (0 = cold)")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("Acceptance by turn, per drafter policy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_turn.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(report["variants"])
    for k, split in enumerate(("cold", "warm")):
        vals = [report["variants"][n][split].get("ttft_ms_p50", np.nan) for n in names]
        ax.bar(np.arange(len(names)) + 0.4 * k, vals, width=0.4, label=split)
    ax.set_xticks(np.arange(len(names)) + 0.2, names, rotation=20, fontsize=8)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Time to first token per drafter policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)
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
    start = time.time()
    if c.marconi_min_tokens is not None and not carry_lib.set_marconi_min_tokens(c.marconi_min_tokens):
        logging.warning("the Marconi threshold was fixed before --config.marconi_min_tokens could set it")
    marconi = carry_lib.marconi_min_tokens()
    if c.stint not in STINTS:
        raise app.UsageError(f"--config.stint={c.stint!r}: give 'wave' or 'session'")
    cfg, params, mesh, sessions, prompts = load_experiment(c)
    max_new = max(t.max_new_tokens for s in sessions for t in s.turns)
    spec = SpecConfig(verify_width=c.verify_width, max_new_tokens=max_new, refeed_accepted=c.refeed_accepted,
                      eos_id=eos_id(cfg))
    total = sum(len(s.turns) for s in sessions)
    reference = lossless_reference(c.verify_width)
    logging.info("lossless reference over %d sessions, %d turns: %s", len(sessions), total, reference.description)
    ref = greedy_reference(cfg, params, sessions, prompts, c, max_new, "greedy reference", total, mesh,
                           reference.plain_width)
    ecfgs = {name: EngineConfig(policy=policy, batch_slots=slots, carry_slots=carry_slots,
                                max_context=c.max_context, num_pages=c.num_pages, drafter_pages=c.num_pages,
                                mtp_quant=c.mtp_quant, rebuild_output_rows=c.rebuild_output_rows)
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
    report = {
        "header": (f"{len(sessions)} sessions, {total} turns, K={c.verify_width}, mtp_quant={c.mtp_quant}, "
                   f"prompt_mode={c.prompt_mode}, marconi_min_tokens={marconi}, dtype={c.dtype}, "
                   f"policies interleaved by {c.stint}; "
                   f"{platform.processor() or platform.machine()} on {jax.default_backend()}"
                   f"{f' (mesh tp={c.tp} x ep={c.ep})' if mesh is not None else ''}, "
                   f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, wall {time.time() - start:.0f} s; "
                   f"{settings.describe()}"),
        "config": c.to_dict(),
        "environment": environment(),
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
    print(f"wrote {out}/results.json, results.md, acceptance_by_turn.png, ttft.png")
    if not ok:
        raise SystemExit("speculative output differs from plain greedy decoding")


if __name__ == "__main__":
    app.run(main)
