"""Training config of the shipped default model (configs/models/default.json).

Sized for one H200 and a wall-clock budget: `num_train_steps` is an upper bound and
`max_train_seconds` shrinks the cosine horizon to the steps that fit (see
mtp/train.py). Reproduce with

    PYTHONPATH=. python3 experiments/train.py --config configs/train_default.py

``FIELDS`` says what each field means and which values it takes (``--help`` lists it; the program
checks a config against it before it reads any data).
"""

import dataclasses

import ml_collections

from experiments import cli
from mtp.config import ModelConfig
from mtp.train import COMPUTE_DTYPES, REPO_ROOT


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "configs/models/default.json"
    c.model_overrides = ml_collections.ConfigDict()  # ModelConfig fields to replace, if any
    c.data_dir = "runs/data"  # train.npy / heldout.npy / data_info.json of experiments/build_data.py
    c.tokenizer = "assets/tokenizer/tokenizer.json"
    c.seed = 0

    # Batch and schedule.
    c.seq_len = 1024
    c.batch_size = 32
    c.num_train_steps = 20_000  # upper bound; the time budget usually ends the schedule sooner
    c.warmup_steps = 200
    c.peak_lr = 2e-3
    c.end_lr_ratio = 0.1
    c.weight_decay = 0.1
    c.b1 = 0.9
    c.b2 = 0.95
    c.eps = 1e-8
    c.clip_norm = 1.0
    c.mtp_weight = 0.3  # lambda of the MTP loss
    c.compute_dtype = "bfloat16"

    # Wall-clock budget (0 = none): compile, steps and periodic evals all count; the
    # final eval and export must fit in reserve_seconds.
    c.max_train_seconds = 0.0
    c.reserve_seconds = 30.0
    c.calibrate_steps = 40  # steps timed before the horizon is first fitted to the budget

    # Bookkeeping.
    c.log_every = 20
    c.progress_seconds = 10.0
    c.eval_every = 500
    c.eval_windows = 256
    c.eval_batch_size = 32
    c.checkpoint_every = 1000
    c.keep_checkpoints = 2
    c.max_shard_bytes = 15_000_000  # keeps each exported file under 16 MB
    return c


def _overrides_problem(v):
    if not hasattr(v, "keys"):
        return cli.kind_of(v)
    unknown = sorted(set(v.keys()) - {f.name for f in dataclasses.fields(ModelConfig)})
    return f"{', '.join(unknown)} are no ModelConfig fields" if unknown else None


_COUNT = cli.integer(1)
_SECONDS = cli.number(0.0)
FIELDS = {
    "model": cli.Field("The model's config.json (configs/models/).", cli.existing_path("file", root=REPO_ROOT)),
    "model_overrides": cli.Field("ModelConfig fields to replace in the model's config.json.",
                                 cli.Values("a dict of ModelConfig fields", _overrides_problem)),
    "data_dir": cli.Field("The token arrays of `python -m experiments.build_data`.",
                          cli.existing_path("dir", ("train.npy", "heldout.npy"), root=REPO_ROOT)),
    "tokenizer": cli.Field("The tokenizer.json exported with the model ('': none).",
                           cli.Values("'' or an existing file", lambda v: None if v == "" else
                                      cli.existing_path("file").problem(v))),
    "seed": cli.Field("Seed of the initial weights and of the data order.", cli.integer()),
    "seq_len": cli.Field("Tokens per training window.", cli.integer(2)),
    "batch_size": cli.Field("Windows per step.", _COUNT),
    "num_train_steps": cli.Field("Upper bound of the schedule's steps (a time budget may end it sooner).", _COUNT),
    "warmup_steps": cli.Field("Linear warmup steps of the learning rate.", cli.integer(0)),
    "peak_lr": cli.Field("The learning rate after warmup.", cli.number(0.0)),
    "end_lr_ratio": cli.Field("The cosine schedule's last learning rate, as a fraction of the peak.",
                              cli.number(0.0, 1.0)),
    "weight_decay": cli.Field("AdamW's decoupled weight decay.", cli.number(0.0)),
    "b1": cli.Field("AdamW's first-moment decay.", cli.number(0.0, 1.0, hi_open=True)),
    "b2": cli.Field("AdamW's second-moment decay.", cli.number(0.0, 1.0, hi_open=True)),
    "eps": cli.Field("AdamW's epsilon.", cli.number(0.0)),
    "clip_norm": cli.Field("Global gradient-norm clip.", cli.number(0.0)),
    "mtp_weight": cli.Field("Lambda: the MTP loss's weight beside the target's.", cli.number(0.0)),
    "compute_dtype": cli.Field("The forward's dtype (master weights stay float32).", cli.one_of(*COMPUTE_DTYPES)),
    "max_train_seconds": cli.Field("Wall-clock budget, compile and evals included (0: none).", _SECONDS),
    "reserve_seconds": cli.Field("Of the budget, what the final eval and export are left.", _SECONDS),
    "calibrate_steps": cli.Field("Steps timed before the schedule is first fitted to the budget.", _COUNT),
    "log_every": cli.Field("Steps between training-loss log lines.", _COUNT),
    "progress_seconds": cli.Field("Seconds between progress-bar updates.", _SECONDS),
    "eval_every": cli.Field("Steps between held-out evaluations.", _COUNT),
    "eval_windows": cli.Field("Held-out windows per evaluation.", _COUNT),
    "eval_batch_size": cli.Field("Windows per evaluation batch.", _COUNT),
    "checkpoint_every": cli.Field("Steps between orbax checkpoints.", _COUNT),
    "keep_checkpoints": cli.Field("Checkpoints kept in WORKDIR.", _COUNT),
    "max_shard_bytes": cli.Field("Largest exported safetensors file (0: one file).", cli.integer(0)),
}
