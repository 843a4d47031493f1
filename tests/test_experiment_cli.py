"""The experiment programs' command line (`experiments/cli.py`): each bad config value stops the
program before any model, data or session is touched, in one line that names the flag and what it
takes; ``--help`` lists the config's fields; an axis set to () is not swept; results.json records
its provenance; and scripts/setup.sh leaves an environment it did not create alone.

The programs run as processes (their absl flags would clash in one), started through their
``__main__`` exactly as ``python -m experiments.X`` starts them, with every function that loads or
runs a model replaced by one that fails the test."""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from experiments import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}

# Runs the program named by argv[1] (a module, or a .py path) with argv[2:], every model, data and
# engine entry point it could reach replaced by one that raises.
GUARDED = """
import runpy, sys
from experiments import harness
from mtp import train
from mtp.data import corpus

def refuse(*args, **kwargs):
    raise AssertionError("a model or data function was called")

for name in ("load_experiment", "load_pretrained", "greedy_reference", "run_policy", "run_policies_interleaved"):
    setattr(harness, name, refuse)
train.train = refuse
corpus.load_corpus = refuse
program, sys.argv = sys.argv[1], sys.argv[1:]
if program.endswith(".py"):
    runpy.run_path(program, run_name="__main__")
else:
    runpy.run_module(program, run_name="__main__", alter_sys=True)
"""


