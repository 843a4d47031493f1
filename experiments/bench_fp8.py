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
  (`triton.default_config`; on a CPU it runs in Pallas' interpreter, and only under ``--small``);
  ``kernel_pays`` on its rows says whether the model's ``"auto"`` takes it there;
* with ``--tilings``, ``pallas <tiling>``: the kernel at every `tilings` candidate as well, each
  checked against the exact product like the rest, to choose `triton.default_config` by;
* ``experts``: the routed-expert FFN's gather form (`mtp.ops.moe.reference.routed_experts_gather`)
  over bf16 and FP8 expert stacks, one random routing per row count.

Each time is the median over ``--reps`` calls of one weight (or one routing) with the L2 cold, on
a GPU its kernels' CUPTI time (`ceilings.device_seconds`: a ``lax.scan`` over a stack of weights
would slice each out, and XLA may copy the slice before the dot); the floor is the bytes a call
must read over the measured copy bandwidth. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.ceilings import copy_bandwidth, device_seconds
from experiments.results_io import provenance, write_atomic, write_json
from mtp.ops import fp8
from mtp.ops.fp8 import triton as fp8_triton
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


def kernel(x, w, config=None):
    """The Triton kernel (compiled on a GPU, interpreted elsewhere), at ``config`` or its default tiling."""
    return fp8_triton.w8a16(x, w, config=config, interpret=not on_gpu())


def tilings(out: int, inp: int) -> list[fp8_triton.Fp8GemvConfig]:
    """The tilings ``--tilings`` times for an ``[out, in]`` weight beside the default one.

    Output tiles of 32-128 rows over whole 128-column scale blocks, every power-of-two split up to
    the input tiles, 4 or 8 warps and 2 or 4 pipeline stages; a candidate giving fewer than 32 or
    more than 2048 programs is left out (too few to fill the SMs, or pure overhead).
    """
    default = fp8_triton.default_config(out, inp)
    found = []
    for bo in (32, 64, 128):
        for bi in (128,):
            tiles = -(-inp // bi)
            for splits in (1, 2, 4, 8, 16):
                programs = -(-out // bo) * splits
                if splits > tiles or not 32 <= programs <= 2048:
                    continue
                for warps in (4, 8):
                    for stages in (2, 4):
                        cfg = fp8_triton.Fp8GemvConfig(block_out=bo, block_in=bi, splits=splits,
                                                       num_warps=warps, num_stages=stages)
                        if cfg != default:
                            found.append(cfg)
    return found


def tiling_name(cfg: fp8_triton.Fp8GemvConfig) -> str:
    return (f"pallas {cfg.block_out}x{cfg.block_in}/s{cfg.splits}/w{cfg.num_warps}/p{cfg.num_stages}")


GEMM_FORMS = {"w8a16": lambda x, w: fp8.matmul(x, w, impl="reference"), "post_scale": post_scale,
              "convert_only": convert_only}
KERNEL_FORMS = {"pallas": kernel}


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def bench_gemms(shapes, rows_list, reps, bw, key, forms=None, sweep=False) -> list[dict]:
    """One row per (shape, rows, form): bf16 first, then ``forms`` (default: XLA's and the kernel's),
    then, with ``sweep``, the kernel at each of `tilings` (named by `tiling_name`)."""
    forms = {**GEMM_FORMS, **KERNEL_FORMS} if forms is None else forms
    out = []
    for name, o, i in shapes:
        shape_forms = dict(forms)
        configs = {"pallas": fp8_triton.default_config(o, i)} if "pallas" in forms else {}
        if sweep:
            configs.update({tiling_name(c): c for c in tilings(o, i)})
            shape_forms.update({f: functools.partial(kernel, config=c) for f, c in configs.items() if f != "pallas"})
        kw, kx = jax.random.split(jax.random.fold_in(key, o * 7919 + i))
        w = (jax.random.normal(kw, (o, i), jnp.float32) * 0.02).astype(jnp.bfloat16)
        q = fp8.quantize(w)
        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(kx, rows), (rows, i), jnp.bfloat16)
            exact = x.astype(jnp.float32) @ fp8.dequantize(q).T
            base_s = device_seconds(jax.jit(bf16_dot), (x, w), reps)
            out.append(dict(what=name, out=o, **{"in": i}, rows=rows, form="bf16", us=1e6 * base_s,
                            floor_us=1e6 * _nbytes(w) / bw, ratio_to_bf16=1.0))
            for form, fn in shape_forms.items():
                t0 = time.perf_counter()
                fn = jax.jit(fn)
                got = jax.block_until_ready(fn(x, q))
                first_s = time.perf_counter() - t0  # the first call: its compile
                err = None if form == "convert_only" else float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact)))
                s = device_seconds(fn, (x, q), reps)
                out.append(dict(what=name, out=o, **{"in": i}, rows=rows, form=form, us=1e6 * s,
                                floor_us=1e6 * _nbytes(q) / bw, ratio_to_bf16=s / base_s, rel_err=err,
                                first_call_s=first_s,
                                auto_takes=fp8_triton.pays(rows, o) if form == "pallas" else None,
                                tiling=dataclasses.asdict(configs[form]) if form in configs else None))
                print(f"{name} [{o}, {i}] rows={rows} {form}: {1e6 * s:.1f} us ({s / base_s:.2f}x bf16), "
                      f"error {err}, first call {first_s:.1f} s", flush=True)
    return out


