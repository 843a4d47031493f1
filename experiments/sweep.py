r"""Acceptance sweeps: K, MTP precision, hidden source, refeed, output rows rebuilt, D-Cut, Marconi threshold.

    python -m experiments.sweep [--config configs/sweep.py] [--config.axes.verify_width=(2,4)] \
        [--config.only=verify_width] [--config.axes.mtp_quant='()']

Each axis varies one knob from the baseline over the evaluation sessions (the
Marconi axis over the sessions that share only the preamble, where the threshold
decides between restoring a snapshot and recomputing with a full drafter prefill).
Every run is checked token-identical to plain greedy decoding. Every axis and value
is checked before the first run (against `configs.sweep.FIELDS`). An axis set to ``()`` is not
swept; ``--config.only`` names the axes to sweep alone. ``results.json`` (with the run's
provenance) and ``results.md`` (one table per axis) go to ``out_dir`` after each axis, so a run cut
short keeps the axes it finished; the last line names them.
"""

from __future__ import annotations

import os
import pathlib
import time

from absl import app, logging

from configs import sweep as config_module
from experiments import cli
from experiments.harness import (eos_id, greedy_reference, index_turns, load_experiment, lossless,
                                 lossless_reference, run_policy, session_subset)
from experiments.results_io import provenance, write_atomic, write_json
from mtp import runtime
from mtp.analysis import summarize
from mtp.data.sessions import load_sessions
from mtp.serving import EngineConfig
from mtp.execution import ExecutionConfig
from mtp.speculative import SpecConfig

_CONFIG = cli.define_config("configs/sweep.py", "The sweep's config file; its fields are listed above.")


def _baseline(c, cfg) -> dict:
    """Every knob an axis may vary (`configs.sweep.AXES`), at the value it holds while the other
    axes vary."""
    return dict(verify_width=c.verify_width, mtp_quant=c.mtp_quant, refeed_accepted=c.refeed_accepted,
                rebuild_output_rows=c.rebuild_output_rows,
                draft_conf_tau=0.0, marconi_min_tokens=c.marconi_min_tokens,
                mtp_hidden_source=cfg.mtp_hidden_source)


def _setting(c, cfg0, axis, value, max_new, execution: ExecutionConfig):
    """The model config, SpecConfig and EngineConfig of one run: built for every run before the
    first starts (the values were checked against `configs.sweep.FIELDS`; a rule of the library
    that the table does not state still stops the sweep by the axis's name, not after the axes
    before it have run)."""
    knobs = _baseline(c, cfg0)
    knobs[axis] = value
    try:
        cfg = cfg0.replace(mtp_hidden_source=knobs["mtp_hidden_source"])
        spec = SpecConfig(verify_width=knobs["verify_width"], max_new_tokens=max_new,
                          refeed_accepted=knobs["refeed_accepted"], draft_conf_tau=knobs["draft_conf_tau"],
                          eos_id=eos_id(cfg0))
        ecfg = EngineConfig(policy=c.policy, max_context=c.max_context, num_pages=c.num_pages,
                            drafter_pages=c.num_pages, mtp_quant=knobs["mtp_quant"],
                            marconi_min_tokens=knobs["marconi_min_tokens"],
                            rebuild_output_rows=knobs["rebuild_output_rows"], execution=execution)
    except ValueError as e:
        raise app.UsageError(f"--config.axes.{axis}: value {value!r}: {e}") from e
    return cfg, spec, ecfg


def swept_axes(c) -> list[str]:
    """The axes this config sweeps: those named by ``--config.only`` (all when ''), less those set to ()."""
    only = [n for n in c.only.split(",") if n]
    axes = [a for a in c.axes.keys() if (not only or a in only) and len(c.axes[a])]
    if not axes:
        raise app.UsageError(f"--config.axes / --config.only={c.only!r}: no axis left to sweep (an axis set to () "
                             f"is not swept)")
    return axes


def plan(c, cfg0, sessions, preamble_only, axes, execution: ExecutionConfig = ExecutionConfig()) -> dict:
    """``{axis: (sessions, max new tokens, [(value, cfg, spec, ecfg), ...])}`` for every axis of
    ``axes`` (`swept_axes`) and its values, each engine run with ``execution``.

    The Marconi axis runs over the sessions that share only the preamble, where the
    threshold decides between restoring a snapshot and a full drafter prefill.
    """
    out = {}
    for axis in axes:
        work = preamble_only if axis == "marconi_min_tokens" else sessions
        max_new = max(t.max_new_tokens for s in work for t in s.turns)
        out[axis] = work, max_new, [(v, *_setting(c, cfg0, axis, v, max_new, execution)) for v in c.axes[axis]]
    return out


