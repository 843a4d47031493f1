"""Reading and rewriting XLA's autotuning text protos (`experiments/pin_gemm_configs.py`), on real H200 dumps.

The files are the autotuner's log and picks for the decode step's FFN (results/kernels/kernels_h200.md, the section of 2026-11-29 23:32 UTC).
"""

import os

import pytest

from experiments.pin_gemm_configs import backend_version, blocks, config_summary, field, gemm_candidates, pin

RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "results", "kernels")
LOG = open(os.path.join(RESULTS, "autotune/ffn_autotune_log_2026-11-29_2344.txt")).read()
PICKS = open(os.path.join(RESULTS, "autotune/ffn_autotune_results_2026-11-29_2344.txt")).read()
GATE_UP, DOWN = "f4211ec72f9e548273dc59b5d7216fd8", "54b9135d4a75aad24831ada612d561a8"


def test_the_log_gives_each_gemm_fusion_its_triton_candidates_fastest_first():
    gemms = gemm_candidates(LOG)
    assert {fp: g["fusion"] for fp, g in gemms.items()} == {GATE_UP: "gemm_fusion_dot_general.2",
                                                            DOWN: "gemm_fusion_dot"}
    for g in gemms.values():
        times = [ns for ns, _ in g["candidates"]]
        assert len(times) > 5 and times == sorted(times)
        assert all(field(c, "backend") == "TRITON" for _, c in g["candidates"])
    assert gemms[GATE_UP]["candidates"][0][0] == 15872
    assert config_summary(gemms[GATE_UP]["candidates"][0][1]) == "16x8x128 split_k 1 stages 3 warps 2"
    assert backend_version(LOG) == "a77e7c793abc0d0c923a9afb275058e2fe57a198"


def test_pin_rewrites_only_the_chosen_fusions():
    gemms = gemm_candidates(LOG)
    choice = gemms[GATE_UP]["candidates"][2][1]
    out = pin(PICKS, {GATE_UP: choice}, "v-test")
    before, after = blocks(PICKS, "entries"), blocks(out, "entries")
    assert len(before) == len(after) == 22
    for old, new in zip(before, after):
        if field(old, "hlo_fingerprint") == GATE_UP:
            assert config_summary(blocks(new, "optimal_config")[0]) == config_summary(choice)
            assert config_summary(blocks(old, "optimal_config")[0]) != config_summary(choice)
            assert field(new, "optimal_backend_version") == "v-test"
        else:
            assert old == new
    assert pin(PICKS, {}, "v") == PICKS  # nothing chosen: the file as it was


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="not in the autotune results.*deadbeef"):
        pin(PICKS, {"deadbeef": "backend: TRITON"}, "v")
    with pytest.raises(ValueError, match="unbalanced braces after 'entries'"):
        blocks("entries {\n  key {\n", "entries")
    with pytest.raises(ValueError, match="no NO_SUCH_BACKEND backend version"):
        backend_version(LOG, "NO_SUCH_BACKEND")
