r"""Generate on a device mesh and compare with the single-device run, token for token.

    # CPU, four simulated devices (the flag must be in the environment before jax starts):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.sharded_generate \
        --tp 2 --out /tmp/sharding_cpu.json
    # two or four GPUs of one host:
    python -m experiments.sharded_generate --tp 2 --out results/sharding/h200_bfloat16_tp2.json

The checkpoint is loaded twice: whole onto the first device (`load_pretrained`) and
straight into its shards (`mtp.sharding.load_sharded`). Prompts are the first user
turns of the evaluation sessions. Both runs decode the same batches with plain and
speculative greedy decoding; the JSON reports whether every token matched, the first
mismatch if not, acceptance, how much of the model each device holds, and timings
(on simulated CPU devices all "devices" share the same cores, so those timings say
nothing about multi-GPU speed).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import platform
import re
import time

from absl import app, flags, logging

import jax
import numpy as np

from experiments.results_io import to_json, write_atomic
from mtp import runtime, sharding
from mtp.cache.state import TargetCache
from mtp.checkpoint import load_pretrained
from mtp.data.tokenizer import Tokenizer
from mtp.execution import ExecutionConfig
from mtp.generation import generate
from mtp.model import target
from mtp.speculative import SpecConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", str(ROOT / "assets" / "default_model"), "Hugging Face layout checkpoint directory.")
flags.DEFINE_string("sessions", str(ROOT / "assets" / "sessions" / "eval_sessions.jsonl"),
                    "Session JSONL; the first user turn of each session is a prompt.")
flags.DEFINE_string("out", None, "Output JSON path.")
flags.DEFINE_integer("tp", 2, "Tensor-parallel devices.", lower_bound=1)
flags.DEFINE_integer("ep", 1, "Expert-parallel groups (MoE checkpoints only).", lower_bound=1)
flags.DEFINE_integer("num_speculative_tokens", 2, "Drafts per step D (verify width K = D + 1).",
                     lower_bound=1, upper_bound=7)
flags.DEFINE_integer("num_prompts", 8, "Prompts to decode.", lower_bound=1)
flags.DEFINE_integer("batch_size", 4, "Prompts decoded together.", lower_bound=1)
flags.DEFINE_integer("max_prompt_tokens", 256, "Prompts are cut to their last this-many tokens.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 48, "Tokens generated per prompt.", lower_bound=1)
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                  "Cast the weights on load (default: keep the file's dtype). Tensor parallelism reorders "
                  "the sums of row-parallel projections, so in bf16 a near-tied argmax may flip; float32 "
                  "makes that rounding negligible.")
flags.DEFINE_enum("matmul_precision", "highest", ["default", "highest"],
                  "jax.default_matmul_precision for the whole run. On a GPU, 'default' lets float32 GEMMs "
                  "round through TF32, whose shape-dependent rounding flips near-tied argmaxes between runs "
                  "that should agree.")
flags.DEFINE_enum("kernels", "reference", ["auto", "reference", "pallas", "interpret"],
                  "Kernel backend. Under the mesh the kernels run per shard (a shard_map over the heads). "
                  "Run with --tp 2 --kernels auto in bf16 on two H200s (2026-11-29, "
                  "results/sharding/h200_bfloat16_tp2_kernels.json): the verify step's only collectives "
                  "were its 17 all-reduces, and 3 / 8 greedy and 5 / 8 speculative sequences matched one "
                  "GPU, the bf16 rounding of the reference run (5 / 8 each), not a kernel defect. The "
                  "default, the references, matched one GPU 8 / 8 in float32 (see results/sharding/sharding.md).")


def session_prompts(path: str, tok: Tokenizer, n: int, max_tokens: int) -> list[list[int]]:
    prompts = []
    with open(path) as f:
        for line in f:
            if len(prompts) == n:
                break
            ids = tok.encode(json.loads(line)["turns"][0]["user"])
            if ids:
                prompts.append(ids[-max_tokens:])
    if len(prompts) < n:
        raise ValueError(f"{path}: only {len(prompts)} sessions with a non-empty first turn, {n} asked for")
    return prompts


def timed_generate(cfg, params, prompts, spec, speculative, mesh=None):
    """Each batch twice: the first compiles, the second is timed."""
    tokens, steps, drafts, accepted, seconds = [], 0, 0, 0, 0.0
    for lo in range(0, len(prompts), FLAGS.batch_size):
        batch = prompts[lo : lo + FLAGS.batch_size]
        generate(cfg, params, batch, spec, speculative=speculative, mesh=mesh)
        start = time.perf_counter()
        res = generate(cfg, params, batch, spec, speculative=speculative, mesh=mesh)
        seconds += time.perf_counter() - start
        tokens += res.tokens
        if res.stats is not None:
            steps += res.stats.steps
            drafts += res.stats.draft_tokens
            accepted += res.stats.accepted
    return tokens, dict(seconds=round(seconds, 3), verify_steps=int(steps), draft_tokens=int(drafts),
                        accepted=int(accepted))


def first_mismatch(a: list[list[int]], b: list[list[int]]):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return {"prompt": i, "position": j}
    return None


_COLLECTIVE = re.compile(r"= (\w+\[[^\]]*\])\S* (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(-start)?\(")


def verify_collectives(cfg, params, mesh, batch: int, width: int,
                       execution: ExecutionConfig) -> dict[str, dict[str, int]]:
    """Collectives XLA put into one sharded verify step, by kind and shape.

    The layouts are right when these are all activation-sized ([B, K, hidden] and
    smaller): a weight-sized all-gather would mean some parameter is being collected.
    """
    blocks = 8
    cache = TargetCache.create(cfg, batch, batch * blocks + 1, 16, blocks, jax.tree.leaves(params)[0].dtype)
    cache = sharding.shard_cache(cache.replace(block_tables=jax.numpy.arange(
        1, batch * blocks + 1, dtype=jax.numpy.int32).reshape(batch, blocks)), cfg, mesh)
    tokens = jax.numpy.ones((batch, width), jax.numpy.int32)
    hlo = target.verify.lower(cfg, params, cache, tokens, execution=execution).compile().as_text()
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for m in _COLLECTIVE.finditer(hlo):
        found[m.group(2)][m.group(1)] += 1
    return {kind: dict(shapes) for kind, shapes in found.items()}


def bytes_on(params, device) -> int:
    return int(sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards
                   if s.device == device))


def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    logging.info("process settings: %s", runtime.configure_process().describe())  # before JAX's backend starts
    with jax.default_matmul_precision(FLAGS.matmul_precision):
        compare(FLAGS.out, ExecutionConfig.from_environ(os.environ).with_global_kernel(FLAGS.kernels))


def compare(out: str, execution: ExecutionConfig):
    mesh = sharding.make_mesh(FLAGS.tp, FLAGS.ep)
    dtype = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, None: None}[FLAGS.dtype]
    cfg, params = load_pretrained(FLAGS.checkpoint, dtype=dtype)
    _, sharded = sharding.load_sharded(FLAGS.checkpoint, mesh, dtype=dtype)
    total = int(sum(leaf.nbytes for leaf in jax.tree.leaves(params)))
    per_device = {str(d): bytes_on(sharded, d) for d in mesh.devices.flat}
    logging.info("model %d bytes; per device %s", total, per_device)
    tok = Tokenizer.load(os.path.join(FLAGS.checkpoint, "tokenizer.json"))
    prompts = session_prompts(FLAGS.sessions, tok, FLAGS.num_prompts, FLAGS.max_prompt_tokens)
    runs, single_tokens, sharded_tokens = {}, {}, {}
    for name, speculative, width in (("greedy", False, 2), ("speculative", True, FLAGS.num_speculative_tokens + 1)):
        spec = SpecConfig(verify_width=width, max_new_tokens=FLAGS.max_new_tokens, execution=execution)
        single, single_stats = timed_generate(cfg, params, prompts, spec, speculative)
        multi, multi_stats = timed_generate(cfg, sharded, prompts, spec, speculative, mesh)
        mismatch = first_mismatch(single, multi)
        single_tokens[name], sharded_tokens[name] = single, multi
        runs[name] = dict(identical=mismatch is None, first_mismatch=mismatch,
                          sequences_identical=sum(a == b for a, b in zip(single, multi)),
                          single_device=single_stats, sharded=multi_stats, tokens=sum(map(len, single)))
        logging.info("%s: identical=%s single %s sharded %s", name, mismatch is None, single_stats, multi_stats)
    report = dict(
        checkpoint=FLAGS.checkpoint, tp=FLAGS.tp, ep=FLAGS.ep, kernels=FLAGS.kernels,
        dtype=str(jax.tree.leaves(params)[0].dtype), matmul_precision=FLAGS.matmul_precision,
        platform=jax.default_backend(), devices=[str(d) for d in mesh.devices.flat],
        device_kind=jax.devices()[0].device_kind, host=platform.node(), jax=jax.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        num_prompts=len(prompts), prompt_tokens=[len(p) for p in prompts], max_new_tokens=FLAGS.max_new_tokens,
        num_speculative_tokens=FLAGS.num_speculative_tokens,
        param_bytes_total=total, param_bytes_per_device=per_device,
        param_specs={n: str(s) for n, s in sharding.param_specs(cfg, mesh).items()},
        verify_step_collectives=verify_collectives(cfg, sharded, mesh, FLAGS.batch_size,
                                                   FLAGS.num_speculative_tokens + 1, execution),
        runs=runs,
        # The same yardstick without a mesh: one device, plain vs speculative decoding.
        # Their verify shapes differ, so in bf16 they round differently too.
        single_device_greedy_vs_speculative=first_mismatch(single_tokens["greedy"], single_tokens["speculative"]),
        sharded_greedy_vs_speculative=first_mismatch(sharded_tokens["greedy"], sharded_tokens["speculative"]),
    )
    write_atomic(out, to_json(report, indent=2) + "\n")
    print("| run | tokens | identical | single-device s | sharded s | accepted / drafts |")
    print("|---|---|---|---|---|---|")
    for name, r in runs.items():
        acc = f"{r['sharded']['accepted']} / {r['sharded']['draft_tokens']}" if name == "speculative" else "-"
        print(f"| {name} | {r['tokens']} | {r['identical']} | {r['single_device']['seconds']} | "
              f"{r['sharded']['seconds']} | {acc} |")
    if not all(r["identical"] for r in runs.values()):
        raise SystemExit("sharded output differs from the single-device run (see the JSON)")


if __name__ == "__main__":
    app.run(main)