def _run(program: str, *args, code: str = GUARDED, cwd=REPO):
    return subprocess.run([sys.executable, "-c", code, program, *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=300)


BAD = [
    ("experiments.carry_ablation", ["--config.mtp_quant=int4"], "--config.mtp_quant='int4': give one of 'bf16', 'fp8', 'nvfp4'"),
    ("experiments.carry_ablation", ["--config.variants.carry=('carri', 1, 1)"],
     "--config.variants.carry=('carri', 1, 1): policy 'carri' is no drafter policy; give a (policy, batch_slots, "
     "carry_slots) triple, policy one of cold, blind, rebuild, carry"),
    ("experiments.carry_ablation", ["--config.num_sessions=0"], "--config.num_sessions=0: give an integer >= 1, or -1"),
    ("experiments.carry_ablation", ["--config.checkpoint=/nonexistent/model"],
     "--config.checkpoint='/nonexistent/model': no such directory; give an existing directory holding config.json"),
    ("experiments.carry_ablation", ["--config.mtp_qaunt=fp8"], "--config.mtp_qaunt: no such field (did you mean mtp_quant?)"),
    ("experiments.carry_ablation", ["--config.num_sessions=many"], "--config.num_sessions=many: invalid literal"),
    ("experiments.sweep", ["--config.mtp_quant=int4"], "--config.mtp_quant='int4': give one of 'bf16', 'fp8', 'nvfp4'"),
    ("experiments.sweep", ["--config.axes.verify_width=(2, 9)"],
     "--config.axes.verify_width=(2, 9): element 9 is refused; give a tuple of an integer in 2..8"),
    ("experiments.sweep", ["--config.only=verify_widht"], "--config.only='verify_widht': 'verify_widht' is no axis"),
    ("experiments.sweep", ["--config.only=mtp_quant", "--config.axes.mtp_quant=()"],
     "--config.axes / --config.only='mtp_quant': no axis left to sweep"),
    ("experiments/train.py", ["--config=configs/train_tiny.py", "--config.batch_size=0"],
     "--config.batch_size=0: give an integer >= 1"),
    ("experiments.build_data", ["--config.vocab_size=100"], "--config.vocab_size=100: give an integer in 260..65536"),
]


@pytest.mark.parametrize("program, args, says", BAD, ids=[f"{p.rpartition('.')[2]} {' '.join(a)}" for p, a, _ in BAD])
def test_a_bad_config_value_stops_before_any_model_call_in_one_line(program, args, says):
    """The brief's cases: ``--config.mtp_quant=int4`` failed only after the plain-greedy reference had
    run (and named ``--mtp_quant``); the sweep blamed ``--config.axes.draft_conf_tau`` for it; a
    misspelled variant policy failed late; errors came as tracebacks."""
    proc = _run(program, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr[-3000:]
    name = pathlib.Path(program).stem if program.endswith(".py") else program.rpartition(".")[2]
    assert lines[0].startswith(name + ": ")


@pytest.mark.parametrize("program, shows", [
    ("experiments.carry_ablation", ["--config.num_sessions=3", "How many of the sessions are served",
                                    "--config.variants.NAME", "carry_multi_B2=('carry', 2, 8)",
                                    "--config.mtp_quant='bf16'", "one of 'bf16', 'fp8', 'nvfp4'", "--config:"]),
    ("experiments.sweep", ["--config.axes.verify_width=(2, 3, 4, 6)", "() means the axis is not swept",
                           "--config.only=''", "--config.policy='carry'"]),
    ("experiments/train.py", ["--config.batch_size=32", "Windows per step", "--workdir"]),
])
def test_help_lists_the_config_fields(program, shows):
    proc = _run(program, "--help")
    missing = [s for s in shows if s not in proc.stdout]
    assert not missing, (missing, proc.stdout[-4000:], proc.stderr[-2000:])


def test_every_field_of_a_shipped_config_has_a_row_and_its_default_passes(tmp_path):
    """The tables describe every field the configs have, and the shipped defaults pass them (the
    training data, built by build_data and not shipped, stands in as empty files)."""
    from configs import carry_ablation, data, sweep, train_default, train_tiny

    for module in (carry_ablation, sweep, data):
        cli.check_config(module.get_config(), module.FIELDS)
    for name in ("train.npy", "heldout.npy"):
        (tmp_path / name).touch()
    for config in (train_default.get_config(), train_tiny.get_config()):
        config.data_dir = str(tmp_path)
        cli.check_config(config, train_default.FIELDS)


def test_check_config_names_unknown_missing_and_badly_typed_fields():
    import ml_collections
    from absl import app

    fields = {"n": cli.Field("a count", cli.integer(1)), "p": cli.Field("a rate", cli.number(0.0, 1.0, hi_open=True)),
              "flag": cli.Field("on or off", cli.BOOLEAN), "group.*": cli.Field("entries", cli.one_of("a", "b")),
              "axes.k": cli.Field("widths", cli.tuple_of(cli.integer(2), "means not swept"), required=False)}
    good = dict(n=2, p=0.5, flag=False, group={"x": "a", "y": "b"}, axes={"k": ()})
    cli.check_config(ml_collections.ConfigDict(good), fields)
    for change, says in [(dict(n=True), "--config.n=True: a bool; give an integer >= 1"),
                         (dict(n=0), "--config.n=0: give an integer >= 1"),
                         (dict(p=1.0), "--config.p=1.0: give a number in [0.0, 1.0)"),
                         (dict(flag=1), "--config.flag=1: an int; give True or False"),
                         (dict(group={"x": "c"}), "--config.group.x='c': give one of 'a', 'b'"),
                         (dict(axes={"k": (2, 1)}), "--config.axes.k=(2, 1): element 1 is refused"),
                         (dict(axes={"j": (2,)}), "--config.axes.j: no such field; --config.axes has k"),
                         (dict(nn=3), "--config.nn: no such field (did you mean n?); --config has n, p, flag")]:
        with pytest.raises(app.UsageError, match=re.escape(says)):
            cli.check_config(ml_collections.ConfigDict({**good, **change}), fields)
    with pytest.raises(app.UsageError, match=re.escape("--config.flag: missing from the config (on or off)")):
        cli.check_config(ml_collections.ConfigDict({k: v for k, v in good.items() if k != "flag"}), fields)
    cli.check_config(ml_collections.ConfigDict({k: v for k, v in good.items() if k != "axes"}), fields)  # optional


# The sweep with its model, engine runs and summaries replaced by stand-ins, run from its command line.
FAKE_SWEEP = """
import runpy, sys, types
from experiments import harness
from mtp import analysis
from mtp.config import ModelConfig
from mtp.data.sessions import load_sessions

cfg = ModelConfig.from_hf("configs/models/tiny_dense.json")
sessions = load_sessions("assets/sessions/eval_sessions.jsonl")[:1]
harness.load_experiment = lambda c: (cfg, None, None, sessions, None)

def run_policy(cfg, params, work, prompts, spec, ecfg, label, total, mesh=None):
    print("ran", label)
    return [types.SimpleNamespace(request=types.SimpleNamespace(session_id=s.session_id), output=[7], stats=None)
            for s in work for t in s.turns]

harness.run_policy = run_policy
analysis.summarize = lambda stats: dict(ttft_ms_p50=1.0, decode_tokens_per_s=2.0, decode_ms_per_verify_step=3.0, decode_ms_per_turn=9.0, mean_acceptance_length=1.5,
                                        acceptance_per_position=[0.5], draft_acceptance_rate=0.5, paths={})
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_a_sweep_axis_set_to_empty_is_not_swept_and_results_record_provenance(tmp_path):
    """An empty tuple was refused, so one axis could not be run alone from the command line; the
    sweep never said where it wrote; results.json recorded no commit, packages, devices or command."""
    empty = [f"--config.axes.{a}=()" for a in ("verify_width", "mtp_quant", "mtp_hidden_source", "rebuild_output_rows",
                                                        "marconi_min_tokens")]
    proc = _run("experiments.sweep", *empty, "--config.axes.draft_conf_tau=(0.0, 0.3)", f"--config.out_dir={tmp_path}",
                code=FAKE_SWEEP)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [line for line in proc.stdout.splitlines() if line.startswith("ran ")]
    assert ran == ["ran greedy reference", "ran draft_conf_tau=0.0", "ran draft_conf_tau=0.3",
                   "ran refeed_accepted=False", "ran refeed_accepted=True"], ran
    assert proc.stdout.strip().splitlines()[-1].startswith(f"wrote {tmp_path.resolve()}/: results.json, results.md")
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data["tables"]) == ["draft_conf_tau", "refeed_accepted"]
    assert data["config"]["axes"]["verify_width"] == []  # recorded as given
    git = data["git"]
    assert re.fullmatch(r"[0-9a-f]{40}", git["commit"]) and isinstance(git["dirty"], bool), git
    assert {"python", "jax", "jaxlib", "flax", "numpy"} <= data["packages"].keys() and data["packages"]["jax"]
    assert data["devices"]["backend"] == "cpu" and data["devices"]["count"] >= 1 and data["devices"]["kinds"]
    assert "experiments.sweep" in data["command"] and "'--config.axes.draft_conf_tau=(0.0, 0.3)'" in data["command"]
    assert data["environment"] == {"JAX_PLATFORMS": "cpu"}

    proc = _run("experiments.sweep", "--config.only=refeed_accepted", f"--config.out_dir={tmp_path}", code=FAKE_SWEEP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(json.loads((tmp_path / "results.json").read_text())["tables"]) == ["refeed_accepted"]


def _setup_copy(tmp_path) -> pathlib.Path:
    """The scripts and pyproject.toml in a fresh directory, with a .venv its owner made by hand."""
    root = tmp_path / "clone"
    shutil.copytree(REPO / "scripts", root / "scripts")
    shutil.copy(REPO / "pyproject.toml", root)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (root / ".venv" / "bin" / "python").chmod(0o755)
    (root / ".venv" / "my_work.txt").write_text("not to be lost")
    return root


def _tree(path: pathlib.Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_setup_refuses_a_venv_it_did_not_create_and_leaves_it_untouched(tmp_path):
    """setup.sh found no stamp of its own in a .venv made by hand and ran ``rm -rf .venv``."""
    root = _setup_copy(tmp_path)
    before = _tree(root / ".venv")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/main.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "did not create it" in proc.stderr and "MTP_VENV=.venv bash scripts/main.sh" in proc.stderr, proc.stderr
    assert f"mv {root}/.venv" in proc.stderr, proc.stderr
    assert _tree(root / ".venv") == before  # nothing deleted, nothing installed, no stamp written
    # Named by MTP_VENV, the same environment is used as it is: first on the PATH, still untouched.
    proc = subprocess.run(["bash", "-c", "source scripts/setup.sh && command -v python"], cwd=root,
                          env={**env, "MTP_VENV": ".venv"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{root}/.venv/bin/python" and "as it is" in proc.stderr, proc.stdout + proc.stderr
    assert _tree(root / ".venv") == before
