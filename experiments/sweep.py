r"""Acceptance sweeps: K, MTP precision, hidden source, refeed, D-Cut, Marconi threshold.

    python -m experiments.sweep [--config configs/sweep.py] [--config.axes.verify_width=(2,4)]

Each axis varies one knob from the baseline over the evaluation sessions (the
Marconi axis over the sessions that share only the preamble, where the threshold
decides between restoring a snapshot and recomputing with a full drafter prefill).
Every run is checked token-identical to plain greedy decoding. Writes
``results.json`` and ``results.md`` (one table per axis) to ``out_dir``.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, logging
from ml_collections import config_flags

from experiments.harness import index_turns, load_experiment, run_policy, session_subset
from mtp.analysis import summarize
from mtp.data.sessions import load_sessions
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sweep.py", "Sweep config.")


def _setting(c, cfg, axis, value):
    knobs = dict(verify_width=c.verify_width, mtp_quant=c.mtp_quant, refeed_accepted=c.refeed_accepted,
                 draft_conf_tau=0.0, marconi_min_tokens=c.marconi_min_tokens, mtp_hidden_source=cfg.mtp_hidden_source)
    knobs[axis] = value
    return knobs


def main(argv):
    del argv
    c = _CONFIG.value
    start = time.time()
    cfg0, params, sessions, prompts = load_experiment(c)
    preamble_only = session_subset(load_sessions(c.preamble_only_sessions), c.num_preamble_only, "num_preamble_only")
    tables = {}
    for axis, values in c.axes.items():
        work = preamble_only if axis == "marconi_min_tokens" else sessions
        total = sum(len(s.turns) for s in work)
        max_new = max(t.max_new_tokens for s in work for t in s.turns)
        ref_spec = SpecConfig(max_new_tokens=max_new, eos_id=cfg0.eos_token_id if cfg0.eos_token_id is not None else -1)
        ref = index_turns(run_policy(cfg0, params, work, prompts, ref_spec,
                               EngineConfig(policy="cold", speculative=False, max_context=c.max_context,
                                            num_pages=c.num_pages), f"{axis} ref", total))
        rows = []
        for value in values:
            k = _setting(c, cfg0, axis, value)
            cfg = cfg0.replace(mtp_hidden_source=k["mtp_hidden_source"])
            spec = SpecConfig(verify_width=k["verify_width"], max_new_tokens=max_new,
                              refeed_accepted=k["refeed_accepted"], draft_conf_tau=k["draft_conf_tau"],
                              eos_id=ref_spec.eos_id)
            ecfg = EngineConfig(policy=c.policy, max_context=c.max_context, num_pages=c.num_pages,
                                drafter_pages=c.num_pages, mtp_quant=k["mtp_quant"],
                                marconi_min_tokens=k["marconi_min_tokens"])
            turns = index_turns(run_policy(cfg, params, work, prompts, spec, ecfg, f"{axis}={value}", total))
            same = turns.keys() == ref.keys() and all(turns[t].output == ref[t].output for t in ref)
            stats = [r.stats for r in turns.values()]
            rows.append({"value": value, "lossless": same, "all": summarize(stats),
                         "warm": summarize([s for (sid, i), s in zip(turns, stats) if i > 0])})
            logging.info("%s=%s lossless=%s", axis, value, same)
        tables[axis] = rows
    out = pathlib.Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{len(sessions)} sessions (+{len(preamble_only)} preamble-only for the Marconi axis), policy={c.policy}, "
              f"baseline K={c.verify_width} {c.mtp_quant}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"wall {time.time() - start:.0f} s")
    (out / "results.json").write_text(json.dumps({"header": header, "config": c.to_dict(), "tables": tables},
                                                 indent=1, default=float))
    lines = [f"# Acceptance sweeps\n\n{header}\n"]
    for axis, rows in tables.items():
        lines += [f"\n## {axis}\n", "| value | lossless | TTFT p50 ms | decode tok/s | mean acc. len | "
                  "per-position acceptance | draft acceptance rate | paths |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            a = r["all"]
            pos = " / ".join(f"{p:.3f}" for p in a["acceptance_per_position"])
            lines.append(f"| {r['value']} | {r['lossless']} | {a['ttft_ms_p50']:.1f} | {a['decode_tokens_per_s']:.1f} "
                         f"| {a['mean_acceptance_length']:.3f} | {pos} | {a['draft_acceptance_rate']:.3f} | {a['paths']} |")
    md = "\n".join(lines) + "\n"
    (out / "results.md").write_text(md)
    print(md)
    if not all(r["lossless"] for rows in tables.values() for r in rows):
        raise SystemExit("a sweep setting's output differs from plain greedy decoding")


if __name__ == "__main__":
    app.run(main)
