"""experiments/bench_kernels.py end to end on tiny shapes (``--small``: Pallas interpret mode), as a
subprocess (its absl flags would clash with other experiments' in the test process). The script
catches a failing row or variant and records its error so that one failure does not end a long GPU
run; here none may fail, and every kernel must agree with its reference."""

import json
import math
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}


def test_small_run_checks_and_times_every_row(tmp_path):
    proc = subprocess.run([sys.executable, "experiments/bench_kernels.py", "--small", "--reps", "2",
                           f"--out_dir={tmp_path}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "kernels.json").read_text())
    fc = results["fc"]
    assert [(r["M"], r["H"]) for r in fc] == [(8, 256), (200, 256)]  # the split-K and the big-M path
    for row in fc:
        assert "error" not in row, row
        assert row["rel_err"] < 1e-2
        assert all(row[k] > 0 for k in ("t_ours", "t_xla_dot", "t_xla_unfused"))
        variants = {k: v for k, v in row.items() if k.startswith("variant ")}
        assert variants, row
        for name, v in variants.items():
            assert "error" not in v, (name, v)
            assert v["rel_err"] < 1e-2 and math.isfinite(v["t"]) and v["t"] > 0
        assert isinstance(row["xla_dot_config"], list)  # empty on a CPU: no autotuned GEMM
    assert fc[1]["t_row_sumsq_kernel"] > 0 and fc[1]["t_row_sumsq_kernel_both"] > 0  # the big-M pre-pass, alone
    assert all("variant embed_raw" in r for r in fc)  # the form before the per-token embed norms, beside
    assert [r["what"] for r in results["gemv"]] == ["tiny", "tiny"]
    # The fc op where the model runs it: a drafter-prefill chunk with the kernel and with XLA's fc.
    (prefill,) = results["prefill"]
    assert "error" not in prefill, prefill
    assert (prefill["B"], prefill["M"]) == (1, 128)
    assert prefill["rel_err_k"] < 1e-2 and prefill["rel_err_v"] < 1e-2
    assert prefill["rel_err_k_embed_raw"] < 1e-2
    times = [prefill[k] for k in ("t_xla_fc", "t_fc_kernel", "t_fc_kernel_embed_raw")]
    assert [len(t) for t in times] == [2, 2, 2] and min(sum(times, [])) > 0  # two interleaved rounds
    report = (tmp_path / "kernels.md").read_text()
    assert "### fc GEMM" in report and "small-row GEMMs" in report and "drafter prefill chunk" in report
