"""A tiny joint-training config that runs end to end on a CPU in seconds.

Used by tests/test_train.py (which points `data_dir` at a synthetic stream) and as a
smoke test of the whole path on the real data, export included:

    PYTHONPATH=. python3 experiments/train.py --config configs/train_tiny.py \
        --workdir /tmp/tiny --export_dir /tmp/tiny_model
"""

import ml_collections

from configs import train_default


def get_config() -> ml_collections.ConfigDict:
    c = train_default.get_config()
    c.model = "configs/models/tiny_dense.json"
    # The real tokenizer's vocabulary, so the tiny model reads runs/data unchanged.
    c.model_overrides = ml_collections.ConfigDict({"vocab_size": 8192})
    c.seq_len = 32
    c.batch_size = 4
    c.num_train_steps = 20
    c.warmup_steps = 2
    c.peak_lr = 1e-2
    c.reserve_seconds = 0.0
    c.calibrate_steps = 5
    c.log_every = 5
    c.progress_seconds = 1.0
    c.eval_every = 10
    c.eval_windows = 8
    c.eval_batch_size = 4
    c.checkpoint_every = 10
    c.max_shard_bytes = 200_000
    return c
