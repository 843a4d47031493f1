"""The device's ceilings that every benchmark's floors divide by, measured in the benchmark's own run.

A floor is the bytes a step must read over the copy bandwidth, or its FLOPs over a bf16 GEMM's
rate: both are measured beside the timings they judge, since these machines are shared and
their figures move from day to day.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, args, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of ``fn(*args)`` over ``reps`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_seconds(fn, args, reps: int) -> float:
    """Median seconds of one call ``fn(*args)``: on a GPU its kernels' device time with the L2 cold
    (`experiments.cupti`: no dispatch overhead, no input left in L2 by the call before), elsewhere
    `median_seconds`' wall time. ``fn`` is compiled by an untimed first call."""
    if jax.default_backend() != "gpu":
        return median_seconds(fn, args, reps, warmup=1)
    from experiments import cupti

    return cupti.median_seconds(fn, [args], reps)[0]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> tuple[float, str]:
    """``(bytes read + written per second, how)`` of a device copy of ``nbytes``: the memory ceiling.

    torch's ``copy_`` where CUDA is there (it reaches ~4.2 TB/s on an H200, XLA's elementwise
    kernels ~2.3), else XLA's scale of every element (a read and a write of each byte).
    """
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    scale = jax.jit(lambda a: a * jnp.bfloat16(1.0009765625))
    best, how = 2 * nbytes / median_seconds(scale, (x,), reps), f"XLA elementwise over {nbytes / 2 ** 30:.3g} GiB"
    del x
    try:
        import torch
    except ImportError:
        return best, how
    if not torch.cuda.is_available():
        return best, how
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    torch_bw = 2 * nbytes / statistics.median(times)
    return (torch_bw, f"torch copy_ of {nbytes / 2 ** 30:.3g} GiB") if torch_bw > best else (best, how)


def gemm_flops_per_s(n: int = 8192, reps: int = 5) -> float:
    """bf16 GEMM rate of XLA's ``n x n x n`` dot on random operands: the arithmetic ceiling."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n ** 3 / median_seconds(f, (a, b), reps)
