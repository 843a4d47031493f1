"""experiments/ab_ablation.py: the carry ablation under two variants, interleaved, with a stand-in
ablation. Run as a subprocess, as on the GPU machine (its absl flags stay out of this process)."""

import json
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]

# Writes a results.json shaped like carry_ablation's, its numbers from the tree (base.txt) and the
# environment (SHIFT), and records the order it ran in; LOSSY=1 makes it fail as a lossy run does.
FAKE_ABLATION = textwrap.dedent("""
    import json, os, pathlib, sys
    import carried  # a package on the caller's PYTHONPATH, as runs/pylib on the GPU machine
    out = pathlib.Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--config.out_dir=")))
    out.mkdir(parents=True, exist_ok=True)
    base = float(pathlib.Path("base.txt").read_text()) + float(os.environ.get("SHIFT", "0"))
    with open(os.environ["ORDER_FILE"], "a") as f:
        f.write(pathlib.Path.cwd().name + " " + " ".join(sys.argv[1:-1]) + "\\n")
    warm = lambda p50: {"warm": {"turns": 3, "ttft_ms_p50": p50, "ttft_wait_ms_p50": 0.1}, "cold": {"turns": 1}}
    lossy = os.environ.get("LOSSY") == "1"
    report = {"lossless_by_variant": {"blind": True, "carry": not lossy},
              "variants": {"blind": warm(base), "carry": warm(base + 0.5)},
              "comparisons": {"carry - blind": {"ttft_ms": {"mean_diff": 0.5, "ci95": [0.25, 0.75], "pairs": 3},
                                                "ttft_wait_ms": {"mean_diff": 0.0, "ci95": [-0.1, 0.1], "pairs": 3},
                                                "mean_acceptance_length": {"mean_diff": 0.3, "ci95": [0.2, 0.4]}}}}
    (out / "results.json").write_text(json.dumps(report))
    sys.exit(1 if lossy else 0)
""")


def _tree(root: pathlib.Path, name: str, base: float) -> pathlib.Path:
    tree = root / name
    (tree / "mtp").mkdir(parents=True)
    (tree / "experiments").mkdir()
    # A package as in a real tree: a namespace package would lose to the repository's own on the path.
    (tree / "experiments" / "__init__.py").write_text("")
    (tree / "experiments" / "carry_ablation.py").write_text(FAKE_ABLATION)
    (tree / "base.txt").write_text(str(base))
    return tree


def _run(tmp_path, *args, out_dir=None):
    (tmp_path / "pylib").mkdir(exist_ok=True)
    (tmp_path / "pylib" / "carried.py").write_text("")
    env = {"PYTHONPATH": f"{REPO}:pylib", "ORDER_FILE": str(tmp_path / "order.txt"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(REPO / "experiments" / "ab_ablation.py"), f"--out_dir={out_dir or tmp_path / 'out'}",
                           "--ablation_args=--config.num_sessions=2", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_two_environments_interleaved_with_each_runs_paired_differences(tmp_path):
    """The variant that runs first alternates; a relative --out_dir is the caller's, though each
    child runs from its own tree."""
    tree = _tree(tmp_path, "t", 6.0)
    proc = _run(tmp_path, f"--old_tree={tree}", f"--new_tree={tree}", "--new_env=SHIFT=-1", "--rounds=3",
                out_dir="out")
    assert proc.returncode == 0, proc.stderr
    order = (tmp_path / "order.txt").read_text().split("\n")[:-1]
    assert order == ["t --config.num_sessions=2"] * 6  # the tree's experiments.carry_ablation, its arguments
    result = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert [(r["variant"], r["round"]) for r in result["runs"]] == [("old", 1), ("new", 1), ("new", 2), ("old", 2),
                                                                    ("old", 3), ("new", 3)]
    assert [r["summary"]["warm_ttft_ms_p50"]["blind"] for r in result["runs"]] == [6.0, 5.0, 5.0, 6.0, 6.0, 5.0]
    assert result["runs"][0]["summary"]["paired_ms"] == {"carry - blind ttft_ms": [0.5, 0.25, 0.75],
                                                         "carry - blind ttft_wait_ms": [0.0, -0.1, 0.1]}
    md = (tmp_path / "out" / "ab.md").read_text()
    assert "| carry - blind ttft_ms (paired) | +0.50 [+0.25, +0.75]; +0.50 [+0.25, +0.75]; +0.50 [+0.25, +0.75] |" in md
    assert "| blind warm TTFT p50 | 6.00; 6.00; 6.00 | 5.00; 5.00; 5.00 |" in md
    assert "Failed runs: none. Not lossless: none." in md and md in proc.stdout


def test_a_lossy_or_failed_run_is_reported_not_dropped(tmp_path):
    old, new = _tree(tmp_path, "old", 6.0), _tree(tmp_path, "new", 6.0)
    (new / "experiments" / "carry_ablation.py").write_text("raise SystemExit(3)")  # writes nothing
    proc = _run(tmp_path, f"--old_tree={old}", f"--new_tree={new}", "--old_env=LOSSY=1", "--rounds=1")
    assert proc.returncode == 0, proc.stderr
    runs = json.loads((tmp_path / "out" / "ab.json").read_text())["runs"]
    assert [(r["rc"], r["summary"] is None) for r in runs] == [(1, False), (3, True)]
    assert "Failed runs: new round 1 (3). Not lossless: old round 1." in (tmp_path / "out" / "ab.md").read_text()


def test_bad_flags_say_what_is_wrong(tmp_path):
    tree = _tree(tmp_path, "t", 1.0)
    same = _run(tmp_path, f"--old_tree={tree}", f"--new_tree={tree}")
    assert same.returncode != 0 and "nothing to compare" in same.stderr
    missing = _run(tmp_path, f"--old_tree={tmp_path / 'nowhere'}", f"--new_tree={tree}")
    assert missing.returncode != 0 and "--old_tree" in missing.stderr and "experiments/carry_ablation.py" in missing.stderr
    bad_env = _run(tmp_path, f"--old_tree={tree}", f"--new_tree={tree}", "--new_env=NOEQUALS")
    assert bad_env.returncode != 0 and "KEY=VALUE" in bad_env.stderr
