"""Probe: add_rms_norm's kernel time at the 1.38B batch-1 shapes, by num_warps; XLA's add + norm beside it."""
import functools, statistics
import jax, jax.numpy as jnp
import mtp.model
from experiments import cupti
from mtp.pallas import add_rms_norm as arn
from jax.experimental import pallas as pl
from mtp.pallas.backend import triton_compiler_params

def kernel_us(fn, args, reps=40):
    fn(*args)
    ts = []
    for _ in range(reps):
        t = cupti.kernel_timings(fn, args)
        ts.append(sum(ms for n, ms in t) * 1e3)
    return statistics.median(ts), [n for n, _ in t]

x = jax.random.normal(jax.random.key(0), (2, 2048)).astype(jnp.bfloat16)
y = jax.random.normal(jax.random.key(1), (1, 2048)).astype(jnp.bfloat16)
w = jax.random.normal(jax.random.key(2), (2048,)).astype(jnp.bfloat16)
ref = jax.jit(functools.partial(arn.add_rms_norm_reference, eps=1e-6))
print("xla", kernel_us(ref, (x, y, w)), flush=True)
for warps in (1, 2, 4, 8, 16):
    def f(x, y, w, warps=warps):
        h = x.shape[-1]
        row = pl.BlockSpec((1, h), lambda r: (r, 0))
        return pl.pallas_call(functools.partial(arn._kernel, real_rows=1, eps=1e-6), grid=(2,),
            in_specs=[row, pl.BlockSpec((1, h), lambda r: (0, 0)), pl.BlockSpec((h,), lambda r: (0,))],
            out_specs=[row, row], out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
            **triton_compiler_params(False, num_warps=warps))(x, y, w)
    fn = jax.jit(f)
    got, want = fn(x, y, w), ref(x, y, w)
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(got, want))
    print("warps", warps, kernel_us(fn, (x, y, w)), "err", err, flush=True)
