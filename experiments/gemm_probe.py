"""The decode step's FFN alone, and per-kernel CUPTI times: shared by the GEMM experiments.

`experiments/bench_kernels.py --only ffn_chain|gemm_context` and `experiments/pin_gemm_configs.py`
time the same programs; no flags here, so both scripts can import it.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from experiments import cupti
from mtp.model import gemm_layout
from mtp.ops.norms import rms_norm


def per_kernel_us(fn, arg_sets, reps):
    """CUPTI per-kernel times of ``fn`` over rotating arguments, each call with L2 cold
    (`experiments.cupti`): {kernel name: (launches per call, median µs each)}."""
    jax.block_until_ready(fn(*arg_sets[0]))
    samples: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for i in range(reps):
        timings = cupti.kernel_timings(fn, arg_sets[i % len(arg_sets)])
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
            gate_up = gemm_layout.linear(rms_norm(x, norm_w, 1e-6), w_gate_up)
            x = x + gemm_layout.linear(_silu_product(gate_up), w_down)
        return x

    return chain, bf(ks[-1], (m, hidden), 1.0), ws


def _silu_product(gate_up):
    """``silu(gate) * up`` of the concatenated ``[.., 2 I]`` gate + up output."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def gate_up_contexts(num_layers=16, m=2, hidden=2048, inter=5632):
    """The FFN's gate + up GEMM in several programs: ``{name: (fn, arg_sets)}``.

    The same ``[m, hidden] x [2 inter, hidden]`` product alone (a parameter in, the program's
    output out), after the norm that feeds it in the model, before the SiLU product that
    reads it, with the down GEMM after that (with and without the norm and the residual add),
    beside a down GEMM or a reduction that does not depend on it, twice over two layers'
    weights, and in the whole FFN layer; each rotates through ``num_layers`` weights. The
    GEMM's fusion is the same HLO in every program, so one process autotunes it once and every
    program runs the same config. Measured on 2026-11-29 (results/kernels/kernels_h200.md),
    the GEMM took 13.2 µs in the FFN and 11.1 µs alone; these programs showed that any second weight read in the program
    makes the difference, and with the L2 cold before each call (`experiments.cupti`) every
    program takes 13.5-14.0 µs (2026-11-30).
    """
    chain, x, ws = ffn_program(num_layers, m, hidden, inter)
    reps = -(-inter // hidden)
    down_input = lambda x: jnp.concatenate([x] * reps, axis=-1)[:, :inter]  # an [m, inter] not from gate + up
    programs = {
        "alone": lambda x, w, _: gemm_layout.linear(x, w[1]),
        "after its norm": lambda x, w, _: gemm_layout.linear(rms_norm(x, w[0], 1e-6), w[1]),
        "before its SiLU product": lambda x, w, _: _silu_product(gemm_layout.linear(x, w[1])),
        "beside an independent down GEMM": lambda x, w, _: (_silu_product(gemm_layout.linear(x, w[1])),
                                                            gemm_layout.linear(down_input(x), w[2])),
        "beside a reduction over the down weight": lambda x, w, _: (
            gemm_layout.linear(x, w[1]), jnp.sum(w[2].astype(jnp.float32), axis=0)),
        "twice, two layers' weights": lambda x, w, w_next: (  # other rows: XLA would merge two dots of one input
            gemm_layout.linear(x, w[1]), gemm_layout.linear(x[::-1], w_next[1])),
        "before SiLU product + down": lambda x, w, _: gemm_layout.linear(_silu_product(gemm_layout.linear(x, w[1])), w[2]),
        "norm, SiLU product, down (no add)": lambda x, w, _: gemm_layout.linear(
            _silu_product(gemm_layout.linear(rms_norm(x, w[0], 1e-6), w[1])), w[2]),
        "in the FFN layer": lambda x, w, _: chain(x, [w]),
    }
    arg_sets = [(x, w, ws[(i + 1) % len(ws)]) for i, w in enumerate(ws)]
    return {name: (jax.jit(fn), arg_sets) for name, fn in programs.items()}
