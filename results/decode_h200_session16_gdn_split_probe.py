"""Probe: the fused GDN step split over value-dim chunks (C programs per head); its raw kernel time."""
import functools, statistics, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import mtp.model
from experiments import cupti
from mtp.pallas import gdn_step as g
from mtp.pallas.backend import triton_compiler_params
from mtp.model.layers import l2norm
CPU = jax.default_backend() == 'cpu'

def _kernel(q_ref, k_ref, v_ref, z_ref, b_ref, a_ref, s_ref, alog_ref, dtb_ref, w_ref, o_ref, ss_ref, s_out_ref):
    f32 = jnp.float32
    d = q_ref.shape[-1]
    s = s_ref[0, 0]
    scale_a = -jnp.exp(alog_ref[0, 0].astype(f32))
    q = l2norm(q_ref[0, 0, :].astype(f32)) * (d ** -0.5)
    k = l2norm(k_ref[0, 0, :].astype(f32))
    v = v_ref[0, 0, :].astype(f32)
    beta = jax.nn.sigmoid(b_ref[0, 0].astype(f32))
    gg = scale_a * jax.nn.softplus(a_ref[0, 0].astype(f32) + dtb_ref[0, 0].astype(f32))
    decay = jnp.exp(gg)
    sk = jnp.sum(s * k[:, None], axis=0)
    sq = jnp.sum(s * q[:, None], axis=0)
    delta = (v - decay * sk) * beta
    s = decay * s + k[:, None] * delta[None, :]
    s_out_ref[0, 0] = s
    o = (decay * sq + jnp.sum(q * k) * delta).astype(o_ref.dtype)
    o_ref[0, 0, :] = o
    of = o.astype(f32)
    ss_ref[0, 0, :] = jnp.broadcast_to(jnp.sum(of * of), (ss_ref.shape[-1],))

@functools.partial(jax.jit, static_argnames=("chunks", "num_warps"))
def split_step(mixed, qkvz, ba, state, a_log, dt_bias, norm_w, *, chunks, num_warps):
    nk = 16
    bsz = mixed.shape[0]
    _, nv, d, _ = state.shape
    r = nv // nk
    dc = d // chunks
    heads = mixed.reshape(bsz, nk * (2 + r), d)
    group = lambda h: (h // r) * (2 + r)
    full = lambda off: pl.BlockSpec((1, 1, d), lambda i, h, c, off=off: (i, off(h), 0))
    part = lambda off: pl.BlockSpec((1, 1, dc), lambda i, h, c, off=off: (i, off(h), c))
    scalar = lambda off: pl.BlockSpec((1, 1), lambda i, h, c, off=off: (i, off(h)))
    per_head = pl.BlockSpec((1, 1), lambda i, h, c: (h, 0))
    return pl.pallas_call(
        _kernel, grid=(bsz, nv, chunks),
        in_specs=[full(group), full(lambda h: group(h) + 1),
                  part(lambda h: (group(h) + 2 + h % r)),
                  pl.BlockSpec((1, dc), lambda i, h, c: (i, ((h // r) * (2 + 2 * r) + 2 + r + h % r) * chunks + c)),
                  scalar(lambda h: (h // r) * 2 * r + h % r), scalar(lambda h: (h // r) * 2 * r + r + h % r),
                  pl.BlockSpec((1, 1, d, dc), lambda i, h, c: (i, h, 0, c)),
                  per_head, per_head, pl.BlockSpec((dc,), lambda i, h, c: (c,))],
        out_specs=[pl.BlockSpec((1, 1, dc), lambda i, h, c: (i, h, c)),
                   pl.BlockSpec((1, 1, 16), lambda i, h, c: (i, h, c)),
                   pl.BlockSpec((1, 1, d, dc), lambda i, h, c: (i, h, 0, c))],
        out_shape=[jax.ShapeDtypeStruct((bsz, nv, d), mixed.dtype), jax.ShapeDtypeStruct((bsz, nv, 16 * chunks), jnp.float32),
                   jax.ShapeDtypeStruct((bsz, nv, d, d), jnp.float32)],
        input_output_aliases={6: 2},
        interpret=CPU, **triton_compiler_params(CPU, num_warps),
    )(heads, heads, heads, qkvz, ba, ba, state, a_log[:, None], dt_bias[:, None], norm_w)

def finish(o, ss, qkvz, norm_w, chunks, eps=1e-6):
    bsz, nv, d = o.shape
    nk = 16; r = nv // nk
    z = qkvz[:bsz].reshape(bsz, nk, 2 + 2 * r, d)[:, :, 2 + r:].reshape(bsz, nv, d)
    tot = ss.reshape(bsz, nv, chunks, 16)[..., 0].sum(-1, keepdims=True)
    y = o.astype(jnp.float32) * jax.lax.rsqrt(tot / d + eps)
    y = norm_w * y.astype(o.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)

def kernel_us(fn, args, reps=30):
    fn(*args)
    ts = []
    for _ in range(reps):
        t = cupti.kernel_timings(fn, args)
        ts.append(sum(ms for n, ms in t if "copy" not in n.lower() and "memcpy" not in n.lower()) * 1e3)
    return statistics.median(ts), [n for n, _ in t]

for b in (1, 8):
    nk, nv, d = 16, 32, 128
    ks = jax.random.split(jax.random.key(b), 8)
    bf = lambda x: x.astype(jnp.bfloat16)
    mixed = bf(jax.random.normal(ks[0], (b, (2 * nk + nv) * d)))
    qkvz = bf(jax.random.normal(ks[1], (b, 2 * (nk + nv) * d)))
    ba = bf(jax.random.normal(ks[2], (b, 2 * nv)))
    state = 0.3 * jax.random.normal(ks[4], (b, nv, d, d), jnp.float32)
    a_log, dtb = jax.random.normal(ks[5], (nv,)), jax.random.normal(ks[6], (nv,))
    nw = bf(1 + 0.1 * jax.random.normal(ks[7], (d,)))
    valid = jnp.ones((b,), bool)
    y_ref, s_ref = g.gdn_step_reference(mixed, qkvz, ba, valid, state, a_log, dtb, nw, num_k_heads=nk, eps=1e-6)
    base = jax.jit(lambda *a: g._gdn_steps_pallas(a[0][:, None], a[1], a[2], a[3][:, None], *a[4:], num_k_heads=nk, eps=1e-6, interpret=CPU))
    t, names = (0, []) if CPU else kernel_us(base, (mixed, qkvz, ba, valid, state, a_log, dtb, nw))
    print(f"B={b} current kernel: {t:.2f} us {names}", flush=True)
    for chunks in (2, 4, 8):
        for w in (1, 2, 4, 8):
            if d // chunks * d // (32 * w) < 4: continue
            fn = functools.partial(split_step, chunks=chunks, num_warps=w)
            o, ss, s_new = fn(mixed, qkvz, ba, state, a_log, dtb, nw)
            y = finish(o, ss, qkvz, nw, chunks)
            err_y = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32))))
            err_s = float(jnp.max(jnp.abs(s_new - s_ref)))
            t, names = (0, []) if CPU else kernel_us(fn, (mixed, qkvz, ba, state, a_log, dtb, nw))
            print(f"B={b} chunks={chunks} warps={w}: {t:.2f} us  err_y {err_y:.3g} err_s {err_s:.3g} {names}", flush=True)
