"""Acceptance sweeps over the speculative knobs, one table per axis (experiments/sweep.py)."""

import ml_collections

from configs import carry_ablation


def get_config() -> ml_collections.ConfigDict:
    c = carry_ablation.get_config()
    # The ablation's own fields: the sweep runs no variants and no bootstrap, and its results
    # record this config, so they must not claim them.
    del c.variants, c.stint, c.bootstrap_samples, c.seed
    c.num_sessions = 2
    c.preamble_only_sessions = "assets/sessions/preamble_only.jsonl"
    c.num_preamble_only = 8
    c.policy = "carry"
    c.marconi_min_tokens = 256  # the baseline of the other axes (the Marconi axis sets its own per run)
    # Each axis varies one knob from the baseline (the carry_ablation defaults).
    c.axes = ml_collections.ConfigDict({
        "verify_width": (2, 3, 4, 6),
        "mtp_quant": ("bf16", "fp8", "nvfp4"),
        "mtp_hidden_source": ("post_norm", "pre_norm"),
        "refeed_accepted": (False, True),
        "rebuild_output_rows": (False, True),
        "draft_conf_tau": (0.0, 0.3, 0.6),
        "marconi_min_tokens": (0, 64, 128, 256, 512),
    })
    c.out_dir = "runs/sweep"
    return c
