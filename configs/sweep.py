"""Acceptance sweeps over the speculative knobs, one table per axis (experiments/sweep.py).

An axis set to ``()`` is not swept, so ``--config.axes.mtp_quant='()'`` drops one axis and
``--config.only=verify_width`` runs one alone.
"""

import ml_collections

from configs import carry_ablation
from experiments import cli
from mtp.serving import DRAFTER_POLICIES

AXES = ("verify_width", "mtp_quant", "mtp_hidden_source", "refeed_accepted", "rebuild_output_rows", "draft_conf_tau",
        "marconi_min_tokens")


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
    c.only = ""  # comma-separated axis names: sweep only these ("": every axis not set to ())
    c.out_dir = "runs/sweep"
    return c


def _axes_named(v):
    names = [n for n in v.split(",") if n] if isinstance(v, str) else None
    if names is None:
        return cli.kind_of(v)
    return next((f"{n!r} is no axis" for n in names if n not in AXES), None)


_NOT_SWEPT = "means the axis is not swept"
FIELDS = {
    **{k: f for k, f in carry_ablation.FIELDS.items() if k in carry_ablation.MODEL_FIELDS},
    "marconi_min_tokens": cli.Field("The Marconi threshold of every axis but its own.",
                                    carry_ablation.MARCONI_MIN_TOKENS),
    "preamble_only_sessions": cli.Field("Sessions that share only the preamble: the Marconi axis runs over them.",
                                        cli.existing_path("file")),
    "num_preamble_only": cli.Field("How many of the preamble-only sessions, from the first.",
                                   carry_ablation.SESSION_COUNT),
    "policy": cli.Field("The drafter policy of every run.", cli.one_of(*DRAFTER_POLICIES)),
    "only": cli.Field("Comma-separated axes to sweep alone ('' sweeps every axis not set to ()).",
                      cli.Values(f"'' or comma-separated names of {', '.join(AXES)}", _axes_named)),
    "axes.verify_width": cli.Field("Verify widths K.", cli.tuple_of(carry_ablation.VERIFY_WIDTH, _NOT_SWEPT),
                                   required=False),
    "axes.mtp_quant": cli.Field("MTP head precisions.", cli.tuple_of(carry_ablation.MTP_QUANT, _NOT_SWEPT),
                                required=False),
    "axes.mtp_hidden_source": cli.Field("Which target hidden feeds the MTP head.",
                                        cli.tuple_of(carry_ablation.MTP_HIDDEN_SOURCE, _NOT_SWEPT), required=False),
    "axes.refeed_accepted": cli.Field("Refeed on and off.", cli.tuple_of(cli.BOOLEAN, _NOT_SWEPT), required=False),
    "axes.rebuild_output_rows": cli.Field("The output's drafter rows rebuilt at the turn's end, off and on.",
                                          cli.tuple_of(cli.BOOLEAN, _NOT_SWEPT), required=False),
    "axes.draft_conf_tau": cli.Field("D-Cut thresholds: a draft chain stops once its least top-1 probability is "
                                     "below tau (0: never).",
                                     cli.tuple_of(cli.number(0.0, 1.0, hi_open=True), _NOT_SWEPT), required=False),
    "axes.marconi_min_tokens": cli.Field("Marconi thresholds, over the preamble-only sessions.",
                                         cli.tuple_of(carry_ablation.MARCONI_MIN_TOKENS, _NOT_SWEPT), required=False),
}
