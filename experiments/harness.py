"""Shared pieces of the experiments (carry_ablation, sweep; generate's EOS): load, run, pair
turns, check them against plain greedy decoding, write results."""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import jax.numpy as jnp
from absl import app
from tqdm import tqdm

from mtp import sharding
from mtp.checkpoint import load_config, load_pretrained
from mtp.data.sessions import load_preamble, load_sessions
from mtp.data.tokenizer import Tokenizer
from mtp.serving import Engine, EngineConfig, TextPrompts, run_sessions, session_waves
from mtp.execution import ExecutionConfig
from mtp.speculative import SpecConfig


def eos_id(cfg) -> int:
    """The checkpoint's EOS id as `SpecConfig.eos_id` takes it: -1 (never stop early) where it names none."""
    return -1 if cfg.eos_token_id is None else cfg.eos_token_id


def load_experiment(c):
    """The checkpoint (at the config's compute dtype), the device mesh it is laid out on (None: one
    device), the session subset, and its prompt builder.

    ``--config.tp`` / ``--config.ep`` above 1 load the checkpoint straight into its shards
    (`mtp.sharding.load_sharded`), for checkpoints one device cannot hold; a layout the
    devices or the checkpoint cannot take is refused by those flags' names before any
    tensor is read (their values were checked against the config's ``FIELDS`` already).
    """
    mesh = None
    if c.tp * c.ep > 1:
        model_cfg = load_config(c.checkpoint)  # a malformed config.json is its own error, not the flags'
        try:
            mesh = sharding.make_mesh(c.tp, c.ep)
            specs = sharding.param_specs(model_cfg, mesh)
        except ValueError as e:
            raise app.UsageError(f"--config.tp={c.tp} --config.ep={c.ep}: {e}") from None
        if not any(axis is not None for spec in specs.values() for axis in spec):
            raise app.UsageError(f"--config.tp={c.tp} --config.ep={c.ep}: divides none of {c.checkpoint}'s heads, "
                                 f"FFN columns, vocabulary or experts, so every device would hold the whole model")
        cfg, params = sharding.load_sharded(c.checkpoint, mesh, dtype=jnp.dtype(c.dtype), weight_quant=c.weight_quant)
    else:
        cfg, params = load_pretrained(c.checkpoint, dtype=jnp.dtype(c.dtype), weight_quant=c.weight_quant)
    tok = Tokenizer.load(pathlib.Path(c.checkpoint) / "tokenizer.json")
    sessions = session_subset(load_sessions(c.sessions), c.num_sessions, "num_sessions")
    return cfg, params, mesh, sessions, TextPrompts(tok, load_preamble(c.preamble), c.prompt_mode)


def session_subset(sessions, count: int, flag: str):
    """The first ``count`` sessions, all of them for -1; any other count is refused by its flag's name."""
    if count == -1:
        return sessions
    if count < 1:
        raise app.UsageError(f"--config.{flag}={count}: give a positive number of sessions, or -1 for all "
                             f"{len(sessions)}")
    return sessions[:count]


def _timed_engine(cfg, params, sessions, prompts, spec, ecfg, mesh):
    """A fresh engine whose programs are compiled: a throwaway engine first serves two turns
    (jit caches are per process), so the one returned starts with empty prefix, snapshot and
    carry state and no timed turn compiles."""
    warm = [dataclasses.replace(s, turns=s.turns[:2]) for s in sessions[: ecfg.batch_slots]]
    run_sessions(Engine(cfg, params, ecfg, spec, mesh), warm, prompts)
    eng = Engine(cfg, params, ecfg, spec, mesh)
    eng.precompile()
    return eng


def run_policy(cfg, params, sessions, prompts, spec, ecfg, label, total, mesh=None):
    """All sessions through one compiled engine (`_timed_engine`)."""
    eng = _timed_engine(cfg, params, sessions, prompts, spec, ecfg, mesh)
    bar = tqdm(total=total, desc=f"{label:>16}", unit="turn", leave=False)
    res = run_sessions(eng, sessions, prompts, on_turn=lambda r: bar.update())
    bar.close()
    return res


STINTS = ("wave", "session")  # `run_policies_interleaved`'s turn-taking


