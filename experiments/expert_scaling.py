r"""Whether a MoE model's cost follows its active experts or its expert count (CPU).

    PYTHONPATH=. python -m experiments.expert_scaling --out_dir runs/expert_scaling

The same tiny model (``--config``, default ``configs/models/tiny_moe.json``) with each of
``--experts`` routed experts (default 8 and 256) and top-``--top_k`` routing (default 2): its
checkpoint is saved per expert (as transformers writes one), then

* ``load_s``: `checkpoint.load_pretrained` of that directory (experts stacked on load);
* ``compile_s``: the first speculative decode (`generation.generate`: prefill, drafter prefill,
  the decode loop), less the time the same call takes once compiled: what tracing and compiling
  cost;
* ``decode_s``: the median of ``--reps`` compiled calls of the same generation;
* ``step_flops``: XLA's cost analysis of the compiled one-token decode step (batch 1).

An untimed run of the first expert count goes first, so that no measure carries the process's
first-use costs. Each measure is also given as a ratio to the first expert count's. The weights grow with the
expert count, so the load reads more bytes by nature; the step's compute and the compile do
not need to.

With ``--form_pairs`` (a list of pair counts ``N * k``), the two forms of the op's reference
(`mtp.ops.moe.reference`) are also timed alone, one layer's routed FFN at ``--form_shape``
(H, I) for each expert count, on distinct random experts per token: the measurement behind
``reference.GATHER_MAX_PAIRS``. Results go to ``out_dir`` as ``results.json`` and
``results.md``.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments.cli import require_ints
from experiments.results_io import write_atomic, write_json
from mtp import checkpoint
from mtp.cache.pages import PageAllocator, block_table_row
from mtp.cache.state import TargetCache
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.generation import generate
from mtp.model import target
from mtp.model.params import init_params
from mtp.ops.moe import reference
from mtp.speculative import SpecConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The program's flags, defined only when it runs as a program: `tests/test_moe.py` imports
    `decode_step_cost` into a pytest process whose other experiment modules own flags of these names."""
    flags.DEFINE_string("out_dir", "runs/expert_scaling", "Where results.json / results.md go.")
    flags.DEFINE_string("config", "configs/models/tiny_moe.json", "The model whose expert count is varied.")
    flags.DEFINE_list("experts", ["8", "256"], "Routed expert counts to compare (the first is the baseline).")
    flags.DEFINE_integer("top_k", 2, "Experts per token.", lower_bound=1)
    flags.DEFINE_integer("batch", 2, "Prompts decoded together.", lower_bound=1)
    flags.DEFINE_integer("prompt_len", 24, "Tokens per prompt.", lower_bound=1)
    flags.DEFINE_integer("max_new_tokens", 32, "Tokens generated per prompt.", lower_bound=1)
    flags.DEFINE_integer("verify_width", 3, "Verify width K of the speculative decode.", lower_bound=2)
    flags.DEFINE_integer("reps", 5, "Timed compiled generations (median reported).", lower_bound=1)
    flags.DEFINE_list("form_pairs", [], "Pair counts N * k at which to time the op's two forms alone (none: skip).")
    flags.DEFINE_list("form_shape", ["512", "256"], "H, I of the op's forms timed alone.")
    require_ints("experts", 1, what="routed experts per MoE layer")
    require_ints("form_pairs", 1)
    require_ints("form_shape", 1)


def decode_step_cost(cfg: ModelConfig, params=None, execution: ExecutionConfig = ExecutionConfig()) -> dict:
    """XLA's cost analysis of the compiled one-token decode step at batch 1 (``params``: arrays or
    their shapes; default the shapes of `init_params`'), traced afresh."""
    if params is None:
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    pool = PageAllocator(5, 16)
    cache = TargetCache.create(cfg, 1, pool.num_pages, 16, 4, jnp.float32).replace(
        block_tables=jnp.asarray(block_table_row(pool.allocate(4), 4))[None])
    jax.clear_caches()  # the step is traced again, with whatever the model's functions are now
    return target.decode.lower(cfg, params, cache, jnp.zeros((1, 1), jnp.int32),
                               execution=execution).compile().cost_analysis()


