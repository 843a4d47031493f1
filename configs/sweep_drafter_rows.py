"""The drafter's rows without refeed: refeed vs the output's rows rebuilt at the turn's end vs
neither, on the default model's evaluation sessions (experiments/sweep.py; results/
sweep_drafter_rows_10)."""

import ml_collections

from configs import sweep


def get_config() -> ml_collections.ConfigDict:
    c = sweep.get_config()
    c.num_sessions = 10
    c.rebuild_output_rows = False  # the baseline: neither; each axis turns one of the two on
    c.axes = ml_collections.ConfigDict({"refeed_accepted": (False, True), "rebuild_output_rows": (False, True)})
    c.out_dir = "runs/sweep_drafter_rows_10"
    return c
