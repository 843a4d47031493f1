"""experiments/bench_moe.py as a process: its CPU check (the tiny shape, kernels interpreted)
writes every variant's error against the reference, and a bad --configs entry is named."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}


def _bench(tmp_path, *flags):
    return subprocess.run([sys.executable, "experiments/bench_moe.py", "--small", f"--out_dir={tmp_path}",
                           "--tokens=2", "--routings=uniform", *flags],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


def test_small_run_checks_every_variant(tmp_path):
    run = _bench(tmp_path, "--variants=gather,mosaic", "--configs=columns_minor=1")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads((tmp_path / "moe_bench.json").read_text())["rows"]
    assert row["tokens"] == 2 and row["pairs"] == 8
    assert set(row["variants"]) == {"gather", "mosaic", "mosaic:columns_minor=1"}
    for v in row["variants"].values():
        assert v["finite"] and v["rel_err"] < 2e-2, v
    assert "mosaic:columns_minor=1" in (tmp_path / "moe_bench.md").read_text()


def test_a_bad_config_field_is_named(tmp_path):
    run = _bench(tmp_path, "--variants=mosaic", "--configs=tile_q=3")
    assert run.returncode != 0
    assert "no GroupedGemmConfig field 'tile_q'" in run.stderr


def test_small_run_checks_the_stream_kernels_on_fp8_with_the_shared_expert(tmp_path):
    run = _bench(tmp_path, "--variants=before,stream,routed,fp8_grouped", "--stream_configs=block_i=32/chunk=128",
                 "--dtype=fp8", "--shared")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads((tmp_path / "moe_bench.json").read_text())["rows"]
    assert row["dtype"] == "fp8" and row["shared"]
    assert set(row["variants"]) == {"before", "stream", "stream:block_i=32/chunk=128", "routed", "fp8_grouped"}
    for v in row["variants"].values():
        assert v["finite"] and v["rel_err"] < 2e-2, v
    bad = _bench(tmp_path, "--variants=stream", "--stream_configs=block_q=3")
    assert bad.returncode != 0 and "no StreamConfig field 'block_q'" in bad.stderr
