"""Probe: a verify's few-row products on the default model's shapes (L2 warm, as in its loops): the reduction
form `layers.linear` writes now, against each row as its own one-row reduction, and XLA's GEMM."""
import functools, statistics
import jax, jax.numpy as jnp

f32, bf16 = jnp.float32, jnp.bfloat16
CPU = jax.default_backend() == "cpu"


def reduce_form(x, w):
    return jnp.sum(x[..., None, :].astype(f32) * w.astype(f32), axis=-1).astype(x.dtype)


def per_row(x, w):
    return jnp.concatenate([reduce_form(x[r:r + 1], w) for r in range(x.shape[0])], axis=0)


def per_row_vec(x, w):  # each row a matrix-vector product XLA writes itself
    return jnp.stack([jnp.dot(w, x[r], preferred_element_type=f32) for r in range(x.shape[0])]).astype(x.dtype)


def dot_form(x, w):
    return jnp.einsum("ri,oi->ro", x, w, preferred_element_type=f32).astype(x.dtype)


FORMS = dict(reduce=reduce_form, per_row=per_row, per_row_vec=per_row_vec, dot=dot_form)


def ffn(form, x, wg, wu, wd):
    return form(jax.nn.silu(form(x, wg)) * form(x, wu), wd)


def kernel_us(fn, args, reps=30):
    from jax.experimental.mosaic.gpu import profiler
    ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext
    jax.block_until_ready(fn(*args))
    sums = []
    for _ in range(reps):
        ext._cupti_init()
        try:
            jax.block_until_ready(fn(*args))
        finally:
            t = ext._cupti_get_timings(True)
        sums.append((len(t), sum(ms for _, ms in t) * 1e3))
    return sums[-1][0], statistics.median(s for _, s in sums)


keys = iter(jax.random.split(jax.random.key(0), 64))
rnd = lambda shape: (jax.random.normal(next(keys), shape) * shape[-1] ** -0.5).astype(bf16)
shapes = {"in_proj merged [1552, 384]": (1552, 384), "down [384, 768]": (384, 768), "out_proj [384, 512]": (384, 512)}
for rows in (1, 2, 3, 4):
    x = rnd((rows, 384)) * 20
    for label, (o, i) in shapes.items():
        w, xi = rnd((o, i)), rnd((rows, i)) * 20
        ref = dot_form(xi, w).astype(f32)
        line = []
        for name, form in FORMS.items():
            fn = jax.jit(form)
            err = float(jnp.max(jnp.abs(fn(xi, w).astype(f32) - ref)))
            res = "cpu" if CPU else "%d k, %.2f us" % kernel_us(fn, (xi, w))
            line.append(f"{name}: {res} (err {err:.3f})")
        print(f"rows {rows}, {label}: " + "; ".join(line), flush=True)
    wg, wu, wd = rnd((768, 384)), rnd((768, 384)), rnd((384, 768))
    ref = ffn(dot_form, x, wg, wu, wd).astype(f32)
    line = []
    for name, form in FORMS.items():
        fn = jax.jit(functools.partial(ffn, form))
        err = float(jnp.max(jnp.abs(fn(x, wg, wu, wd).astype(f32) - ref)))
        res = "cpu" if CPU else "%d k, %.2f us" % kernel_us(fn, (x, wg, wu, wd))
        line.append(f"{name}: {res} (err {err:.3f})")
    print(f"rows {rows}, FFN gate/up [768, 384] + down: " + "; ".join(line), flush=True)
