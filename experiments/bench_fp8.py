r"""Block-scaled FP8 weights at a decode step's few rows on one GPU: XLA's forms against bf16.

    PYTHONPATH=. python3 -m experiments.bench_fp8 --out_dir=$OUT
    python -m experiments.bench_fp8 --small --out_dir=/tmp/fp8        # tiny shapes, a CPU check

A decode or verify step reads every weight once for 1-8 rows, so an FP8 weight can halve its time
only if the GEMM reads the 8-bit values where they lie: a dequantize that XLA writes out as a bf16
copy before the dot costs more than the bf16 weight itself. This times, for Qwen3-Next-80B-A3B's
projection shapes and its routed experts (top-10 of 512), each form of ``x @ w.T``:

* ``bf16``: the plain weight (the baseline);
* ``w8a16``: `mtp.ops.fp8.matmul`, the model's form: the block scales expanded and multiplied into
  the converted values right before the dot (one elementwise prologue XLA may fuse into the GEMM);
* ``post_scale``: the dot of each 128-column block of the converted values alone, f32 accumulated,
  then scaled per (row block, column block) and summed: no elementwise work on the weight but the
  convert;
* ``convert_only``: the converted values with no scale at all: not the weight (its error is not
  checked), the bound of what any form that reads the values can reach;
* ``pallas``: `mtp.ops.fp8.triton`'s weight-streaming kernel at its default tiling
  (`triton.default_config`), and ``pallas_dot`` / ``pallas_reduce`` the same kernel with its tile
  product forced to Triton's dot or to the f32 multiply and sum (on a CPU these run in Pallas'
  interpreter, and only under ``--small``);
* ``experts``: the routed-expert FFN's gather form (`mtp.ops.moe.reference.routed_experts_gather`)
  over bf16 and FP8 expert stacks, a fresh routing each call, and ``fp8 kernel`` the same FFN on
  the grouped Triton kernel (`mtp.ops.moe.fp8_triton`).

Each time is the median over ``--reps`` jitted calls, each a ``lax.scan`` over ``--stack`` weights
(or routings), more bytes than the 50 MB L2 holds, divided by the stack; the floor is the bytes a
call must read over the measured copy bandwidth. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.ceilings import copy_bandwidth, median_seconds
from experiments.results_io import provenance, write_atomic, write_json
from mtp.ops import fp8
from mtp.ops.fp8 import triton as fp8_triton
from mtp.ops.moe import fp8_triton as moe_fp8
from mtp.ops.moe import reference as moe_ref
from mtp.ops.lowering import on_gpu

FLAGS = flags.FLAGS
# (name, out, in) of Qwen3-Next-80B-A3B's per-layer projections (configs/models/qwen3_next_80b_a3b.json).
SHAPES = (("linear_attn.in_proj_qkvz", 12288, 2048), ("linear_attn.out_proj", 2048, 4096),
          ("self_attn.q_proj (gated)", 8192, 2048), ("self_attn.o_proj", 2048, 4096),
          ("shared_expert.gate_proj", 512, 2048), ("shared_expert.down_proj", 2048, 512))
SMALL_SHAPES = (("small_a", 384, 256), ("small_b", 256, 320))
EXPERTS = dict(num=512, top_k=10, inter=512, hidden=2048)
SMALL_EXPERTS = dict(num=16, top_k=2, inter=64, hidden=128)


def post_scale(x: jax.Array, w: fp8.BlockFp8Weight) -> jax.Array:
    """``x @ dequantize(w).T`` with the scales applied after a per-column-block dot (f32 ``[..., out]``)."""
    out, inp = w.shape
    bo, bi = w.block
    nbi = -(-inp // bi)
    pad = nbi * bi - inp
    xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], nbi, bi)
    qb = jnp.pad(w.values.astype(x.dtype), ((0, 0), (0, pad))).reshape(out, nbi, bi)
    partial = jnp.einsum("...bi,obi->...ob", xb, qb, preferred_element_type=jnp.float32)
    scales = jnp.repeat(w.scale_inv, bo, axis=0)[:out]  # [out, nbi]
    return jnp.sum(partial * scales, axis=-1)


def convert_only(x: jax.Array, w: fp8.BlockFp8Weight) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)


def bf16_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)


def kernel_form(dot: bool | None = None):
    """The Triton kernel (compiled on a GPU, interpreted elsewhere) at its default tiling, ``dot`` forced if given."""
    def run(x, w):
        config = fp8_triton.default_config(x.shape[0], *w.shape)
        config = config if dot is None else dataclasses.replace(config, dot=dot)
        return fp8_triton.w8a16(x, w, config=config, interpret=not on_gpu())
    return run


GEMM_FORMS = {"w8a16": lambda x, w: fp8.matmul(x, w), "post_scale": post_scale, "convert_only": convert_only}
KERNEL_FORMS = {"pallas": kernel_form(), "pallas_dot": kernel_form(True), "pallas_reduce": kernel_form(False)}


def _scan_gemm(form):
    """``x`` through each weight of a stack, the outputs summed: one call streams the whole stack."""
    def run(x, stack):
        def body(acc, w):
            return acc + form(x, w), None
        out = jax.eval_shape(lambda w: form(x, w), jax.tree.map(lambda a: a[0], stack))
        return jax.lax.scan(body, jnp.zeros(out.shape, jnp.float32), stack)[0]
    return jax.jit(run)


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def bench_gemms(shapes, rows_list, stack, reps, bw, key, forms=None) -> list[dict]:
    """One row per (shape, rows, form): bf16 first, then ``forms`` (default: XLA's and the kernel's)."""
    forms = {**GEMM_FORMS, **KERNEL_FORMS} if forms is None else forms
    out = []
    for name, o, i in shapes:
        kw, kx = jax.random.split(jax.random.fold_in(key, o * 7919 + i))
        w = (jax.random.normal(kw, (stack, o, i), jnp.float32) * 0.02).astype(jnp.bfloat16)
        q = fp8.quantize(w)
        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(kx, rows), (rows, i), jnp.bfloat16)
            exact = x.astype(jnp.float32) @ fp8.dequantize(jax.tree.map(lambda a: a[0], q)).T
            base_s = median_seconds(_scan_gemm(bf16_dot), (x, w), reps, warmup=1) / stack
            out.append(dict(what=name, out=o, **{"in": i}, rows=rows, form="bf16", us=1e6 * base_s,
                            floor_us=1e6 * _nbytes(w) / stack / bw, ratio_to_bf16=1.0))
            for form, fn in forms.items():
                got = fn(x, jax.tree.map(lambda a: a[0], q))
                err = None if form == "convert_only" else float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact)))
                s = median_seconds(_scan_gemm(fn), (x, q), reps, warmup=1) / stack
                out.append(dict(what=name, out=o, **{"in": i}, rows=rows, form=form, us=1e6 * s,
                                floor_us=1e6 * _nbytes(q) / stack / bw, ratio_to_bf16=s / base_s, rel_err=err))
    return out


def bench_experts(shape, rows_list, stack, reps, bw, key, kernel=True) -> list[dict]:
    """One row per (rows, form): the gather form over bf16 and FP8 experts, and (``kernel``) FP8 on the Triton kernel."""
    e, k, inter, h = shape["num"], shape["top_k"], shape["inter"], shape["hidden"]
    keys = jax.random.split(key, 4)

    def stacks(dtype_fn):
        return [dtype_fn((jax.random.normal(kk, s, jnp.float32) * 0.02).astype(jnp.bfloat16))
                for kk, s in zip(keys[:3], ((e, inter, h), (e, inter, h), (e, h, inter)))]

    plain, quant = stacks(lambda a: a), stacks(fp8.quantize)
    out = []
    for rows in rows_list:
        x = jax.random.normal(jax.random.fold_in(keys[3], rows), (rows, h), jnp.bfloat16)
        scores = jax.random.uniform(jax.random.fold_in(keys[3], 100 + rows), (stack, rows, e))
        ids = jax.lax.top_k(scores, k)[1]
        weights = jnp.full((stack, rows, k), 1.0 / k, jnp.float32)

        def run(x, ids, weights, gate, up, down):
            def body(acc, step):
                i, wt = step
                return acc + moe_ref.routed_experts_gather(x, i, wt, gate, up, down), None
            return jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), (ids, weights))[0]

        def run_kernel(x, ids, weights, gate, up, down):
            def body(acc, step):
                i, wt = step
                return acc + moe_fp8.routed_experts_gather(x, i, wt, gate, up, down, interpret=not on_gpu()), None
            return jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), (ids, weights))[0]

        distinct = float(np.mean([np.unique(np.asarray(ids[s])).size for s in range(stack)]))
        base_s = None
        forms = [("bf16", plain, run), ("fp8", quant, run)] + ([("fp8 kernel", quant, run_kernel)] if kernel else [])
        for form, ws, fn in forms:
            s = median_seconds(jax.jit(fn), (x, ids, weights, *ws), reps, warmup=1) / stack
            base_s = base_s or s
            per_expert = _nbytes(ws) / e
            out.append(dict(what=f"routed experts (top-{k} of {e}, gather)", rows=rows, form=form, us=1e6 * s,
                            floor_us=1e6 * distinct * per_expert / bw, ratio_to_bf16=s / base_s,
                            distinct_experts=distinct))
    return out


def markdown(data) -> str:
    lines = [f"# FP8 weight GEMMs at few rows\n\n{data['device']}, {data['date']}; copy bandwidth "
             f"{data['copy_bandwidth_TBps']:.2f} TB/s; every ratio is of this run.\n",
             "| what | rows | form | µs | floor µs | x floor | x bf16 | rel. error |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        shape = f" [{r['out']}, {r['in']}]" if "out" in r else ""
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
        lines.append(f"| {r['what']}{shape} | {r['rows']} | {r['form']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['us'] / r['floor_us']:.2f} | {r['ratio_to_bf16']:.2f} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    small = FLAGS.small
    bw, _ = copy_bandwidth((1 << 22) if small else (1 << 30))
    rows = [int(r) for r in FLAGS.rows]
    key = jax.random.key(0)
    data = dict(provenance(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                device=str(jax.devices()[0].device_kind), copy_bandwidth_TBps=bw / 1e12, rows=[])
    # Off a GPU the kernel runs in Pallas' interpreter: at the real shapes that takes hours.
    forms = {**GEMM_FORMS, **KERNEL_FORMS} if small or on_gpu() else GEMM_FORMS
    data["rows"] += bench_gemms(SMALL_SHAPES if small else SHAPES, rows, FLAGS.stack, FLAGS.reps, bw, key, forms)
    data["rows"] += bench_experts(SMALL_EXPERTS if small else EXPERTS, rows, FLAGS.stack, FLAGS.reps, bw, key,
                                  kernel=small or on_gpu())
    write_json(out / "results.json", data)
    md = markdown(data)
    write_atomic(out / "results.md", md)
    print(md)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


def define_flags():
    flags.DEFINE_string("out_dir", "runs/bench_fp8", "Where results.json and results.md go.")
    flags.DEFINE_list("rows", ["1", "4", "8"], "Activation rows of each GEMM (a decode step's tokens).")
    flags.DEFINE_integer("stack", 16, "Weights (or routings) one timed call streams: more bytes than the L2.",
                         lower_bound=1)
    flags.DEFINE_integer("reps", 20, "Timed calls per row (the median).", lower_bound=1)
    flags.DEFINE_bool("small", False, "Tiny shapes, for a CPU check of the script.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
