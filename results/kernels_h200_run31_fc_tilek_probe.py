"""The fc GEMM with 128-wide k steps (fewer barrier round trips), beside the default; one process."""
import sys, math
AOT = "--aot" in sys.argv
if AOT:
    from experiments import count_kernels as ck
    ck.compile_only_device(ck.H200_TARGET)
else:
    sys.argv = [sys.argv[0], "--only", "fc", "--reps", "20"]
    from absl import flags
    from experiments import bench_kernels as bk
    flags.FLAGS(sys.argv)
import jax, jax.numpy as jnp
from mtp.pallas import fc_gemm as fcmod
eps = 1e-6

def op(split, tile_k, stages, sumsq, m, h):
    wm, tn, st, npg, sm = fcmod._plan_large(m, h, 132, None, None, stages, None, "rescale", split)
    tc, sp, sst = fcmod._plan_sumsq(m, h, 132, *(sumsq or ()))
    cta_m = 2 * wm if sm == "m" else wm
    m_pad = -(-m // cta_m) * cta_m
    def f(e, hd, w):
        ss = fcmod._row_sumsq(e, hd, m_pad=m_pad, tile_c=tc, splits=sp, stages=sst)
        return fcmod._ws_gemm(e, hd, w, ss, wg_m=wm, tile_n=tn, stages=st, num_programs=npg,
                              acc="rescale", split=sm, eps=eps, tile_k=tile_k)
    return jax.jit(f)

variants = [("n", 64, 4, None), ("m", 64, 4, None), ("m", 64, 4, (128, 4, 3)),
            ("n", 128, 2, None), ("m", 128, 2, None), ("m", 128, 2, (128, 4, 3)),
            ("n", 64, 4, (128, 4, 3))]
for m, h in [(2048, 2048), (2048, 4096), (12288, 2048)]:
    if AOT:
        e = jax.ShapeDtypeStruct((m, h), jnp.bfloat16); w = jax.ShapeDtypeStruct((h, 2 * h), jnp.bfloat16)
        for v in variants:
            try:
                op(*v, m, h).lower(e, e, w).compile(); print(m, h, v, "ok", flush=True)
            except Exception as ex:
                print(m, h, v, "FAIL", type(ex).__name__, str(ex)[:300], flush=True)
        continue
    sets = []
    for s in range(4):
        kk = jax.random.split(jax.random.key(7 + s), 5)
        e = jax.random.normal(kk[0], (m, h)).astype(jnp.bfloat16)
        hd = (2.0 * jax.random.normal(kk[1], (m, h))).astype(jnp.bfloat16)
        ne = (0.1 * jax.random.normal(kk[2], (h,))).astype(jnp.bfloat16)
        nh = (0.1 * jax.random.normal(kk[3], (h,))).astype(jnp.bfloat16)
        w = (jax.random.normal(kk[4], (h, 2 * h)) / math.sqrt(2 * h)).astype(jnp.bfloat16)
        x = jnp.concatenate([fcmod._rms_norm(e, ne, eps), fcmod._rms_norm(hd, nh, eps)], -1)
        sets.append((e, hd, ne, nh, w, fcmod.fold_fc_weight(ne, nh, w), x))
    want = fcmod.fc_gemm_reference(*sets[0][:5], eps=eps)
    dot = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    for rnd in range(2):
        t_dot = bk._time(dot, [(s[6], s[4]) for s in sets], 20)[0] * 1e6
        print(f"M={m} H={h} round {rnd}: XLA dot {t_dot:.1f} us", flush=True)
        for v in variants:
            try:
                f = op(*v, m, h)
                err = bk._rel_err(f(sets[0][0], sets[0][1], sets[0][5]), want)
                t = bk._time(f, [(s[0], s[1], s[5]) for s in sets], 20)[0] * 1e6
                print(f"  split={v[0]} tile_k={v[1]} stages={v[2]} sumsq={v[3]}: {t:.1f} us "
                      f"({t_dot / t:.3f}x dot) err {err:.1e}", flush=True)
            except Exception as ex:
                print(f"  {v}: FAIL {type(ex).__name__}: {str(ex)[:200]}", flush=True)
