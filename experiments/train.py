"""Train the hybrid target and its MTP head jointly, then export the model.

    PYTHONPATH=. python3 experiments/train.py --config configs/train_default.py \
        [--workdir runs/train_default] [--export_dir runs/train_default/model] \
        [--max_train_seconds 420] [--config.batch_size=16 ...]

Re-running with the same --workdir resumes from its newest orbax checkpoint. The
export (bf16 safetensors + config.json + tokenizer.json + README.md model card +
token_counts.npy) is written after training, by default to WORKDIR/model so that a
run never replaces the committed assets/default_model unless that is passed as
--export_dir; an empty --export_dir skips it. The run's summary is written to
WORKDIR/summary.json (with the run's provenance: commit, packages, devices, command line,
config) and held-out metrics to WORKDIR/metrics.jsonl; the last line names them. The config is
checked against `configs.train_default.FIELDS` before any data is read.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from absl import app, flags, logging

from configs import train_default as config_module
from experiments import cli
from experiments.results_io import provenance, write_json
from mtp import train as train_lib

_CONFIG = cli.define_config("configs/train_default.py", "The training config file; its fields are listed above.")
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
    origin = provenance(config)  # the code and command as the run starts
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
    write_json(os.path.join(_WORKDIR.value, "summary.json"), {**s, "provenance": origin}, indent=2)
    print(json.dumps(s, indent=2))
    cli.wrote(_WORKDIR.value, ("summary.json", "metrics.jsonl", "checkpoints/"))
    if export_dir:
        cli.wrote(export_dir, ("config.json", "model*.safetensors", "tokenizer.json", "README.md"))


if __name__ == "__main__":
    cli.run(main, _CONFIG, config_module, errors=(train_lib.TrainError,))