def bench_experts(shape, rows_list, reps, bw, key) -> list[dict]:
    """One row per (rows, form): the gather form over bf16 and over FP8 experts."""
    e, k, inter, h = shape["num"], shape["top_k"], shape["inter"], shape["hidden"]
    keys = jax.random.split(key, 4)

    def stacks(dtype_fn):
        return [dtype_fn((jax.random.normal(kk, s, jnp.float32) * 0.02).astype(jnp.bfloat16))
                for kk, s in zip(keys[:3], ((e, inter, h), (e, inter, h), (e, h, inter)))]

    plain, quant = stacks(lambda a: a), stacks(fp8.quantize)
    forms = [("bf16", plain), ("fp8", quant)]
    out = []
    for rows in rows_list:
        x = jax.random.normal(jax.random.fold_in(keys[3], rows), (rows, h), jnp.bfloat16)
        ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(keys[3], 100 + rows), (rows, e)), k)[1]
        weights = jnp.full((rows, k), 1.0 / k, jnp.float32)
        distinct = int(np.unique(np.asarray(ids)).size)
        base_s = None
        for form, ws in forms:
            s = device_seconds(jax.jit(moe_ref.routed_experts_gather), (x, ids, weights, *ws), reps)
            base_s = base_s or s
            out.append(dict(what=f"routed experts (top-{k} of {e}, gather)", rows=rows, form=form, us=1e6 * s,
                            floor_us=1e6 * distinct * _nbytes(ws) / e / bw, ratio_to_bf16=s / base_s,
                            distinct_experts=distinct))
    return out


def markdown(data) -> str:
    lines = [f"# FP8 weight GEMMs at few rows\n\n{data['device']}, {data['date']}; copy bandwidth "
             f"{data['copy_bandwidth_TBps']:.2f} TB/s; every ratio is of this run.\n",
             "`auto` marks the kernel's rows where the model's ``impl=\"auto\"`` takes it (`triton.pays`).\n",
             "| what | rows | form | µs | floor µs | x floor | x bf16 | rel. error |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        shape = f" [{r['out']}, {r['in']}]" if "out" in r else ""
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
        form = r["form"] + (" (auto)" if r.get("auto_takes") else "")
        lines.append(f"| {r['what']}{shape} | {r['rows']} | {form} | {r['us']:.1f} | {r['floor_us']:.1f} | "
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
    forms = {f: fn for f, fn in forms.items() if f in FLAGS.forms}
    shapes = [s for s in (SMALL_SHAPES if small else SHAPES) if not FLAGS.shapes or s[0].split()[0] in FLAGS.shapes]
    data["rows"] += bench_gemms(shapes, rows, FLAGS.reps, bw, key, forms, sweep=FLAGS.tilings and "pallas" in forms)
    if FLAGS.experts:
        data["rows"] += bench_experts(SMALL_EXPERTS if small else EXPERTS, rows, FLAGS.reps, bw, key)
    write_json(out / "results.json", data)
    md = markdown(data)
    write_atomic(out / "results.md", md)
    print(md)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


def define_flags():
    flags.DEFINE_string("out_dir", "runs/bench_fp8", "Where results.json and results.md go.")
    flags.DEFINE_list("rows", ["1", "4", "8"], "Activation rows of each GEMM (a decode step's tokens).")
    flags.DEFINE_integer("reps", 20, "Timed calls per row (the median).", lower_bound=1)
    flags.DEFINE_bool("small", False, "Tiny shapes, for a CPU check of the script.")
    flags.DEFINE_multi_enum("forms", list(GEMM_FORMS) + list(KERNEL_FORMS), list(GEMM_FORMS) + list(KERNEL_FORMS),
                            "GEMM forms timed beside bf16 (the kernel's only on a GPU or with --small).")
    flags.DEFINE_list("shapes", [], f"Projections to time (default all): {', '.join(s[0].split()[0] for s in SHAPES)}.")
    flags.DEFINE_bool("experts", True, "Also time the routed experts' FFN.")
    flags.DEFINE_bool("tilings", False, "Also time the kernel at every candidate tiling (`tilings`).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
