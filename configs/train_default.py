"""Training config of the shipped default model (configs/models/default.json).

Sized for one H200 and a wall-clock budget: `num_train_steps` is an upper bound and
`max_train_seconds` shrinks the cosine horizon to the steps that fit (see
mtp/train.py). Reproduce with

    PYTHONPATH=. python3 experiments/train.py --config configs/train_default.py
"""

import ml_collections


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
