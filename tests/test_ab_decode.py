"""experiments/ab_decode.py: the interleaved old/new benchmark runner, with a stand-in benchmark.

Run as a subprocess, as on the GPU machine: importing it here would define its absl flags
beside bench_decode's in the test process."""

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# Writes part A and part B rows whose values come from the tree (speed.txt) and the environment
# (SCALE), and records the order it ran in, so the test can check what ran where.
FAKE_BENCH = textwrap.dedent("""
    import json, os, pathlib, sys
    out = pathlib.Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out_dir=")))
    speed = float(pathlib.Path("speed.txt").read_text()) * float(os.environ.get("SCALE", "1"))
    with open(os.environ["ORDER_FILE"], "a") as f:
        f.write(pathlib.Path.cwd().name + " " + " ".join(sys.argv[1:-1]) + "\\n")
    rows = [{"part": "A", "what": "decode", "batch": 1, "ms": 2.0 / speed, "kernels": 10,
             "kernel_sum_ms": 1.5 / speed},
            {"part": "B", "what": "plain", "batch": 1, "tokens_per_s": 100.0 * speed}]
    (out / "results.json").write_text(json.dumps({"rows": rows}))
""")


def _tree(root: pathlib.Path, name: str, speed: float) -> pathlib.Path:
    tree = root / name
    (tree / "mtp").mkdir(parents=True)
    (tree / "bench.py").write_text(FAKE_BENCH)
    (tree / "speed.txt").write_text(str(speed))
    return tree


def _run(tmp_path, *args, out_dir=None):
    env = {"PYTHONPATH": str(REPO), "ORDER_FILE": str(tmp_path / "order.txt"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(REPO / "experiments" / "ab_decode.py"), "--bench_script=bench.py",
                           f"--out_dir={out_dir or tmp_path / 'out'}", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_two_trees_interleaved_and_compared(tmp_path):
    """The variant that runs first alternates; a relative --out_dir is the caller's, though each
    benchmark runs from its own tree."""
    old, new = _tree(tmp_path, "old", 1.0), _tree(tmp_path, "new", 1.25)
    proc = _run(tmp_path, f"--old_tree={old}", f"--new_tree={new}", "--rounds=2", "--bench=--parts A",
                "--bench=--parts B", out_dir="out")
    assert proc.returncode == 0, proc.stderr
    order = (tmp_path / "order.txt").read_text().split("\n")[:-1]
    assert order == ["old --parts A", "old --parts B", "new --parts A", "new --parts B",
                     "new --parts A", "new --parts B", "old --parts A", "old --parts B"]
    result = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert [(r["variant"], r["round"]) for r in result["runs"]] == [
        ("old", 1), ("old", 1), ("new", 1), ("new", 1), ("new", 2), ("new", 2), ("old", 2), ("old", 2)]
    speeds = {(e["part"], e["what"]): e["speed"] for e in result["table"]}
    # new is 1.25x faster both ways round: fewer ms per step, more tokens/s
    assert speeds == pytest.approx({("A", "decode"): 1.25, ("B", "plain"): 1.25})
    md = (tmp_path / "out" / "ab.md").read_text()
    assert "**1.250x**" in md and "[10] / [10]" in md and md in proc.stdout


def test_one_tree_two_environments(tmp_path):
    tree = _tree(tmp_path, "t", 2.0)
    proc = _run(tmp_path, f"--old_tree={tree}", f"--new_tree={tree}", "--new_env=SCALE=0.5", "--rounds=1",
                "--bench=--parts A")
    assert proc.returncode == 0, proc.stderr
    decode, plain = json.loads((tmp_path / "out" / "ab.json").read_text())["table"]
    assert decode["old"] == [1.0] and decode["new"] == [2.0] and decode["speed"] == pytest.approx(0.5)
    assert plain["old"] == [200.0] and plain["new"] == [100.0] and plain["speed"] == pytest.approx(0.5)


def test_bad_flags_say_what_is_wrong(tmp_path):
    tree = _tree(tmp_path, "t", 1.0)
    same = _run(tmp_path, f"--old_tree={tree}", f"--new_tree={tree}")
    assert same.returncode != 0 and "nothing to compare" in same.stderr
    missing = _run(tmp_path, f"--old_tree={tmp_path / 'nowhere'}", f"--new_tree={tree}")
    assert missing.returncode != 0 and "--old_tree" in missing.stderr and "git archive" in missing.stderr
    bad_env = _run(tmp_path, f"--old_tree={tree}", f"--new_tree={tree}", "--new_env=NOEQUALS")
    assert bad_env.returncode != 0 and "KEY=VALUE" in bad_env.stderr


def test_a_failed_run_leaves_its_measurement_out(tmp_path):
    old, new = _tree(tmp_path, "old", 1.0), _tree(tmp_path, "new", 1.0)
    (new / "bench.py").write_text("import sys; sys.exit('the benchmark failed')")
    proc = _run(tmp_path, f"--old_tree={old}", f"--new_tree={new}", "--rounds=1", "--bench=--parts A")
    assert proc.returncode == 0, proc.stderr
    assert "exited 1" in proc.stderr and "log.txt" in proc.stderr
    decode, _ = json.loads((tmp_path / "out" / "ab.json").read_text())["table"]
    assert decode["old"] == [2.0] and decode["new"] == [] and "speed" not in decode
    assert "| 2 ms | — | — |" in (tmp_path / "out" / "ab.md").read_text()
    assert "the benchmark failed" in (tmp_path / "out" / "new_1_0" / "log.txt").read_text()
