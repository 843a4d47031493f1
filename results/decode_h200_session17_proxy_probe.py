"""Probe: why part A's proxy step (a fori_loop of chained steps) runs slower than the greedy loop's step.
Variants of the same fori_loop, interleaved: its trip count, unroll=2, and the decode loops' compiler options.
(Run in session 17 on 1dfead6, where `greedy_loop_ms` timed one 64-token call whole: the 1.031 ms recorded
is that figure; with today's bench_decode it prints the slope and the whole-call figure.)"""
import statistics, sys, time
import jax, jax.numpy as jnp
from experiments import cupti
from experiments.bench_decode import BIG, SMALL, chained_verify_step, random_cache, _kernel_profile
from mtp.config import ModelConfig
from mtp.model.params import init_params
from mtp.pallas import backend

small = len(sys.argv) > 1 and sys.argv[1] == "small"
raw = SMALL if small else BIG
if jax.default_backend() == "gpu":
    cupti.start()
cfg = ModelConfig.from_hf(raw)
params = init_params(cfg, jax.random.key(1), jnp.bfloat16)
state = (random_cache(cfg, 1, 64 if small else 2048, 16, jnp.bfloat16, jax.random.key(2)), jnp.ones((1, 1), jnp.int32))
step = chained_verify_step(cfg, "auto")


def loop_fn(n, unroll=1, options=None):
    f = lambda c, p: jax.lax.fori_loop(0, n, lambda _, c: step(c, p), c, unroll=unroll)
    return jax.jit(f, donate_argnums=0, compiler_options=options or {}), n


variants = {
    "fori 16": loop_fn(16),
    "fori 64": loop_fn(64),
    "fori 16 unroll 2": loop_fn(16, 2),
    "fori 16, loops' options": loop_fn(16, 1, backend.decode_loop_compiler_options()),
}
for name, (fn, n) in variants.items():
    for _ in range(2):
        state = jax.block_until_ready(fn(state, params))
times = {name: [] for name in variants}
for rnd in range(3):
    for name, (fn, n) in variants.items():
        for _ in range(3):
            t = time.perf_counter()
            state = jax.block_until_ready(fn(state, params))
            times[name].append((time.perf_counter() - t) / n * 1e3)
for name, (fn, n) in variants.items():
    prof, after = _kernel_profile(fn, (state, params), n)
    state = after if after is not None else state
    print(f"{name}: {statistics.median(times[name]):.4f} ms a step (min {min(times[name]):.4f}; 9 calls); "
          f"kernels {prof.get('kernels')}, kernel time {prof.get('kernel_sum_ms', float('nan')):.4f} ms a step "
          f"{prof.get('profile_error', '')[:80]}", flush=True)
from experiments.bench_decode import greedy_loop_ms
del state
loop_ms, loop_whole_ms, prof = greedy_loop_ms(cfg, params, 1, 64 if small else 2048, 64, 5, profile=not small)
print(f"greedy loop: {loop_ms:.4f} ms a token by slope ({loop_whole_ms:.4f} whole, 64 tokens); kernels {prof.get('kernels')}, kernel time "
      f"{prof.get('kernel_sum_ms', float('nan')):.4f} ms a token", flush=True)
