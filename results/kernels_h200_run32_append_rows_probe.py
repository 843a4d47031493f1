"""Drafter prefill, one append_rows chunk of the 1.38B-shaped model (H = 2048), fc kernel vs reference.

Times the jitted append_rows (fc, the layer's input norm, k/v projections, k_norm, RoPE, page writes)
at batch 1 and 4 x 512 rows, with CUPTI kernel time (L2 evicted), median of 20; interleaved rounds.
"""
import statistics
from experiments import cupti
from experiments.bench_decode import BIG
import jax, jax.numpy as jnp, numpy as np


def _time(fn, sets, reps):
    for a in sets[:2]:
        jax.block_until_ready(fn(*a))
    return statistics.median(sum(ms for _, ms in cupti.kernel_timings(fn, sets[i % len(sets)])) * 1e-3
                             for i in range(reps)), None
from mtp.config import ModelConfig
from mtp.model.params import init_params
from mtp.mtp_head import DrafterCache, append_rows, quantize_head

cfg = ModelConfig.from_hf(BIG)
params = init_params(cfg, jax.random.key(1), jnp.bfloat16)
params = quantize_head(params, "bf16", fold_fc=True)
page = 16
fns = {impl: jax.jit(lambda dc, nt, hs, fk, n, impl=impl: append_rows(cfg, params, dc, nt, hs, fk, n, impl=impl))
       for impl in ("reference", "pallas")}
for b, t in [(1, 512), (2, 512), (4, 512)]:
    pages = b * (t // page + 2)
    dc = DrafterCache.create(cfg, b, pages, page, t // page + 2, jnp.bfloat16)
    dc = dc.replace(block_tables=jnp.arange(pages, dtype=jnp.int32).reshape(b, -1))
    sets = []
    for s in range(4):
        k1, k2 = jax.random.split(jax.random.key(10 + s))
        nt = jax.random.randint(k1, (b, t), 0, cfg.vocab_size, jnp.int32)
        hs = (2.0 * jax.random.normal(k2, (b, t, cfg.hidden_size))).astype(jnp.bfloat16)
        sets.append((dc, nt, hs, jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)))
    outs = {impl: fn(*sets[0]) for impl, fn in fns.items()}
    kr, kp = outs["reference"].kv.k[0], outs["pallas"].kv.k[0]
    err = float(jnp.linalg.norm((kr - kp).astype(jnp.float32)) / jnp.linalg.norm(kr.astype(jnp.float32)))
    for rnd in range(2):
        t_ref = _time(fns["reference"], sets, 20)[0] * 1e6
        t_ker = _time(fns["pallas"], sets, 20)[0] * 1e6
        print(f"B={b} x {t} rows (M={b * t}) round {rnd}: reference {t_ref:.1f} us, fc kernel {t_ker:.1f} us "
              f"({t_ref / t_ker:.3f}x), K rel err {err:.1e}", flush=True)