def run_policies_interleaved(cfg, params, sessions, prompts, spec, ecfgs: dict, total, mesh=None,
                             stint: str = "wave") -> dict:
    """``{name: results}`` of every engine config over the same sessions, served side by side.

    Each config gets its own compiled engine (all alive at once: N configs hold N
    engines' page pools and hidden stores), and the engines take turns, in an order
    that rotates every round, each on exactly the schedule it would follow alone
    (`serving.session_waves`). Run one config after another, a process's drift (host
    load, clocks, what the previous config left in memory) lands on whole policies and
    biases their differences; interleaved, it lands on all of them alike, so the paired
    TTFT differences compare policies, not moments.

    ``stint`` is how long an engine serves before the next one takes over: one
    ``"wave"``, or until one of its sessions ends (``"session"``: with one slot, a whole
    session). The engines share their compiled programs (jit caches are per process)
    but not their buffers, so on a GPU the first call of a program after another
    engine's finds every cache address moved and XLA re-records its CUDA graphs; per
    session, a one-slot engine's warm turns never follow another engine's (on the H200
    this changed no paired difference: results/engine/engine_h200.md section 5).
    """
    if stint not in STINTS:
        raise ValueError(f"stint={stint!r}: give 'wave' or 'session'")
    engines = {name: _timed_engine(cfg, params, sessions, prompts, spec, e, mesh) for name, e in ecfgs.items()}
    waves = {name: session_waves(eng, sessions, prompts) for name, eng in engines.items()}
    turns_of = {s.session_id: len(s.turns) for s in sessions}
    served = {name: collections.Counter() for name in ecfgs}
    results = {name: [] for name in ecfgs}
    bar = tqdm(total=total * len(ecfgs), desc="all policies", unit="turn", leave=False)
    round_ = 0
    while waves:
        names = list(waves)
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            for wave in waves[name]:
                results[name] += wave
                bar.update(len(wave))
                served[name].update(r.request.session_id for r in wave)
                if stint == "wave" or any(served[name][r.request.session_id] == turns_of[r.request.session_id]
                                          for r in wave):
                    break
            else:
                del waves[name]
        round_ += 1
    bar.close()
    return results


def index_turns(results):
    """``{(session_id, turn_index): TurnResult}``: turns paired across policies by this key."""
    seen, out = {}, []
    for r in results:
        i = seen.get(r.request.session_id, 0)
        seen[r.request.session_id] = i + 1
        out.append(((r.request.session_id, i), r))
    return dict(out)


@dataclasses.dataclass(frozen=True)
class LosslessReference:
    """The plain greedy loop a lossless speculative run is compared with: ``plain_width`` rows a
    step (`SpecConfig.plain_width`), and the sentence the results give for it."""

    plain_width: int
    description: str


def lossless_reference(verify_width: int) -> LosslessReference:
    """One row a step, except on a GPU: there XLA picks a GEMM's algorithm by its shape, so one
    row and a verify's ``verify_width`` rows can round a near-tie apart (in bf16 most of all); the
    plain loop then runs the verify's shapes, its first row the real token (BUILD.md, "Comparing
    outputs on a GPU"), which checks the speculative loop's commits bit for bit."""
    import jax

    if jax.default_backend() == "gpu":
        return LosslessReference(verify_width, f"the plain greedy loop at the verify's width ({verify_width} rows "
                                               "a step, one real: on a GPU a GEMM's rounding follows its shape)")
    return LosslessReference(1, "the plain greedy loop (one row a step)")


def greedy_reference(cfg, params, sessions, prompts, c, max_new_tokens, label, total, mesh=None, plain_width=1,
                     execution: ExecutionConfig = ExecutionConfig()):
    """Every turn decoded by the plain greedy loop (``plain_width`` rows a step: `lossless_reference`),
    indexed as `index_turns`: the tokens that a lossless speculative run must reproduce exactly.
    ``execution``: the run's (`ExecutionConfig.from_environ` in the experiment's ``main``)."""
    spec = SpecConfig(max_new_tokens=max_new_tokens, eos_id=eos_id(cfg), verify_width=max(2, plain_width),
                      plain_width=plain_width)
    ecfg = EngineConfig(policy="cold", speculative=False, max_context=c.max_context, num_pages=c.num_pages,
                        drafter_pages=c.num_pages, execution=execution)
    return index_turns(run_policy(cfg, params, sessions, prompts, spec, ecfg, label, total, mesh))


def lossless(turns, ref) -> bool:
    """Whether ``turns`` has exactly the reference's turns, each with its tokens.

    The key sets are compared first: a run that lost a turn is a mismatch to report,
    not a KeyError that discards everything measured before it.
    """
    return turns.keys() == ref.keys() and all(turns[k].output == ref[k].output for k in ref)

