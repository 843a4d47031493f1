"""experiments/bench_decode.py end to end on tiny shapes (``--small``), as a subprocess (its absl
flags would clash with other experiments' in the test process): every row it promises is there,
and the speculative runs equal plain greedy decoding."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}


def _run(*args, timeout=600):
    cmd = [sys.executable, "experiments/bench_decode.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def _check_in_subprocess(code: str):
    """Run ``code`` (which imports bench_decode's internals and prints "checked") in its own process."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stderr[-3000:]


def test_small_run_reports_every_row_and_is_lossless(tmp_path):
    # Part A times a step as the slope between calls of 128 and 512 steps (`experiments.timing`): on
    # this model and a CPU a step is 0.02-0.14 ms, so the calls must differ by more than their jitter.
    proc = _run("--small", "--parts", "A,B", "--batches", "1", "--spec_ks", "2", "--reps", "3",
                "--steps_per_call", "128", "--loop_profile", f"--out_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    by_what = {(r["part"], r["what"]): r for r in rows}
    decode = by_what["A", "decode"]
    assert decode["ms"] > 0 and decode["floor_ms"] > 0
    assert abs(decode["ratio_to_floor"] - decode["ms"] / decode["floor_ms"]) < 1e-9
    loop = by_what["A", "plain greedy loop"]  # the step inside generate's own loop
    assert loop["ms"] > 0 and abs(loop["ratio_to_floor"] - loop["ms"] / decode["floor_ms"]) < 1e-9
    assert "CUPTI" in loop["profile_error"]  # on a CPU the loop's profile says why it is missing
    for what in ("verify K=2", "verify K=4", "verify K=8", "propose (1 draft)"):
        assert by_what["A", what]["ratio_to_decode"] > 0
    plain, spec = by_what["B", "plain"], by_what["B", "spec K=2"]
    assert plain["identical_to_plain"] and spec["identical_to_plain"]
    assert 1.0 <= spec["mean_acceptance_length"] <= 2.0  # K = 2: one draft per verify
    assert spec["accepted_tokens"] <= spec["draft_tokens"]
    assert (tmp_path / "results.md").read_text().count("| B |") == 2


def test_bad_flags_stop_the_run_by_name(tmp_path):
    """A verify width of 1 used to run as K = 2 under the label "spec K=1"."""
    proc = _run("--small", "--spec_ks", "2,1", "--batches", "0", f"--out_dir={tmp_path}", timeout=120)
    assert proc.returncode != 0 and "--spec_ks: integers 2..8" in proc.stderr
    assert not (tmp_path / "results.json").exists()


def test_a_loop_profile_missing_its_graphs_kernels_says_why():
    """CUPTI traces a CUDA graph only if it was on before the graph was built; a profile that
    recorded fewer kernels than steps must say so rather than report a near-empty step."""
    code = """
import jax, jax.numpy as jnp
from experiments import bench_decode, cupti
fn, args = jax.jit(lambda x: x + 1), (jnp.ones(2),)
for n in (3, 48):
    cupti.kernel_timings = lambda f, a, n=n: (f(*a), [("k", 1e-3)] * n)[1]
    prof, after = bench_decode._kernel_profile(fn, args, 16)
    assert float(after[0]) == 2.0
    if n == 3:
        assert "cupti.start" in prof["profile_error"] and "kernels" not in prof, prof
    else:
        assert prof["kernels"] == 3.0 and "profile_error" not in prof, prof
print("checked")
"""
    _check_in_subprocess(code)


def test_part_b_times_reps_runs_of_each_decoding():
    """Part B ran 3 timed generations whatever --reps said. Its generate is counted here, not run."""
    code = """
import sys, types
from absl import flags
import mtp.analysis, mtp.checkpoint, mtp.generation
from experiments import bench_decode
flags.FLAGS(["bench_decode", "--small", "--batches", "1", "--spec_ks", "2"])
calls = []
def generate(cfg, params, prompts, spec, speculative):
    calls.append((speculative, spec.plain_width))
    stats = types.SimpleNamespace(as_dict=dict)
    return types.SimpleNamespace(decode_s=1.0, tokens=[[1, 2]], stats=stats)
mtp.generation.generate = generate
mtp.checkpoint.load_pretrained = lambda path: (None, None)
mtp.analysis.first_divergence = lambda *args: None
rows = []
bench_decode.part_b(types.SimpleNamespace(add=lambda **row: rows.append(row)), 5)
assert [r["what"] for r in rows] == ["plain", "spec K=2"], rows
timed = lambda sp: sum(c == (sp, 1) for c in calls)
assert timed(False) == 1 + 5 and timed(True) == 1 + 5, calls  # a compile run, then --reps timed ones
print("checked")
"""
    _check_in_subprocess(code)


def test_a_failed_part_exits_nonzero_after_writing_its_files(tmp_path):
    """A crashed part was only recorded, and the process exited 0: scripts/gpu_check.sh said "ok"."""
    code = f"""
import sys
from absl import app
from experiments import bench_decode
def part_b(report, reps, execution):
    raise RuntimeError("the default model is missing")
bench_decode.part_b = part_b
sys.argv = ["bench_decode", "--parts", "B", "--out_dir", {str(tmp_path)!r}]
try:
    app.run(bench_decode.main)
except SystemExit as e:
    assert "part B failed" in str(e.code), e.code
    print("checked")
"""
    _check_in_subprocess(code)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["errors"] == ["part B: RuntimeError: the default model is missing"]
    assert "Error: part B: RuntimeError" in (tmp_path / "results.md").read_text()
