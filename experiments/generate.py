r"""Generate from a checkpoint, plain or speculative, over a JSONL of prompts.

    python -m experiments.generate --checkpoint assets/default_model \
        --prompts IN.jsonl --out OUT.jsonl --num_speculative_tokens 2

Each input line is ``{"ids": [...]}`` or ``{"text": "..."}``; each output line is
``{"ids": [...generated ids...], "text": ..., "metrics": {...}}``. ``D`` counts drafts
per step as serving engines do (verify width ``K = D + 1``); ``D = 0`` is plain
decoding of the target. Under greedy decoding both give identical ids.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np

from absl import app, flags, logging

from experiments.harness import eos_id
from mtp import quant, runtime
from mtp.checkpoint import TOKEN_COUNTS_NAME, WEIGHT_QUANT_CHOICES, load_pretrained
from mtp.data.tokenizer import Tokenizer
from mtp.execution import ExecutionConfig
from mtp.generation import generate
from mtp.mtp_head import draft_vocabulary
from mtp.speculative import SpecConfig

DEFAULT_CHECKPOINT = pathlib.Path(__file__).resolve().parents[1] / "assets" / "default_model"

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", str(DEFAULT_CHECKPOINT), "Hugging Face layout checkpoint directory.")
flags.DEFINE_string("prompts", None, "JSONL of prompts: {\"ids\": [...]} or {\"text\": \"...\"} per line.")
flags.DEFINE_string("out", None, "Output JSONL path.")
flags.DEFINE_integer("num_speculative_tokens", 2, "Drafts per step D (verify width K = D + 1); 0 = plain decoding.",
                     lower_bound=0, upper_bound=7)
flags.DEFINE_string("mtp_quant", "bf16", f"MTP head precision: one of {', '.join(quant.QUANT_CHOICES)}.")
flags.DEFINE_enum("weight_quant", "none", list(WEIGHT_QUANT_CHOICES),
                  "none: the checkpoint's weights as stored (an FP8 checkpoint's stay FP8); fp8: every Linear "
                  "weight quantized to 128 x 128 FP8 blocks at load, as Qwen's FP8 checkpoints are.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples (rejection sampling keeps the target's law).",
                   lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
flags.DEFINE_integer("batch_size", 8, "Prompts decoded together.", lower_bound=1)
flags.DEFINE_bool("refeed_accepted", False, "Rebuild accepted drafter rows 2.. from the target's true hiddens.")
flags.DEFINE_float("draft_conf_tau", 0.0, "D-Cut threshold on the chain's min top-1 probability (0 = off).")
flags.DEFINE_enum("mtp_hidden_source", None, ["post_norm", "pre_norm"], "Override the config's MTP hidden source.")
flags.DEFINE_integer("mtp_vocab_size", 0, "Draft over the N most frequent token ids (0 = full vocabulary); "
                     "needs token_counts.npy (counts per id) in the checkpoint.", lower_bound=0)
flags.DEFINE_enum("kernels", "auto", ["auto", "reference", "pallas", "interpret"],
                  "Kernel backend of every op MTP_KERNELS names no path of its own for.")


def read_prompts(path: str, tokenizer: Tokenizer | None) -> list[list[int]]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if "ids" in obj:
                ids = obj["ids"]
                if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                    raise ValueError(f"{path}:{n}: 'ids' must be a list of integers")
            elif "text" in obj:
                if tokenizer is None:
                    raise ValueError(f"{path}:{n}: a 'text' prompt needs tokenizer.json in the checkpoint")
                ids = tokenizer.encode(obj["text"])
            else:
                raise ValueError(f"{path}:{n}: expected an 'ids' or a 'text' field")
            if not ids:
                raise ValueError(f"{path}:{n}: empty prompt")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def main(argv):
    del argv
    if not FLAGS.prompts or not FLAGS.out:
        raise app.UsageError("--prompts and --out are required")
    settings = runtime.configure_process()  # before anything starts JAX's backend
    mtp_quant = quant.parse_quant(FLAGS.mtp_quant)
    cfg, params = load_pretrained(FLAGS.checkpoint, weight_quant=FLAGS.weight_quant)
    settings = settings.for_compute_dtype(params["model"]["embed_tokens"]["weight"].dtype)
    logging.info("process settings: %s", settings.describe())
    if FLAGS.mtp_hidden_source:
        cfg = cfg.replace(mtp_hidden_source=FLAGS.mtp_hidden_source)
    tok_path = os.path.join(FLAGS.checkpoint, "tokenizer.json")
    tokenizer = Tokenizer.load(tok_path) if os.path.exists(tok_path) else None
    prompts = read_prompts(FLAGS.prompts, tokenizer)
    for i, p in enumerate(prompts):
        if max(p) >= cfg.vocab_size or min(p) < 0:
            raise ValueError(f"{FLAGS.prompts}: prompt {i} has ids outside the vocabulary [0, {cfg.vocab_size})")
    d = FLAGS.num_speculative_tokens
    spec = SpecConfig(verify_width=max(d + 1, 2), max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                      refeed_accepted=FLAGS.refeed_accepted, draft_conf_tau=FLAGS.draft_conf_tau,
                      eos_id=eos_id(cfg),
                      execution=ExecutionConfig.from_environ(os.environ).with_global_kernel(FLAGS.kernels))
    draft_vocab = None
    if FLAGS.mtp_vocab_size:
        counts_path = os.path.join(FLAGS.checkpoint, TOKEN_COUNTS_NAME)
        if not os.path.exists(counts_path):
            raise ValueError(f"--mtp_vocab_size needs token frequencies: {counts_path} is missing")
        draft_vocab = draft_vocabulary(np.load(counts_path), FLAGS.mtp_vocab_size)
    tmp = FLAGS.out + ".tmp"
    start = time.perf_counter()
    try:
        with open(tmp, "w") as out:
            for lo in range(0, len(prompts), FLAGS.batch_size):
                batch = prompts[lo : lo + FLAGS.batch_size]
                res = generate(cfg, params, batch, spec, speculative=d > 0, mtp_quant=mtp_quant,
                               seed=FLAGS.seed + lo, draft_vocab=draft_vocab)
                for i, ids in enumerate(res.tokens):
                    metrics = res.per_sequence[i].as_dict() if res.per_sequence else {"verify_steps": len(ids) - 1}
                    metrics["num_tokens"] = len(ids)
                    line = {"ids": ids, "metrics": metrics}
                    if tokenizer is not None:
                        line["text"] = tokenizer.decode(ids)
                    out.write(json.dumps(line) + "\n")
                logging.info("generated %d/%d prompts", min(lo + FLAGS.batch_size, len(prompts)), len(prompts))
        os.replace(tmp, FLAGS.out)
    except BaseException:  # Ctrl-C too: a failed run leaves neither OUT nor a half-written OUT.tmp
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    logging.info("wrote %s in %.1f s", FLAGS.out, time.perf_counter() - start)


if __name__ == "__main__":
    app.run(main)
