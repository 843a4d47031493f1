"""The experiment scripts as processes: sweep.py, generate.py and carry_ablation.py around faked
runs (their planning, writing and failure paths), and carry_ablation for real on simulated device
meshes. Each check runs in its own process, since the scripts' absl flags would clash in one."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}

# A sweep whose model, engine runs and summaries are stand-ins: what is left is its planning and writing.
SWEEP = """
import sys, types
import ml_collections
from absl import app, flags
from experiments import harness, sweep
from mtp.config import ModelConfig
from mtp.data.sessions import load_sessions

flags.FLAGS(["sweep"])
c = sweep._CONFIG.value
c.out_dir = sys.argv[1]
cfg = ModelConfig.from_hf("configs/models/tiny_dense.json")
sessions = load_sessions(c.sessions)[:1]
sweep.load_experiment = lambda c: (cfg, None, None, sessions, None)
ran = []

def run_policy(cfg, params, work, prompts, spec, ecfg, label, total, mesh=None):
    ran.append(label)
    if label == FAIL_AT:
        raise RuntimeError("the engine ran out of pages")
    return [types.SimpleNamespace(request=types.SimpleNamespace(session_id=s.session_id), output=[7], stats=None)
            for s in work for t in s.turns]

sweep.run_policy = harness.run_policy = run_policy
sweep.summarize = lambda stats: dict(ttft_ms_p50=1.0, decode_tokens_per_s=2.0, decode_ms_per_verify_step=3.0,
                                     decode_ms_per_turn=9.0, mean_acceptance_length=1.5,
                                     acceptance_per_position=[0.5], draft_acceptance_rate=0.5, paths={})
"""


def _python(code: str, *args):
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_sweep_names_a_bad_axis_or_value_before_any_run(tmp_path):
    """An unknown axis ran the baseline under its label; a bad value stopped the sweep only once
    the axes before it had run. Every axis and value is checked against the config's table
    (`configs.sweep.FIELDS`) before `main` runs, by the axis's flag name."""
    code = SWEEP + """
from experiments import cli
from configs import sweep as sweep_config
FAIL_AT = None
shipped = sweep.plan(c, cfg, sessions, sessions, sweep.swept_axes(c))
assert {a: len(runs) for a, (_, _, runs) in shipped.items()} == {a: len(v) for a, v in c.axes.items()}
assert set(sweep._baseline(c, cfg)) == set(sweep_config.AXES) == set(c.axes.keys())  # one list of axes
for axis, values, message in [
        ("mtp_qaunt", ("bf16",), "--config.axes.mtp_qaunt: no such field (did you mean mtp_quant?); --config.axes has"),
        ("mtp_quant", ("bf16", "fp9"), "--config.axes.mtp_quant=('bf16', 'fp9'): element 'fp9' is refused; "
                                       "give a tuple of one of 'bf16', 'fp8', 'nvfp4'"),
        ("verify_width", (2, 1), "--config.axes.verify_width=(2, 1): element 1 is refused; give a tuple of "
                                 "an integer in 2..8"),
        ("verify_width", (2, 2.5), "element 2.5 is a float"),
        ("refeed_accepted", (False, "yes"), "element 'yes' is a str; give a tuple of True or False"),
        ("draft_conf_tau", (0.3, 1.0), "--config.axes.draft_conf_tau=(0.3, 1.0): element 1.0 is refused; "
                                       "give a tuple of a number in [0.0, 1.0)"),
        ("mtp_hidden_source", ("pre-norm",), "give a tuple of one of 'post_norm', 'pre_norm'"),
        ("marconi_min_tokens", (0, -1), "--config.axes.marconi_min_tokens=(0, -1): element -1 is refused")]:
    c.axes = ml_collections.ConfigDict(dict([("draft_conf_tau", (0.0, 0.3)), (axis, values)]))
    try:
        cli.check_config(c, sweep_config.FIELDS)
        raise AssertionError(f"{axis}={values} was taken")
    except app.UsageError as e:
        assert message in str(e), (message, str(e))
# An axis set to () is not swept; --config.only sweeps the named axes alone; none left is refused.
c.axes = ml_collections.ConfigDict(dict(draft_conf_tau=(0.0, 0.3), verify_width=(), mtp_quant=("bf16",)))
cli.check_config(c, sweep_config.FIELDS)
assert sweep.swept_axes(c) == ["draft_conf_tau", "mtp_quant"]
c.only = "mtp_quant"
assert sweep.swept_axes(c) == ["mtp_quant"]
c.only = "verify_width"
try:
    sweep.swept_axes(c)
    raise AssertionError("an empty sweep was planned")
except app.UsageError as e:
    assert "no axis left to sweep" in str(e), str(e)
assert not ran, ran
print("checked")
"""
    _python(code, str(tmp_path))
    assert not (tmp_path / "results.json").exists()


