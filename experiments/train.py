"""Train the hybrid target and its MTP head jointly, then export the model.

    PYTHONPATH=. python3 experiments/train.py --config configs/train_default.py \
        [--workdir runs/train_default] [--export_dir runs/train_default/model] \
        [--max_train_seconds 420] [--config.batch_size=16 ...]

Re-running with the same --workdir resumes from its newest orbax checkpoint. The
export (bf16 safetensors + config.json + tokenizer.json + README.md model card +
token_counts.npy) is written after training, by default to WORKDIR/model so that a
run never replaces the committed assets/default_model unless that is passed as
--export_dir; an empty --export_dir skips it. The run's summary is written to
WORKDIR/summary.json and held-out metrics to WORKDIR/metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from mtp import train as train_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/train_default.py", "Training config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train_default", "Checkpoints, metrics and summary go here.")
_EXPORT_DIR = flags.DEFINE_string("export_dir", None,
                                  "Where the trained model is exported (default WORKDIR/model; '' = no export).")
_MAX_TRAIN_SECONDS = flags.DEFINE_float(
    "max_train_seconds", None,
    "Wall-clock budget of this run, compile included (overrides config.max_train_seconds; 0 = none).",
    lower_bound=0.0)
_STOP_AT_STEP = flags.DEFINE_integer("stop_at_step", None, "End this run at this step (resumable later).",
                                     lower_bound=1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    command = "PYTHONPATH=. python3 " + " ".join(shlex.quote(a) for a in sys.argv)
    logging.info("config:\n%s", config)
    result = train_lib.train(config, _WORKDIR.value, max_train_seconds=_MAX_TRAIN_SECONDS.value,
                             stop_at_step=_STOP_AT_STEP.value)
    s = result.summary
    logging.info("trained %d steps in %.0f s (%s); held-out: %s", s["steps"], s["wall_seconds"],
                 s["stop_reason"], json.dumps(s["heldout"]))
    export_dir = os.path.join(_WORKDIR.value, "model") if _EXPORT_DIR.value is None else _EXPORT_DIR.value
    if export_dir:
        out = train_lib.export_default(export_dir, result, command=command,
                                       tokenizer_path=config.tokenizer or None,
                                       max_shard_bytes=config.max_shard_bytes or None)
        logging.info("exported to %s", out)
    print(json.dumps(s, indent=2))


if __name__ == "__main__":
    app.run(main)
