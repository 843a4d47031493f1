"""The decode step's FFN alone, and per-kernel CUPTI times: shared by the GEMM experiments.

`experiments/bench_kernels.py --only ffn_chain` and `experiments/pin_gemm_configs.py` time
the same program; no flags here, so both scripts can import it.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from mtp.model import layers


def per_kernel_us(fn, arg_sets, reps):
    """CUPTI per-kernel times of ``fn`` over rotating arguments: {kernel name: (launches per call, median µs each)}."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*arg_sets[0]))
    samples: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for i in range(reps):
        _, timings = profiler.measure(fn, aggregate=False)(*arg_sets[i % len(arg_sets)])
        seen: dict[str, int] = {}
        for name, ms in timings:
            samples.setdefault(name, []).append(ms * 1e3)
            seen[name] = seen.get(name, 0) + 1
        counts.update(seen)
    return {n: (counts[n], statistics.median(v)) for n, v in samples.items()}


def ffn_program(num_layers=16, m=2, hidden=2048, inter=5632):
    """The 1.38B decode step's FFNs alone: ``(chain, x, layer_weights)``, ``chain(x, weights)``.

    Each layer is the step's norm, gate+up GEMM (one [2I, H] weight, as XLA's dot merger
    makes it), SiLU product, down GEMM and residual add, on M rows and its own weights.
    """
    ks = jax.random.split(jax.random.key(5), 3 * num_layers + 1)
    bf = lambda k, shape, scale: (scale * jax.random.normal(k, shape)).astype(jnp.bfloat16)
    ws = [(bf(ks[3 * i], (hidden,), 0.1), bf(ks[3 * i + 1], (2 * inter, hidden), hidden ** -0.5),
           bf(ks[3 * i + 2], (hidden, inter), inter ** -0.5)) for i in range(num_layers)]

    def chain(x, ws):
        for norm_w, w_gate_up, w_down in ws:
            gate_up = layers.linear(layers.rms_norm(x, norm_w, 1e-6), w_gate_up)
            x = x + layers.linear(jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down)
        return x

    return chain, bf(ks[-1], (m, hidden), 1.0), ws