def test_sweep_writes_each_axis_as_it_finishes(tmp_path):
    code = SWEEP + """
FAIL_AT = "verify_width=3"
c.axes = ml_collections.ConfigDict(dict(mtp_quant=("bf16", "fp8"), verify_width=(2, 3)))  # run in sorted order
try:
    sweep.main([])
    raise AssertionError("the failing run did not fail")
except RuntimeError:
    pass
# One greedy reference for the two axes: they decode the same sessions.
assert ran == ["greedy reference", "mtp_quant=bf16", "mtp_quant=fp8", "verify_width=2", "verify_width=3"], ran
print("checked")
"""
    _python(code, str(tmp_path))
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["tables"].pop("mtp_quant")
    assert not data["tables"] and [r["value"] for r in rows] == ["bf16", "fp8"] and all(r["lossless"] for r in rows)
    assert "1 of 2 axes" in data["header"] and "## mtp_quant" in (tmp_path / "results.md").read_text()
    assert not {"variants", "stint", "bootstrap_samples", "seed"} & data["config"].keys()  # the sweep reads none of them
    assert data["environment"] == {"JAX_PLATFORMS": "cpu"}  # ENV: the variables that change a run, recorded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]


def test_generate_leaves_no_temp_file_when_it_fails(tmp_path):
    """The first batch is written to OUT.tmp, the second fails: neither OUT nor OUT.tmp may remain."""
    code = """
import sys, types
from absl import app
from experiments import generate
from mtp.config import ModelConfig
cfg = ModelConfig.from_hf("configs/models/tiny_dense.json")
import jax.numpy as jnp
generate.load_pretrained = lambda path, **kw: (cfg, {"model": {"embed_tokens": {"weight": jnp.zeros((1, 1))}}})
batches = []
def fake_generate(cfg, params, batch, spec, **kw):
    batches.append(batch)
    if len(batches) == 2:
        raise RuntimeError("out of memory")
    return types.SimpleNamespace(tokens=[[5, 6]], per_sequence=None)
generate.generate = fake_generate
out, prompts = sys.argv[1], sys.argv[1] + ".prompts.jsonl"
open(prompts, "w").write('{"ids": [1, 2]}\\n{"ids": [3]}\\n')
sys.argv = ["generate", "--checkpoint", "/nonexistent", "--prompts", prompts, "--out", out, "--batch_size", "1"]
try:
    app.run(generate.main)
except RuntimeError as e:
    assert "out of memory" in str(e) and len(batches) == 2
    print("checked")
"""
    out = tmp_path / "out.jsonl"
    _python(code, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl.prompts.jsonl"]


def test_carry_ablation_table_says_when_the_carry_was_disarmed(tmp_path):
    """DESIGN §3: configured is not armed, and what reports the carry says which it was."""
    code = """
from experiments import carry_ablation
warm = dict(turns=2, ttft_ms_p50=1.0, decode_tokens_per_s=2.0, verify_steps=3, accepted_per_step=0.5,
            mean_acceptance_length=1.5, acceptance_per_position=[0.5], drafter_rows_prefilled=0,
            drafter_rows_adopted=0, drafter_rows_appended=0, carry_outcomes={"disarmed": 2})
report = dict(header="h", variants={"carry_single_B2": {"cold": {"turns": 0}, "warm": warm}}, comparisons={},
              lossless="yes")
md = carry_ablation._markdown(report)
assert "carry outcomes (turns)" in md and "| 0 / 0 / 0 | disarmed 2 |" in md, md
print("checked")
"""
    _python(code, str(tmp_path))


MESH_CONFIG = """
from configs import carry_ablation

def get_config():
    c = carry_ablation.get_config()
    c.variants = {"carry": ("carry", 1, 1)}
    c.num_sessions = 1
    return c
"""


def _carry_ablation_on_devices(tmp_path, devices: int, *flags):
    (tmp_path / "mesh_config.py").write_text(MESH_CONFIG)
    env = dict(ENV, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", "experiments.carry_ablation", f"--config={tmp_path / 'mesh_config.py'}",
                           f"--config.out_dir={tmp_path / 'out'}", *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_carry_ablation_runs_on_a_tensor_parallel_mesh(tmp_path):
    """--config.tp=2: the default model loaded into its shards on two (host) devices, every turn
    served by the engine on the mesh, lossless against plain greedy decoding on the same mesh."""
    proc = _carry_ablation_on_devices(tmp_path, 2, "--config.tp=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "(mesh tp=2 x ep=1)" in report["header"]
    assert report["environment"] == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert report["lossless_by_variant"] == {"carry": True}
    assert report["devices"]["count"] == 2 and report["git"]["commit"] and report["packages"]["jax"]
    assert "--config.tp=2" in report["command"] and report["config"]["tp"] == 2
    warm = report["variants"]["carry"]["warm"]
    assert warm["turns"] > 0 and warm["drafter_rows_adopted"] > 0 and warm["drafter_rows_appended"] > 0


def test_carry_ablation_names_a_mesh_it_cannot_build(tmp_path):
    for devices, flags, says in ((2, ("--config.tp=4",), "needs 4 devices, only 2"),
                                 (2, ("--config.tp=1", "--config.ep=2"), "num_experts=0"),
                                 (2, ("--config.tp=0",), "--config.tp=0: give an integer >= 1"),
                                 (8, ("--config.tp=7",), "divides none of")):
        proc = _carry_ablation_on_devices(tmp_path, devices, *flags)
        assert proc.returncode != 0 and "--config.tp=" in proc.stderr and says in proc.stderr, proc.stderr[-3000:]
        assert not (tmp_path / "out").exists()


def test_carry_ablation_names_a_bad_stint(tmp_path):
    proc = _carry_ablation_on_devices(tmp_path, 1, "--config.stint=turn")
    assert proc.returncode != 0 and "--config.stint='turn': give one of 'wave', 'session'" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_carry_ablation_says_beside_each_interval_when_its_sessions_are_too_few(tmp_path):
    """A 3-session run printed intervals that meant nothing without saying so."""
    code = """
from experiments import carry_ablation
from mtp.analysis import paired_bootstrap
boot = lambda n: paired_bootstrap([1.0, 2.0, 0.5] * n, [0.0] * (3 * n), list(range(n)) * 3, 200, 0)
for n, warned in ((3, True), (12, False)):
    report = dict(header="h", variants={}, lossless="yes",
                  comparisons={"carry - blind": {"ttft_ms": boot(n), "mean_acceptance_length": boot(n)}})
    rows = [l for l in carry_ablation._markdown(report).splitlines() if l.startswith("| carry - blind")]
    assert len(rows) == 2, rows
    caveat = f"**only {n} sessions (< 10): the interval means little**"
    assert all((caveat in r) is warned for r in rows), rows
print("checked")
"""
    _python(code, str(tmp_path))


def test_carry_ablation_plots_acceptance_per_turn_with_its_spread_and_counts(tmp_path):
    """Each point pools every session's turn i (as the table does); its error bar is the standard
    error of the sessions' own values, none where one session has the turn; and both PNGs are written."""
    code = """
import pathlib, sys, types
import numpy as np
from experiments import carry_ablation
from mtp.metrics import AcceptanceStats

rng = np.random.default_rng(0)
def turn():
    steps = int(rng.integers(1, 30))
    return types.SimpleNamespace(stats=types.SimpleNamespace(
        acceptance=AcceptanceStats(steps=steps, draft_tokens=2 * steps, accepted=int(rng.integers(0, 2 * steps)),
                                   accepted_at_least=np.zeros(2, np.int64)), ttft_s=float(rng.uniform(0.01, 0.2))))
lengths = {"s0": 4, "s1": 2, "s2": 3}  # turn 3 comes from one session only
per_turn = {p: {(s, i): turn() for s, n in lengths.items() for i in range(n)} for p in ("blind", "carry")}
got = carry_ablation._acceptance_by_turn(per_turn)
for p, turns in per_turn.items():
    for i in range(4):
        rows = [r.stats.acceptance for (s, j), r in turns.items() if j == i]
        pooled = 1 + sum(a.accepted for a in rows) / sum(a.steps for a in rows)
        own = [1 + a.accepted / a.steps for a in rows]
        point, err, n = got[p][i]
        assert n == len(rows) and abs(point - pooled) < 1e-12
        assert (err is None) if n == 1 else abs(err - np.std(own, ddof=1) / np.sqrt(n)) < 1e-12
report = {"variants": {p: {} for p in per_turn}}
carry_ablation._plots(report, per_turn, pathlib.Path(sys.argv[1]))
assert sorted(q.name for q in pathlib.Path(sys.argv[1]).iterdir()) == sorted(carry_ablation.PLOTS)
print("checked")
"""
    _python(code, str(tmp_path))


def test_carry_ablation_names_a_bad_weight_quant(tmp_path):
    proc = _carry_ablation_on_devices(tmp_path, 1, "--config.weight_quant=int4")
    assert proc.returncode != 0 and "--config.weight_quant='int4': give one of 'none', 'fp8'" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


# The main job with a deliberately wrong commit: one more draft accepted than the target agreed to.
WRONG_COMMIT = """
import sys
import jax.numpy as jnp
from absl import app
from experiments import carry_ablation
from mtp import speculative

right = speculative._accept_greedy

def one_too_many(target_logits, drafts, num_drafted):  # traced into the loop in place of the true acceptance
    accepted, _ = right(target_logits, drafts, num_drafted)
    accepted = jnp.minimum(accepted + 1, num_drafted)
    bonus = jnp.take_along_axis(jnp.argmax(target_logits, -1).astype(jnp.int32), accepted[:, None], axis=1)[:, 0]
    return accepted, bonus

speculative._accept_greedy = one_too_many
sys.argv = ["carry_ablation", *sys.argv[1:]]
app.run(carry_ablation.main)
"""


def test_the_main_jobs_lossless_check_catches_a_wrong_commit(tmp_path):
    """An off-by-one accepted count, injected into the decode loop, is reported by the ablation's
    own check: a named mismatch in results.json and the summary, and a failing exit status."""
    (tmp_path / "mesh_config.py").write_text(MESH_CONFIG)
    proc = subprocess.run([sys.executable, "-c", WRONG_COMMIT, f"--config={tmp_path / 'mesh_config.py'}",
                           f"--config.out_dir={tmp_path / 'out'}"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "speculative output differs from plain greedy decoding" in proc.stderr, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["lossless_by_variant"] == {"carry": False}
    assert report["lossless"].startswith("MISMATCH: ['carry'] (against the plain greedy loop (one row a step))")
    assert "Lossless: MISMATCH: ['carry']" in proc.stdout
    assert report["process_settings"]["matmul_precision"] == "highest" and not report["process_settings"]["gpu_detected"]


def test_check_lossless_runs_every_width_and_says_which_moe_path_ran():
    run = subprocess.run([sys.executable, "-m", "experiments.check_lossless", "--models=tiny_qwen35_moe,tiny_moe:fp8",
                          "--layers=2", "--widths=2,3", "--new_tokens=6"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "4 of 4 runs token-identical" in run.stdout
    assert run.stdout.count("'moe_stream_kernels': False") == 4  # a CPU runs the reference
