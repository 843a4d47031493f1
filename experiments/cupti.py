"""Per-kernel device times of one call (CUPTI), read with the GPU's L2 cache cold.

JAX's ``mosaic.gpu.profiler.measure`` runs an untimed call with the same arguments right
before the timed one, so whatever of the inputs fits in L2 (50 MB on an H200) is read from
L2, not from memory, however many input sets a benchmark rotates through. Measured on
2026-11-30 (results/kernels/kernels_h200.md): the decode step's gate + up GEMM, a 46 MB
weight, timed 11.0 µs as a program of its own but 13.1 µs in any program that also read a
second weight, and 13.5-14.0 µs in every program with the L2 cold. Here the call before the
timed one reads a buffer five times the L2 instead, so the timed call finds none of its
inputs there, as a decode step finds its next weight.

Every CUPTI timing of the experiments goes through `kernel_timings` (most through `median_seconds`: `bench_kernels.py`,
`bench_decode.py`, `gemm_probe.per_kernel_us`). A program that profiles a CUDA graph (XLA's
command buffers; a decode loop runs as one) calls `start` before it builds the graph.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp

L2_EVICT_BYTES = 256 << 20  # five times an H200's 50 MB L2


@functools.cache
def _evictor():
    """A jitted read of an ``L2_EVICT_BYTES`` buffer: it leaves L2 holding clean lines of that buffer
    (reads, so the timed call does not pay for writing anything back)."""
    buf = jnp.ones((L2_EVICT_BYTES // 4,), jnp.float32)
    read = jax.jit(jnp.sum)
    return lambda: jax.block_until_ready(read(buf))


def kernel_timings(fn, args) -> list[tuple[str, float]]:
    """``[(kernel name, ms)]`` of one call ``fn(*args)``, after a read that evicts L2.

    ``fn`` must be compiled for ``args``' shapes already (one call beforehand): a compile
    inside the window would be timed too. Raises where CUPTI is unavailable (not a GPU).
    """
    from jax.experimental.mosaic.gpu import profiler

    if profiler.mosaic_gpu_lib is None:
        raise RuntimeError("CUPTI profiling needs jax's Mosaic GPU extension (a CUDA jaxlib)")
    ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext  # what profiler.measure itself drives
    _evictor()()
    ext._cupti_init()
    try:
        jax.block_until_ready(fn(*args))
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings or [])


def median_seconds(fn, arg_sets, reps: int) -> tuple[float, list[tuple[str, float]]]:
    """``(median seconds of a call's kernels, the last call's kernel_timings)`` over ``reps`` calls
    rotating through ``arg_sets``, each with L2 cold; the first two sets are run once untimed (the
    compile). Raises as `kernel_timings` does where CUPTI is unavailable."""
    for a in arg_sets[:2]:
        jax.block_until_ready(fn(*a))
    times, kernels = [], []
    for r in range(reps):
        kernels = kernel_timings(fn, arg_sets[r % len(arg_sets)])
        times.append(sum(ms for _, ms in kernels) * 1e-3)
    return statistics.median(times), kernels


@functools.cache
def start() -> None:
    """Run one CUPTI session, so that the CUDA graphs instantiated from now on are traced.

    CUPTI records the kernels of a CUDA graph only if it was switched on before the graph
    was instantiated: a decode loop first run before any CUPTI session profiles as (nearly)
    empty, its kernels missing (results/decode/decode_h200.md, 2026-11-30). Raises as
    `kernel_timings` does where CUPTI is unavailable.
    """
    kernel_timings(jax.jit(lambda x: x + 1), (jnp.ones((8,), jnp.float32),))
