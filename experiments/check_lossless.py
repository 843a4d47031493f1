r"""Checks on this machine's default path that greedy speculative decoding is token-identical to plain
greedy decoding of the target, on real-shape models with random weights.

    PYTHONPATH=. python3 -m experiments.check_lossless [--models=qwen3_5_35b_a3b,qwen3_next_80b_a3b:fp8]
        [--layers=4] [--widths=2,4] [--new_tokens=24]

Each model (a `bench_real_shape.ModelSpec` entry: config[:fp8]) runs at ``--layers`` layers with
random weights made on the device (`bench_real_shape.device_params`), two prompts of different
lengths; for each verify width K the speculative loop's tokens must equal the plain loop's run at the
same width (``SpecConfig.plain_width``: both then take the same GEMM shapes, so the comparison is
exact on a GPU too). The run also reports whether the speculative loop's program holds the MoE
weight-streaming kernels (`mtp.ops.moe.triton`; on a GPU it does, on a CPU the reference runs).
Random weights leave the drafter's guesses wrong, so the check covers verify, rejection and commit,
and accepted drafts only where the weights make some. Exits 1 if any width differs.
"""

from __future__ import annotations

import sys

import numpy as np
from absl import app, flags

from experiments.bench_real_shape import ModelSpec, at_depth, device_params, load_model_config
from mtp.generation import generate, prepare_decode
from mtp.ops.moe import triton
from mtp.speculative import SpecConfig

flags.DEFINE_list("models", ["qwen3_5_35b_a3b", "qwen3_next_80b_a3b:fp8"], "ModelSpec entries (config[:fp8]).")
flags.DEFINE_integer("layers", 4, "Layers of each model to run.", lower_bound=1)
flags.DEFINE_list("widths", ["2", "4"], "Verify widths K.")
flags.DEFINE_integer("new_tokens", 24, "Tokens each prompt decodes.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")
FLAGS = flags.FLAGS


def check(spec: ModelSpec, widths, new_tokens: int, layers: int, seed: int) -> list[dict]:
    """One row per width: whether the tokens agree, and whether the loop streams its MoE layers."""
    cfg = at_depth(load_model_config(spec.name), layers)
    params = device_params(cfg, seed, weights=spec.weights)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 23)]
    out = []
    for k in widths:
        loops = SpecConfig(max_new_tokens=new_tokens, verify_width=k, plain_width=k)
        plain = generate(cfg, params, prompts, loops, speculative=False).tokens
        res = generate(cfg, params, prompts, loops)
        call = prepare_decode(cfg, params, prompts, loops)
        streams = triton.GATE_UP_KERNEL in call.loop.lower(*call.args).as_text()
        out.append(dict(model=spec.label, layers=layers, K=k, identical=res.tokens == plain,
                        moe_stream_kernels=streams, steps=int(res.stats.steps), accepted=int(res.stats.accepted)))
        print(out[-1], flush=True)
    return out


def main(argv):
    del argv
    rows = [r for entry in FLAGS.models
            for r in check(ModelSpec.parse(entry), [int(w) for w in FLAGS.widths], FLAGS.new_tokens, FLAGS.layers,
                           FLAGS.seed)]
    bad = [r for r in rows if not r["identical"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} runs token-identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    app.run(main)
