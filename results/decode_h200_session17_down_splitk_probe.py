"""Probe: the FFN's down projection as an explicit batched split-K, its partial sums, residual add and
the next layer's input norm in one kernel; against the model's current form. 16 layers, 1.38B shapes."""
import functools, statistics, sys, time
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from experiments import cupti
from mtp.model.layers import linear, rms_norm
from mtp.pallas.backend import triton_compiler_params

L, H, I, R = 16, 2048, 5632, 2
S = int(sys.argv[1]) if len(sys.argv) > 1 else 8
EPS = 1e-6
CPU = jax.default_backend() == 'cpu'
keys = iter(jax.random.split(jax.random.key(0), 100))
rnd = lambda shape, scale: (jax.random.normal(next(keys), shape) * scale).astype(jnp.bfloat16)
w_gu = [rnd((2 * I, H), H ** -0.5) for _ in range(L)]
w_d = [rnd((H, I), I ** -0.5) for _ in range(L)]
w_n = [rnd((H,), 0.1) for _ in range(L + 1)]
w_db = [w.reshape(H, S, I // S).transpose(1, 0, 2) for w in w_d]  # [S, H, I/S], laid out once
x0 = jnp.zeros((R, H), jnp.bfloat16).at[0].set(rnd((H,), 1.0))


def sum_add_norm_kernel(p_ref, x_ref, w_ref, s_ref, h_ref):
    y = jnp.sum(p_ref[...].astype(jnp.float32), axis=0).astype(x_ref.dtype)  # [1, H]
    s = (x_ref[...].astype(jnp.float32) + y.astype(jnp.float32)).astype(s_ref.dtype)
    s_ref[...] = s
    sf = s.astype(jnp.float32)
    scale = lax.rsqrt(jnp.sum(sf * sf, axis=-1, keepdims=True) / H + EPS)
    h_ref[...] = (sf * scale * (1.0 + w_ref[...].astype(jnp.float32))).astype(h_ref.dtype)


def sum_add_norm(p, x, w, warps=8):
    s_, r_, h_ = p.shape
    row = pl.BlockSpec((1, h_), lambda r: (r, 0))
    return pl.pallas_call(
        sum_add_norm_kernel, grid=(r_,),
        in_specs=[pl.BlockSpec((s_, None, h_), lambda r: (0, r, 0)), row, pl.BlockSpec((h_,), lambda r: (0,))],
        out_specs=[row, row], out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
        interpret=CPU, **triton_compiler_params(CPU, num_warps=warps))(p, x, w)


def ffn_act(h, wgu):
    gu = linear(h, wgu)
    return jax.nn.silu(gu[:, :I]) * gu[:, I:]


def step_current(x, ws):
    wgu, wd, wn = ws
    for l in range(L):
        h = rms_norm(x, wn[l], EPS)
        x = x + linear(ffn_act(h, wgu[l]), wd[l])
    return x + rms_norm(x, wn[L], EPS)  # the last norm (the model's final norm) consumed


def partials(a, wdb):
    return jnp.einsum("sri,shi->srh", a.reshape(R, S, I // S).transpose(1, 0, 2), wdb,
                      preferred_element_type=jnp.float32)


def step_fused(x, ws, xla=False):
    wgu, wdb, wn = ws
    h = rms_norm(x, wn[0], EPS)
    for l in range(L):
        p = partials(ffn_act(h, wgu[l]), wdb[l])
        if xla:
            s = (x.astype(jnp.float32) + jnp.sum(p, axis=0).astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
            x, h = s, rms_norm(s, wn[l + 1], EPS)
        else:
            x, h = sum_add_norm(p, x, wn[l + 1])
    return x + h


def looped(step, n):
    @jax.jit
    def f(x, ws):
        return lax.fori_loop(0, n, lambda i, x: step(x, ws), x)
    return f


variants = {
    "current": (step_current, (w_gu, w_d, w_n)),
    "fused_kernel": (step_fused, (w_gu, w_db, w_n)),
    "fused_xla": (functools.partial(step_fused, xla=True), (w_gu, w_db, w_n)),
}
ref = jax.jit(step_current)(x0, (w_gu, w_d, w_n))
for name, (step, ws) in variants.items():
    got = jax.jit(step)(x0, ws)
    err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    if CPU:
        print(name, err); continue
    t = cupti.kernel_timings(jax.jit(step), (x0, ws))
    t = cupti.kernel_timings(jax.jit(step), (x0, ws))
    print(f"{name}: rel err {err:.2e}; one step {len(t)} kernels, {sum(ms for _, ms in t)*1e3:.1f} us kernel time", flush=True)
if CPU:
    sys.exit()
N = 20
fns = {name: looped(step, N) for name, (step, ws) in variants.items()}
for name, f in fns.items():
    f(x0, variants[name][1]).block_until_ready()
times = {name: [] for name in fns}
for rep in range(15):
    for name, f in fns.items():
        t0 = time.perf_counter(); f(x0, variants[name][1]).block_until_ready()
        times[name].append((time.perf_counter() - t0) / N * 1e6)
base = statistics.median(times["current"])
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"{name}: {m:.1f} us per 16-layer step (median of 15; min {min(ts):.1f}); current/this {base/m:.3f}x", flush=True)
