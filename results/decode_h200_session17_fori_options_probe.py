"""Probe: part A's fori_loop of chained 1.38B steps, timed by slope (16 vs 64 steps), under XLA's default
options, with WHILE/CONDITIONAL command buffers, and with those plus CONCURRENT scheduling (the loops')."""
import sys, time
import jax, jax.numpy as jnp
from experiments import cupti
from experiments.bench_decode import BIG, SMALL, chained_verify_step, random_cache, _per_step_slope
from mtp.config import ModelConfig
from mtp.model.params import init_params
from mtp.pallas import backend

small = len(sys.argv) > 1 and sys.argv[1] == "small"
raw = SMALL if small else BIG
cfg = ModelConfig.from_hf(raw)
params = init_params(cfg, jax.random.key(1), jnp.bfloat16)
step = chained_verify_step(cfg, "auto")
graphs = {"xla_gpu_enable_command_buffer": backend._COMMAND_BUFFER_DEFAULTS + ",WHILE,CONDITIONAL"}
options = {"defaults": {}, "while graphs": graphs,
           "while graphs + concurrent": {**graphs, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}}
for batch in [int(b) for b in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["1", "8"])]:
    box = [(random_cache(cfg, batch, 64 if small else 2048, 16, jnp.bfloat16, jax.random.key(2)),
            jnp.ones((batch, 1), jnp.int32))]
    calls = {}
    for name, opts in options.items():
        for n in (16, 64):
            fn = jax.jit(lambda c, p, n=n: jax.lax.fori_loop(0, n, lambda _, c: step(c, p), c),
                         donate_argnums=0, compiler_options=opts)

            def call(fn=fn):
                t = time.perf_counter()
                box[0] = jax.block_until_ready(fn(box[0], params))
                return time.perf_counter() - t
            call(), call()
            calls[name, n] = call
    for rnd in range(2):
        for name in options:
            ms, whole = _per_step_slope({n: calls[name, n] for n in (16, 64)}, 5)
            print(f"batch {batch}, round {rnd}, {name}: {ms:.4f} ms a step by slope ({whole:.4f} whole, 16 steps)", flush=True)
