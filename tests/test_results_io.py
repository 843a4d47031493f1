"""`experiments/results_io.py`: results files are replaced whole and are strict JSON."""

import json
import pathlib

import numpy as np
import pytest

import re
import shlex
import subprocess
import sys

from experiments.results_io import git_state, provenance, to_json, write_atomic, write_json


def test_write_atomic_replaces_the_file_whole(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "results.md"
    path.write_text("complete")

    real = pathlib.Path.write_text

    def cut(self, text):
        real(self, text[:2])  # half the text reaches the disk
        raise OSError("disk full")

    monkeypatch.setattr(pathlib.Path, "write_text", cut)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "half")
    monkeypatch.undo()
    assert path.read_text() == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["results.md"]  # and no half-written file beside it


def test_json_is_strict(tmp_path):
    obj = {"rate": float("nan"), "inf": [float("inf"), 1.5], "n": np.int64(3), "x": np.float32(0.25),
           "arr": np.arange(3), "path": pathlib.Path("a/b"), "nested": ({"v": np.nan},)}
    text = to_json(obj)
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    assert back == {"rate": None, "inf": [None, 1.5], "n": 3, "x": 0.25, "arr": [0, 1, 2], "path": "a/b",
                    "nested": [{"v": None}]}
    write_json(tmp_path / "r.json", obj)
    assert json.loads((tmp_path / "r.json").read_text()) == back


def test_provenance_records_commit_packages_devices_command_and_config():
    import jax  # noqa: F401  (the devices are recorded once a program has started JAX)
    import ml_collections

    config = ml_collections.ConfigDict({"num_sessions": 3, "axes": {"k": (2, 3)}})
    p = provenance(config)
    assert p["command"] == shlex.join(sys.orig_argv)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).parent, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert p["git"]["commit"] == head and isinstance(p["git"]["dirty"], bool)
    versions = p["packages"]
    assert versions["jax"] == jax.__version__ and versions["jaxlib"] and versions["flax"] and versions["numpy"]
    assert p["devices"]["backend"] == jax.default_backend() and p["devices"]["count"] == len(jax.devices())
    assert p["config"] == {"num_sessions": 3, "axes": {"k": (2, 3)}}
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", p["date_utc"])
    json.loads(to_json(p))  # strict JSON, as written


def test_git_state_of_a_tree_without_git_says_why(tmp_path):
    state = git_state(tmp_path)
    assert state["commit"] is None and state["dirty"] is None and "not a git repository" in state["error"]