def _write(out: pathlib.Path, header: str, origin: dict, tables: dict, settings: runtime.ProcessSettings) -> str:
    """results.json (``origin``: the run's `provenance`) and results.md of the axes run so far;
    returns the markdown."""
    report = {"header": header, **origin, "process_settings": settings.as_dict(), "tables": tables}
    write_json(out / "results.json", report)
    lines = [f"# Acceptance sweeps\n\n{header}\n"]
    for axis, rows in tables.items():
        lines += [f"\n## {axis}\n", "| value | lossless | TTFT p50 ms, all / warm turns | decode tok/s | "
                  "decode ms per verify step / per turn | "
                  "mean acc. len | per-position acceptance | draft acceptance rate | paths |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            a, warm = r["all"], r["warm"].get("ttft_ms_p50", float("nan"))
            pos = " / ".join(f"{p:.3f}" for p in a["acceptance_per_position"])
            lines.append(f"| {r['value']} | {r['lossless']} | {a['ttft_ms_p50']:.1f} / {warm:.1f} "
                         f"| {a['decode_tokens_per_s']:.1f} "
                         f"| {a['decode_ms_per_verify_step']:.2f} / {a['decode_ms_per_turn']:.1f} "
                         f"| {a['mean_acceptance_length']:.3f} | {pos} | {a['draft_acceptance_rate']:.3f} | {a['paths']} |")
    md = "\n".join(lines) + "\n"
    write_atomic(out / "results.md", md)
    return md


def main(argv):
    del argv
    c = _CONFIG.value
    swept = swept_axes(c)  # a config that sweeps nothing stops here, in one line
    settings = runtime.configure_process(c.dtype)  # before anything starts JAX's backend
    logging.info("process settings: %s", settings.describe())
    start, origin = time.time(), provenance(c)  # the code and command as the run starts
    cfg0, params, mesh, sessions, prompts = load_experiment(c)
    preamble_only = session_subset(load_sessions(c.preamble_only_sessions), c.num_preamble_only, "num_preamble_only")
    execution = ExecutionConfig.from_environ(os.environ)
    axes = plan(c, cfg0, sessions, preamble_only, swept, execution)
    out = pathlib.Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables, refs = {}, {}  # one plain greedy reference per session set and width, shared by its axes
    for axis, (work, max_new, runs) in axes.items():
        total = sum(len(s.turns) for s in work)
        rows = []
        for value, cfg, spec, ecfg in runs:
            reference = lossless_reference(spec.verify_width)
            if (id(work), reference.plain_width) not in refs:
                refs[id(work), reference.plain_width] = greedy_reference(
                    cfg0, params, work, prompts, c, max_new, "greedy reference", total, mesh, reference.plain_width,
                    execution)
            ref = refs[id(work), reference.plain_width]
            turns = index_turns(run_policy(cfg, params, work, prompts, spec, ecfg, f"{axis}={value}", total, mesh))
            same = lossless(turns, ref)
            stats = [r.stats for r in turns.values()]
            rows.append({"value": value, "lossless": same, "lossless_reference": reference.description,
                         "all": summarize(stats),
                         "warm": summarize([s for (sid, i), s in zip(turns, stats) if i > 0])})
            logging.info("%s=%s lossless=%s", axis, value, same)
        tables[axis] = rows
        header = (f"{len(sessions)} sessions (+{len(preamble_only)} preamble-only for the Marconi axis), "
                  f"policy={c.policy}, baseline K={c.verify_width} {c.mtp_quant}, "
                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, wall {time.time() - start:.0f} s, "
                  f"{len(tables)} of {len(axes)} axes; {settings.describe()}")
        md = _write(out, header, origin, tables, settings)
    print(md)
    cli.wrote(out, ("results.json", "results.md"), f"{len(tables)} of {len(axes)} axes, wall {time.time() - start:.0f} s")
    if not all(r["lossless"] for rows in tables.values() for r in rows):
        raise SystemExit("a sweep setting's output differs from plain greedy decoding")


if __name__ == "__main__":
    cli.run(main, _CONFIG, config_module)
