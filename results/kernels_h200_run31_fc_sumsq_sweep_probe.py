"""Pre-pass plans at M=2048,H=2048 (and 2048x4096): the sum-of-squares kernel alone and the whole op."""
import sys, json
sys.argv = [sys.argv[0], "--only", "fc", "--reps", "20"]
from absl import flags
from experiments import bench_kernels as bk
flags.FLAGS(sys.argv)
import jax, jax.numpy as jnp
from mtp.pallas import fc_gemm as fcmod
plans = [None, (128, 4, 3), (64, 4, 4), (64, 4, 8), (64, 8, 4), (128, 4, 4), (128, 8, 4), (64, 8, 8), (256, 4, 1)]
for m, h in [(2048, 2048), (2048, 4096)]:
    ks = jax.random.split(jax.random.key(0), 8)
    sets = []
    for s in range(4):
        e = jax.random.normal(ks[s], (m, h), jnp.bfloat16)
        hd = (2 * jax.random.normal(ks[s + 4], (m, h))).astype(jnp.bfloat16)
        w = (jax.random.normal(ks[s], (h, 2 * h)) / 64).astype(jnp.bfloat16)
        sets.append((e, hd, w))
    xs = [(jnp.concatenate([e, hd], -1), w) for e, hd, w in sets]
    dot2 = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t_dot = bk._time(dot2, xs, 20)[0] * 1e6
    print(f"M={m} H={h} XLA dot {t_dot:.1f} us", flush=True)
    for split in (None, "m"):
        for plan in plans:
            try:
                f = jax.jit(lambda e, hd, w, plan=plan, split=split: fcmod.fc_gemm_folded(e, hd, w, eps=1e-6, sumsq=plan, split=split))
                t = bk._time(f, sets, 20)[0] * 1e6
                tc, sp, st = fcmod._plan_sumsq(m, h, 132, *(plan or ()))
                g = jax.jit(lambda e, hd, w, tc=tc, sp=sp, st=st: fcmod._row_sumsq(e, hd, m_pad=m, tile_c=tc, splits=sp, stages=st))
                tp = bk._time(g, sets, 20)[0] * 1e6
                print(f"  split={split} sumsq={plan} -> {(tc, sp, st)}: op {t:.1f} us ({t_dot / t:.3f}x dot), pre-pass {tp:.2f} us", flush=True)
            except Exception as ex:
                print(f"  split={split} sumsq={plan}: FAIL {type(ex).__name__}: {str(ex)[:200]}", flush=True)
