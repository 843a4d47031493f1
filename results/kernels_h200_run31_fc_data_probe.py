"""Does the dot's time depend on the values? XLA's dot and ours on several inputs, one process."""
import sys, math
sys.argv = [sys.argv[0], "--only", "fc", "--reps", "20"]
from absl import flags
from experiments import bench_kernels as bk
flags.FLAGS(sys.argv)
import jax, jax.numpy as jnp
from mtp.pallas import fc_gemm as fcmod
eps = 1e-6
for m, h in [(2048, 2048), (2048, 4096)]:
    def make(s):
        kk = jax.random.split(jax.random.key(100 + s), 5)
        e = jax.random.normal(kk[0], (m, h), jnp.bfloat16)
        e32 = jax.random.normal(kk[0], (m, h)).astype(jnp.bfloat16)
        hd = (2.0 * jax.random.normal(kk[1], (m, h))).astype(jnp.bfloat16)
        ne = (0.1 * jax.random.normal(kk[2], (h,))).astype(jnp.bfloat16)
        nh = (0.1 * jax.random.normal(kk[3], (h,))).astype(jnp.bfloat16)
        w = (jax.random.normal(kk[4], (h, 2 * h)) / math.sqrt(2 * h)).astype(jnp.bfloat16)
        en, hn = fcmod._rms_norm(e, ne, eps), fcmod._rms_norm(hd, nh, eps)
        return dict(e=e, e32=e32, hd=hd, w=w, wf=fcmod.fold_fc_weight(ne, nh, w), en=en, hn=hn,
                    small=(0.02 * e32.astype(jnp.float32)).astype(jnp.bfloat16))
    sets = [make(s) for s in range(4)]
    dotx = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    ours = jax.jit(lambda a, b, w: fcmod.fc_gemm_folded(a, b, w, eps=eps))
    cases = [
        ("dot(x=concat(norm e, norm h)) W  [bench_kernels' baseline]", dotx, lambda d: (jnp.concatenate([d["en"], d["hn"]], -1), d["w"])),
        ("ours(e, h) W_f                   [bench_kernels' ours]", ours, lambda d: (d["e"], d["hd"], d["wf"])),
        ("ours(norm e, norm h) W           [same A, B bits as the baseline]", ours, lambda d: (d["en"], d["hn"], d["w"])),
        ("dot(concat(e, h)) W_f            [same A, B bits as bench's ours]", dotx, lambda d: (jnp.concatenate([d["e"], d["hd"]], -1), d["wf"])),
        ("dot(concat(e32, h)) W", dotx, lambda d: (jnp.concatenate([d["e32"], d["hd"]], -1), d["w"])),
        ("ours(e32, h) W", ours, lambda d: (d["e32"], d["hd"], d["w"])),
        ("dot(concat(0.02 e32, h)) W", dotx, lambda d: (jnp.concatenate([d["small"], d["hd"]], -1), d["w"])),
        ("ours(0.02 e32, h) W", ours, lambda d: (d["small"], d["hd"], d["w"])),
    ]
    for rnd in range(2):
        print(f"M={m} H={h} round {rnd}", flush=True)
        for name, fn, args in cases:
            t = bk._time(fn, [args(d) for d in sets], 20)[0] * 1e6
            print(f"  {t:7.1f} us  {name}", flush=True)
