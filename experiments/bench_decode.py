r"""Decode-step benchmark (H200): plain decode, verify(K), propose, and end-to-end tokens/s.

    PYTHONPATH=. python3 experiments/bench_decode.py --out_dir $OUT

Part A, a Qwen3-Next-shaped model with random weights (~1.4B parameters, dense FFN):
ms per plain decode step, per verify step at K = 2, 4, 8, and per propose (one MTP
draft step), at batch 1 and 8, with ``verify(K)/decode`` and ``propose/decode``; and
each decode step against its memory-bandwidth floor (weight + KV + state bytes read
per step / the device copy bandwidth measured in the same run), the step both as a
``fori_loop`` of steps and inside the plain greedy loop itself (``--loop_tokens``). A step's
time is the slope between two calls of different lengths (`experiments.timing`), which drops
what a call costs once; each row also gives the shorter call's time per step, that cost
included.
Random weights give no meaningful acceptance, so part A reports speed per step only.
Each row carries a CUPTI kernel count; with ``--decode_only`` the decode step's kernels
are also grouped by the model source lines (and output shapes) they come from.

Part B, the embedded default model on its evaluation prompts: tokens/s of plain
greedy vs speculative decoding (drafter prefilled, K = 2..6 at batch 1, 2..4 at 8), with
the acceptance measured on the same run. Results go to ``out_dir`` as JSON and a
markdown table, written after every measurement so a cut-off run keeps its numbers.

Both parts run the `ExecutionConfig` the ``MTP_*`` variables set (read once, in `main`), so an
A/B (`experiments/ab_decode.py`) flips a kernel or a GEMM layout by the environment.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import cupti
from experiments.ceilings import copy_bandwidth
from experiments.cli import require_ints
from experiments.model_shapes import BIG, SMALL
from experiments.results_io import write_atomic, write_json
from experiments.timing import per_step_slope
from mtp import analysis, runtime, sharding
from mtp.cache.state import TargetCache
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model import target
from mtp.model.params import count_params, init_params
from mtp.mtp_head import DrafterCache, draft_step
from mtp.speculative import MAX_VERIFY_WIDTH

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "runs/bench_decode", "Where results.json / results.md go.")
flags.DEFINE_bool("small", False, "Tiny shapes, for checking the script on a CPU.")
flags.DEFINE_integer("context", 2048, "KV positions already in the cache per sequence (part A).", lower_bound=1)
flags.DEFINE_integer("reps", 20, "Timed repetitions per measurement (median reported).", lower_bound=1)
flags.DEFINE_list("parts", ["A", "B"], "Which parts to run.")
flags.DEFINE_integer("steps_per_call", 16, "Part A: steps run back to back inside the shorter of the two timed "
                     "calls (the longer runs 4x as many; a step is the difference over the difference).", lower_bound=1)
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes to run.")
flags.DEFINE_list("spec_ks", ["2", "3", "4", "5", "6"], "Part B: verify widths K of the speculative runs "
                  "(batch 8 runs those up to 4).")

flags.register_validator("parts", lambda v: set(v) <= {"A", "B"}, "--parts: A, B or both")
require_ints("batches", 1, what="batch sizes")
require_ints("spec_ks", 2, MAX_VERIFY_WIDTH, "verify widths K; K = 2 is one draft per step")
flags.DEFINE_integer("loop_tokens", 64, "Part A: new tokens per sequence of the timed plain greedy loop "
                     "(`mtp.generation.generate` after a prompt of --context tokens); 0 skips it.", lower_bound=0)
flags.DEFINE_bool("loop_profile", False, "Part A: also profile the plain greedy loop's kernels with CUPTI, per "
                  "token (grouped by model source with --decode_only).")
flags.DEFINE_integer("tp", 1, "Part A: tensor-parallel devices (mtp.sharding). With tp > 1 the step runs the "
                     "XLA references (timed that way on 2026-11-29, before the kernels ran per shard).",
                     lower_bound=1)
flags.DEFINE_bool("decode_only", False, "Part A: time the plain decode step only (e.g. to compare XLA_FLAGS).")

class Report:
    def __init__(self, out: pathlib.Path, settings: runtime.ProcessSettings):
        self.out, self.data = out, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "device": str(jax.devices()[0].device_kind),
                                    "process_settings": settings.describe(),
                                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                    "mtp_env": {k: v for k, v in os.environ.items() if k.startswith("MTP_")},
                                    "rows": []}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, **row):
        self.data["rows"].append(row)
        logging.info("%s", row)
        print(json.dumps(row), flush=True)
        write_json(self.out / "results.json", self.data)


def _median_ms(fn, state, reps, *args):
    """Median wall ms of ``state = fn(state, *args)`` after two warm-up calls (compiles excluded).

    Weights travel as arguments: closed over, they would be baked into the program
    as constants (gigabytes of them, and minutes of constant folding).
    """
    for _ in range(2):
        state = jax.block_until_ready(fn(state, *args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(fn(state, *args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)), state


def _per_step_ms(step, state, reps, params, steps_per_call, profile=False, by_source=False):
    """ms of one ``step`` run back to back on device (`per_step_slope` over ``fori_loop``s of
    ``steps_per_call`` and 4x as many steps), the same for the shorter call whole, the state
    after, and (with ``profile``) `_kernel_profile` of the shorter program, per step.
    """
    def loop_of(n):
        return jax.jit(lambda c, p: jax.lax.fori_loop(0, n, lambda _, c: step(c, p), c), donate_argnums=0)

    loops = {n: loop_of(n) for n in (steps_per_call, 4 * steps_per_call)}
    box = [state]

    def timed(fn):
        def call():
            t = time.perf_counter()
            box[0] = jax.block_until_ready(fn(box[0], params))
            return time.perf_counter() - t
        return call

    ms, ms_call = per_step_slope({n: timed(fn) for n, fn in loops.items()}, reps, warmup=2)
    prof = {}
    if profile:
        prof, after = _kernel_profile(loops[steps_per_call], (box[0], params), steps_per_call, by_source=by_source)
        box[0] = box[0] if after is None else after
    return ms, ms_call, box[0], prof


_HLO_LINE = re.compile(r"^\s*%?([\w.-]+) = (\S+) .*?stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (?:\"(.*)\"|\{(.*)\})$")


def kernel_sources(compiled_text: str, depth: int = 3) -> dict[str, str]:
    """Kernel (fusion) name -> where in the model it comes from, from the optimised HLO.

    XLA keeps each op's Python stack in the module's stack-frame tables; the key is the
    innermost ``depth`` frames inside ``mtp/`` (``dense:19 < project:41 < gdn_layer:170``)
    and the op's output shape, which tells apart the projections that share ``dense``.
    """
    tables: dict[str, dict[int, object]] = {}
    section = None
    where = {}
    frames: dict[int, str] = {}
    for line in compiled_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
            continue
        row = _TABLE_ROW.match(line) if section is not None else None
        if row:
            fields = row.group(2) if row.group(2) is not None else dict(
                kv.split("=") for kv in row.group(3).split())
            section[int(row.group(1))] = fields
            continue
        section = None
        m = _HLO_LINE.match(line)
        if m:
            where[m.group(1)] = (int(m.group(3)), m.group(2).split("{")[0])
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs, stack = tables.get("FileLocations", {}), tables.get("StackFrames", {})

    def describe(frame_id: int) -> str:
        if frame_id not in frames:
            chain, fid, seen = [], frame_id, set()
            while fid in stack and fid not in seen and len(chain) < depth:
                seen.add(fid)
                loc = locs[int(stack[fid]["file_location_id"])]
                if "/mtp/" in files[int(loc["file_name_id"])]:
                    chain.append(f"{funcs[int(loc['function_name_id'])]}:{loc['line']}")
                fid = int(stack[fid]["parent_frame_id"]) - 1  # printed one-based, 0 = none
            frames[frame_id] = " < ".join(chain) or "?"
        return frames[frame_id]

    # Kernels are named after their fusion with '.' made '_' (gemm_fusion_dot.142 -> _142).
    return {name.replace(".", "_"): f"{describe(fid)} -> {shape}"
            for name, (fid, shape) in where.items()}


def source_of(where: dict[str, str], kernel: str) -> str:
    """``kernel_sources``' entry for a launched kernel's name (CUPTI's or XLA's thunk's)."""
    return (where.get(kernel.replace(".", "_")) or where.get(kernel.split(".")[0])
            or f"? {kernel[:40]}")


def abstract(tree, sharding=None):
    """``tree`` with its arrays (and array shapes) as ``ShapeDtypeStruct`` s, on ``sharding`` or
    where each array is; other leaves (static arguments) as they are. What lowers a program
    without its buffers: ones a call donated, or none at all (a deviceless compile)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding or a.sharding)
                        if isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) else a, tree)


def _kernel_profile(fn, args, steps, top=8, by_source=False):
    """CUPTI view of one call ``fn(*args)`` that runs ``steps`` steps (or tokens), per step:
    kernel count, summed kernel time and the costliest kernels; and the call's output
    (None where it did not run).

    Their sum against the in-loop step time tells launch gaps from slow kernels. Profiling
    the timed program itself matters: a single step that is not donated copies the whole
    state, and those copies show up as kernels or not depending on whether XLA recorded
    them into a CUDA graph (results/decode/decode_h200.md, 2026-11-30). With ``by_source``
    the kernels are also grouped by the model source line (and output shape) they come
    from: where a step's time goes, in the model's own terms. The profile says why it is missing where CUPTI is unavailable
    (a CPU run).
    """
    # The call may donate its inputs: keep their shapes to lower the program again afterwards.
    shapes = abstract(args) if by_source else None
    after = []

    def call(*a):
        after.append(fn(*a))
        return after[-1]

    try:
        timings = cupti.kernel_timings(call, args)
    except Exception as e:  # noqa: BLE001 - a profile is optional; say why it is missing
        return {"profile_error": f"{type(e).__name__}: {e}"[:300]}, (after[-1] if after else None)
    if len(timings) < steps:
        return {"profile_error": f"CUPTI saw {len(timings)} kernels for {steps} steps: a CUDA graph built "
                                 "before the first CUPTI session is not traced (cupti.start)"}, after[-1]
    by_name: dict[str, float] = {}
    for name, ms in timings:
        by_name[name] = by_name.get(name, 0.0) + ms / steps
    worst = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    out = {"kernels": round(len(timings) / steps, 2), "kernel_sum_ms": sum(ms for _, ms in timings) / steps,
           "top_kernels": [(n[:80], round(ms * 1e3, 1)) for n, ms in worst]}
    if by_source:
        where = kernel_sources(fn.lower(*shapes).compile().as_text())
        groups: dict[str, list] = {}
        for name, ms in timings:
            g = groups.setdefault(source_of(where, name), [0, 0.0])
            g[0] += 1
            g[1] += ms
        ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
        out["by_source"] = [(k, round(n / steps, 2), round(ms * 1e3 / steps, 1)) for k, (n, ms) in ranked[:40]]
    return out, after[-1]


def random_cache(cfg, batch, context, page, dtype, key):
    """A target cache holding ``context`` positions of random KV and state per sequence."""
    blocks = math.ceil((context + 16) / page)
    cache = TargetCache.create(cfg, batch, batch * blocks + 1, page, blocks, dtype)
    tables = (1 + np.arange(batch * blocks, dtype=np.int32)).reshape(batch, blocks)
    ks = iter(jax.random.split(key, len(jax.tree.leaves((cache.kv, cache.linear)))))  # one key a layer's array
    rand = lambda a: (0.5 * jax.random.normal(next(ks), a.shape, jnp.float32)).astype(a.dtype)
    return cache.replace(kv=jax.tree.map(rand, cache.kv), linear=jax.tree.map(rand, cache.linear),
                         block_tables=jnp.asarray(tables), lengths=jnp.full((batch,), context, jnp.int32))


def chained_verify_step(cfg: ModelConfig, execution: ExecutionConfig):
    """Part A's step: ``(cache, tokens [B, K]), params -> (cache, next tokens)``; K = 1 is decode.

    Every step's inputs come from the last step's outputs, as in the decode loop: the
    next tokens are the argmax of the logits (so the LM head is not dead code) and one
    position is committed (so the Gated DeltaNet state changes), then ``lengths`` is
    moved back so that every step reads the same KV positions. Constant inputs would
    let XLA hoist work out of the timed loop. `experiments/count_kernels.py` compiles
    this same step.
    """
    def step(state, p):
        c, toks = state
        c, out = target.verify(cfg, p, c, toks, execution=execution)
        c = target.commit(c, out, jnp.ones((toks.shape[0],), jnp.int32))
        return c.replace(lengths=c.lengths - 1), jnp.argmax(out.logits, -1).astype(jnp.int32)

    return step


def random_drafter_cache(cfg: ModelConfig, batch: int, context: int, page: int, dtype, key) -> DrafterCache:
    """A drafter cache holding ``context`` rows of random KV per sequence, the newest at key ``context``."""
    rand = random_cache(cfg, batch, context, page, dtype, key)
    return DrafterCache.create(cfg, batch, rand.kv.num_pages, page, rand.block_tables.shape[1], dtype).replace(
        kv=rand.kv.replace(k=rand.kv.k[:1], v=rand.kv.v[:1]), block_tables=rand.block_tables,
        rows=jnp.full((batch,), context, jnp.int32), last_pair_key=jnp.full((batch,), context, jnp.int32))


def chained_propose_step(cfg: ModelConfig, execution: ExecutionConfig):
    """One MTP draft step: ``(dcache, token [B], hidden [B, H]), params -> the same, one draft on``.

    The last draft's token and hidden feed the next, as in a chain of drafts; the row written is
    dropped again (``rows - 1``), so every step attends over the same rows.
    """
    def step(state, p):
        d, tok, h = state
        active = jnp.ones(tok.shape, bool)
        d, logits, h2 = draft_step(cfg, p, d, tok, h, d.last_pair_key, active, execution)
        return d.replace(rows=d.rows - 1), jnp.argmax(logits, -1).astype(jnp.int32), h2.astype(h.dtype)

    return step


def greedy_loop_ms(cfg: ModelConfig, params, batch: int, context: int, new_tokens: int, reps: int,
                   profile: bool = False, by_source: bool = False,
                   execution: ExecutionConfig = ExecutionConfig()) -> tuple[float, float, dict]:
    """ms a token of the plain greedy loop itself (`generate(speculative=False)`), after a prompt
    of ``context`` random tokens: the decode step as users run it, in its ``while_loop`` with the
    loops' compiler options. `per_step_slope` over runs of ``new_tokens`` and twice as many
    tokens, and the ``new_tokens`` run whole, per token; with no end-of-text id every sequence
    makes them all; the prompt's prefill is timed apart and excluded. With ``profile``, also
    `_kernel_profile` of one more run of the loop, per token.
    """
    from mtp.generation import generate, prepare_decode
    from mtp.speculative import SpecConfig

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, context).tolist() for _ in range(batch)]
    specs = {n: SpecConfig(max_new_tokens=n, execution=execution) for n in (new_tokens, 2 * new_tokens)}

    def timed(n):
        def call():
            r = generate(cfg, params, prompts, specs[n], speculative=False)
            if any(len(t) != n for t in r.tokens):
                raise RuntimeError(f"the greedy loop did not make {n} tokens per sequence")
            return r.decode_s
        return call

    ms, ms_call = per_step_slope({n: timed(n) for n in specs}, reps)
    prof = {}
    if profile:
        decode = prepare_decode(cfg, params, prompts, specs[new_tokens], speculative=False)
        prof, _ = _kernel_profile(decode.loop, decode.args, new_tokens, by_source=by_source)
    return ms, ms_call, prof


def part_a(report: Report, cfg: ModelConfig, context: int, reps: int, bw: float,
           execution: ExecutionConfig = ExecutionConfig()):
    dtype = jnp.bfloat16
    params = init_params(cfg, jax.random.key(1), dtype)
    n_target = count_params(params, include_mtp=False)
    tp = FLAGS.tp
    mesh = sharding.make_mesh(tp) if tp > 1 else None
    if mesh:  # the kernels' references, which XLA partitions
        execution = dataclasses.replace(execution, kernels=(("", "reference"),))
    if mesh:
        params = sharding.shard_params(params, cfg, mesh)
    # Each device streams about 1/tp of the weights, KV and state (the norms and the MTP
    # head's fc are replicated, a rounding error at this size).
    weight_bytes = 2 * n_target / tp
    report.add(part="A", what="model", params_target=n_target, params_total=count_params(params),
               context=context, copy_bandwidth_TBps=bw / 1e12, tp=tp,
               kernels=execution.impl_for("paged_attention"))
    for batch in [int(b) for b in FLAGS.batches]:
        cache = random_cache(cfg, batch, context, 16, dtype, jax.random.key(2))
        if mesh:
            cache = sharding.shard_cache(cache, cfg, mesh)
        kv_bytes = batch * len(cfg.attention_layers) * 2 * context * cfg.num_key_value_heads * cfg.head_dim * 2
        state_bytes = batch * len(cfg.linear_layers) * 4 * (
            cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim) * 2
        floor_ms = 1e3 * (weight_bytes + (kv_bytes + state_bytes) / tp) / bw
        n = FLAGS.steps_per_call
        one = jnp.ones((batch,), jnp.int32)

        verify_step = chained_verify_step(cfg, execution)
        state = (cache, jnp.ones((batch, 1), jnp.int32))
        decode_ms, call_ms, state, prof = _per_step_ms(verify_step, state, reps, params, n, profile=not mesh,
                                                       by_source=FLAGS.decode_only)
        report.add(part="A", what="decode", batch=batch, ms=decode_ms, ms_whole_call=call_ms, floor_ms=floor_ms,
                   ratio_to_floor=decode_ms / floor_ms, **prof)
        if FLAGS.loop_tokens and not mesh:
            loop_ms, call_ms, loop_prof = greedy_loop_ms(cfg, params, batch, context, FLAGS.loop_tokens, reps,
                                                         profile=FLAGS.loop_profile, by_source=FLAGS.decode_only,
                                                         execution=execution)
            report.add(part="A", what="plain greedy loop", batch=batch, ms=loop_ms, ms_whole_call=call_ms,
                       floor_ms=floor_ms, ratio_to_floor=loop_ms / floor_ms, ratio_to_decode=loop_ms / decode_ms,
                       **loop_prof)
        if FLAGS.decode_only:
            continue
        for k in (2, 4, 8):
            state = (state[0], jnp.ones((batch, k), jnp.int32))
            ms, call_ms, state, prof = _per_step_ms(verify_step, state, reps, params, n, profile=True)
            report.add(part="A", what=f"verify K={k}", batch=batch, ms=ms, ms_whole_call=call_ms,
                       ratio_to_decode=ms / decode_ms, **prof)
        del state
        dc = random_drafter_cache(cfg, batch, context, 16, dtype, jax.random.key(3))
        if mesh:
            dc = sharding.shard_cache(dc, cfg, mesh)
        hidden = jax.random.normal(jax.random.key(4), (batch, cfg.hidden_size), dtype)
        ms, call_ms, pstate, prof = _per_step_ms(chained_propose_step(cfg, execution), (dc, one, hidden), reps, params,
                                                 n, profile=True)
        report.add(part="A", what="propose (1 draft)", batch=batch, ms=ms, ms_whole_call=call_ms,
                   ratio_to_decode=ms / decode_ms, **prof)
        del pstate, dc


def part_b(report: Report, reps: int, execution: ExecutionConfig = ExecutionConfig()):
    from mtp.checkpoint import load_pretrained
    from mtp.data.sessions import first_prompt_ids, load_preamble, load_sessions
    from mtp.data.tokenizer import Tokenizer
    from mtp.generation import generate
    from mtp.speculative import SpecConfig

    ckpt = "assets/default_model"
    cfg, params = load_pretrained(ckpt)
    tok = Tokenizer.load(f"{ckpt}/tokenizer.json")
    pre = load_preamble("assets/sessions/preamble.txt")
    sessions = load_sessions("assets/sessions/eval_sessions.jsonl")
    new = 128 if not FLAGS.small else 16
    for batch in [int(b) for b in FLAGS.batches]:
        prompts = [first_prompt_ids(pre, s.turns[0].user, tok) for s in sessions[:batch]]
        ks = [int(k) for k in FLAGS.spec_ks]
        runs = [("plain", 0)] + [("spec", k) for k in ks if batch == 1 or k <= 4]
        base = None
        for name, k in runs:
            spec = SpecConfig(verify_width=k or 2, max_new_tokens=new, execution=execution)  # plain ignores the width
            gen = lambda: generate(cfg, params, prompts, spec, speculative=k > 0)
            gen()  # compile
            res = [gen() for _ in range(reps)]
            decode_s = float(np.median([r.decode_s for r in res]))
            toks = sum(len(t) for t in res[0].tokens)
            tps = toks / decode_s
            if base is None:
                base, base_tokens = tps, res[0].tokens
            row = dict(part="B", what=f"{name} K={k}" if k else name, batch=batch, tokens_per_s=tps,
                       speedup=tps / base, identical_to_plain=res[0].tokens == base_tokens)
            if k:
                # The lossless check at equal GEMM shapes (SpecConfig.plain_width): untimed.
                wide = generate(cfg, params, prompts, dataclasses.replace(spec, plain_width=k), speculative=False)
                row.update(res[0].stats.as_dict(), identical_to_plain_same_width=res[0].tokens == wide.tokens,
                           divergence=analysis.first_divergence(cfg, params, prompts, res[0].tokens, base_tokens),
                           divergence_same_width=analysis.first_divergence(cfg, params, prompts, res[0].tokens,
                                                                  wide.tokens))
            report.add(**row)


def _guarded(report, part, fn, *args) -> bool:
    """Run one part; a failure is recorded (and the other part still runs). Returns whether it ran through."""
    try:
        fn(*args)
        return True
    except Exception as e:  # a benchmark keeps what it measured and says what broke
        logging.exception("part %s failed", part)
        report.data.setdefault("errors", []).append(f"part {part}: {type(e).__name__}: {e}"[:2000])
        write_json(report.out / "results.json", report.data)
        return False


def _markdown(data) -> str:
    lines = [f"# Decode benchmark\n\n{data['device']}, {data['date']}, XLA_FLAGS={data['xla_flags']!r}\n", "| part | what | batch | value | ratio |",
             "|---|---|---|---|---|"]
    for r in data["rows"]:
        if r["what"] == "model":
            lines.append(f"| A | model: {r['params_target'] / 1e9:.2f}B target params, context {r['context']}, "
                         f"copy BW {r['copy_bandwidth_TBps']:.2f} TB/s | | | |")
        elif r["part"] == "A":
            ratio = (f"{r['ratio_to_floor']:.2f}x floor ({r['floor_ms']:.3f} ms)" if "floor_ms" in r
                     else f"{r['ratio_to_decode']:.3f}x decode")
            if "floor_ms" in r and "ratio_to_decode" in r:
                ratio += f"; {r['ratio_to_decode']:.3f}x the decode step"
            if "kernel_sum_ms" in r:
                ratio += f"; {r['kernels']} kernels, {r['kernel_sum_ms']:.3f} ms of kernel time"
            whole = f" ({r['ms_whole_call']:.3f} with the call's own cost)" if "ms_whole_call" in r else ""
            lines.append(f"| A | {r['what']} | {r['batch']} | {r['ms']:.3f} ms{whole} | {ratio} |")
        else:
            acc = f", mean acc. len {r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else ""
            same = (f", identical at the verify's width={r['identical_to_plain_same_width']}"
                    if "identical_to_plain_same_width" in r else "")
            for key, what in (("divergence", "vs plain"), ("divergence_same_width", "vs the verify's width")):
                d = r.get(key)
                if d:
                    same += (f"; first flip {what}: sequence {d['sequence']} token {d['token']}, top-2 "
                             f"logit gap {d['top2_gap']:.3g} (logit std {d['logit_std']:.3g})")
            lines.append(f"| B | {r['what']} | {r['batch']} | {r['tokens_per_s']:.1f} tok/s{acc} | "
                         f"{r['speedup']:.2f}x plain, identical={r['identical_to_plain']}{same} |")
    lines += [f"\nError: {e}" for e in data.get("errors", [])]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    settings = runtime.configure_process()  # before anything starts JAX's backend
    logging.info("process settings: %s", settings.describe())
    report = Report(pathlib.Path(FLAGS.out_dir), settings)
    execution = ExecutionConfig.from_environ(os.environ)
    failed = []
    if "A" in FLAGS.parts:  # the part that profiles
        if jax.default_backend() == "gpu":
            cupti.start()  # before any loop's CUDA graph exists, or its profile would miss the graph's kernels
        cfg = ModelConfig.from_hf(SMALL if FLAGS.small else BIG)
        bw, _ = copy_bandwidth((1 << 30) if not FLAGS.small else (1 << 22))
        if not _guarded(report, "A", part_a, report, cfg, FLAGS.context if not FLAGS.small else 64, FLAGS.reps, bw,
                        execution):
            failed.append("A")
    if "B" in FLAGS.parts and not _guarded(report, "B", part_b, report, FLAGS.reps, execution):
        failed.append("B")
    md = _markdown(report.data)
    write_atomic(report.out / "results.md", md)
    print(md)
    if failed:  # after the files, so the rows measured are kept; the exit status is what scripts check
        raise SystemExit(f"part {' and '.join(failed)} failed; the errors are in {report.out}/results.json and "
                         "results.md")


if __name__ == "__main__":
    app.run(main)