def measure(base: ModelConfig, experts: int, execution: ExecutionConfig) -> dict:
    cfg = base.replace(num_experts=experts, num_experts_per_tok=FLAGS.top_k)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(FLAGS.batch)]
    spec = SpecConfig(max_new_tokens=FLAGS.max_new_tokens, verify_width=FLAGS.verify_width, execution=execution)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save_pretrained(pathlib.Path(tmp) / "ckpt", cfg, init_params(cfg, jax.random.key(0)))
        t0 = time.perf_counter()
        loaded_cfg, params = checkpoint.load_pretrained(pathlib.Path(tmp) / "ckpt")
        jax.block_until_ready(params)
        load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = generate(loaded_cfg, params, prompts, spec)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(FLAGS.reps):
        t0 = time.perf_counter()
        again = generate(loaded_cfg, params, prompts, spec)
        times.append(time.perf_counter() - t0)
        if again.tokens != first.tokens:
            raise RuntimeError(f"{experts} experts: a repeated generation gave other tokens")
    decode_s = statistics.median(times)
    row = {"experts": experts, "top_k": FLAGS.top_k, "load_s": load_s, "compile_s": max(first_s - decode_s, 0.0),
           "decode_s": decode_s, "step_flops": float(decode_step_cost(loaded_cfg, params, execution)["flops"])}
    logging.info("%s", row)
    return row


def _median_ms(f, *args) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(FLAGS.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def time_forms(experts: int) -> list[dict]:
    """ms of the gather and the segments form for each ``--form_pairs`` count (k = ``--top_k``)."""
    h, i = (int(v) for v in FLAGS.form_shape)
    k = FLAGS.top_k
    keys = jax.random.split(jax.random.key(experts), 4)
    gate, up = (jax.random.normal(kk, (experts, i, h), jnp.float32) / h**0.5 for kk in keys[:2])
    down = jax.random.normal(keys[2], (experts, h, i), jnp.float32) / i**0.5
    rng = np.random.default_rng(experts)
    rows = []
    for pairs in (int(p) for p in FLAGS.form_pairs):
        n = max(1, pairs // k)
        ids = jnp.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(n)]), jnp.int32)
        args = (jax.random.normal(keys[3], (n, h), jnp.float32), ids, jnp.full((n, k), 1.0 / k, jnp.float32),
                gate, up, down)
        row = {"experts": experts, "pairs": n * k, "H": h, "I": i,
               "gather_ms": _median_ms(jax.jit(reference.routed_experts_gather), *args),
               "segments_ms": _median_ms(jax.jit(reference.routed_experts_segments), *args)}
        logging.info("%s", row)
        rows.append(row)
    return rows


def forms_markdown(rows: list[dict]) -> str:
    lines = ["| experts | pairs N*k | H | I | gather ms | segments ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['experts']} | {r['pairs']} | {r['H']} | {r['I']} | {r['gather_ms']:.2f} | {r['segments_ms']:.2f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


MEASURES = ("load_s", "compile_s", "decode_s", "step_flops")


def markdown(rows: list[dict]) -> str:
    base = rows[0]
    head = ["experts", "top-k", *MEASURES, *(f"{m} ratio" for m in MEASURES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        values = [f"{r[m]:.3g}" for m in MEASURES]
        ratios = [f"{r[m] / base[m]:.2f}x" if base[m] else "-" for m in MEASURES]
        lines.append("| " + " | ".join([str(r["experts"]), str(r["top_k"]), *values, *ratios]) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    counts = [int(e) for e in FLAGS.experts]
    base = ModelConfig.from_hf(FLAGS.config)
    if base.num_experts == 0:
        raise app.UsageError(f"--config {FLAGS.config} is a dense model (num_experts=0); give a MoE config")
    if FLAGS.top_k > min(counts):
        raise app.UsageError(f"--top_k={FLAGS.top_k} exceeds the smallest --experts value {min(counts)}")
    logging.info("warm-up: %d experts, untimed (the process's first compiles and runs)", counts[0])
    execution = ExecutionConfig.from_environ(os.environ)
    measure(base, counts[0], execution)
    rows = []
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, experts in enumerate(counts):
        logging.info("[%d/%d] %d experts", i + 1, len(counts), experts)
        rows.append(measure(base, experts, execution))
        for r in rows:
            r.update({f"{m}_ratio": r[m] / rows[0][m] if rows[0][m] else None for m in MEASURES})
        write_json(out / "results.json", {"config": FLAGS.config, "rows": rows})
        write_atomic(out / "results.md", markdown(rows))
    forms = []
    for experts in counts if FLAGS.form_pairs else ():
        forms += time_forms(experts)
        write_json(out / "results.json", {"config": FLAGS.config, "rows": rows, "forms": forms})
        write_atomic(out / "results.md", markdown(rows) + "\n" + forms_markdown(forms))
    print(markdown(rows) + ("\n" + forms_markdown(forms) if forms else ""))


if __name__ == "__main__":
    define_flags()
    app.run(main)
