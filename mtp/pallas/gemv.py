"""Few-row GEMMs for decode, ``x[M, K] @ w[N, K].T`` with M <= 8: a weight stream.

A decode step at batch 1 multiplies one (padded: two) row by every weight of the model,
so its time is the weights' bytes over the bandwidth the GEMMs reach. XLA's Triton GEMMs
reach 2.8-3.4 TB/s on the 1.38B model's projections inside the step, against a copy
ceiling of ~4.2 (results/decode_h200.md, session 8): the largest remaining gap to the
decode step's bandwidth floor. This kernel is the plain weight stream: each program owns
``block_n`` whole rows of ``w`` (contiguous bytes), keeps ``depth`` tiles of them in flight
and multiplies on the CUDA cores (no tensor-core tile to fill with 1-2 rows).

Pallas' Triton lowering, like `mtp.pallas.gdn_step`: a Triton custom call runs inside XLA's
CUDA graphs, which a Mosaic GPU one cannot in jax 0.11.2 (results/decode_h200.md, session 7).

``gemv_reference`` is the definition: the model's own ``layers.linear``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtp.model.layers import linear
from mtp.pallas.backend import resolve_impl, tensor_parallel_mesh, triton_compiler_params, triton_interpret_scope

MAX_ROWS = 8


def gemv_reference(x, w):
    """``x @ w.T`` for ``x [M, K]`` and a HF ``[N, K]`` weight: f32 accumulation, x's dtype out."""
    return linear(x, w)


class Plan(NamedTuple):
    """How the kernel tiles ``w``: rows per program, columns per tile, tiles in flight, warps."""

    block_n: int
    block_k: int
    depth: int
    num_warps: int


def default_plan(m: int, n: int, k: int) -> Plan:
    """Rows per program so the grid fills the chip a few times over, whole tiles of K."""
    del m
    block_k = next(b for b in (512, 256, 128, 64, 32, 16) if k % b == 0)
    block_n = 16 if n >= 16 * 132 * 2 else 8 if n >= 8 * 132 * 2 else 4
    return Plan(block_n, block_k, depth=4, num_warps=4)


def kernel_unsupported(x, w, plan: Plan | None = None) -> str | None:
    """Why the kernel cannot take these inputs (the caller then runs the reference), or None."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        return f"x {x.shape} and w {w.shape} are not [M, K] and [N, K]"
    m, k = x.shape
    if m > MAX_ROWS or m & (m - 1):
        return f"{m} rows: the kernel takes a power of two up to {MAX_ROWS}"
    if x.dtype != w.dtype:
        return f"x is {x.dtype}, w is {w.dtype}"
    plan = plan or default_plan(m, w.shape[0], k)
    if k % plan.block_k or plan.block_k & (plan.block_k - 1) or plan.block_n & (plan.block_n - 1):
        return f"K = {k} does not split into power-of-two tiles ({plan})"
    return None


def _kernel(x_ref, w_ref, o_ref, *, block_k, depth):
    rows, k = x_ref.shape
    steps = k // block_k
    f32 = jnp.float32
    cols = lambda i: pl.ds(i * block_k, block_k)
    # The next `depth` tiles are loaded before the current one is used: the program's
    # bytes in flight are what a weight stream's speed is made of.
    tiles = [w_ref[:, cols(i)] for i in range(min(depth, steps))]
    acc = [None] * rows
    for i in range(steps):
        w = tiles.pop(0).astype(f32)
        if i + depth < steps:
            tiles.append(w_ref[:, cols(i + depth)])
        for r in range(rows):
            part = jnp.sum(w * x_ref[pl.ds(r, 1), cols(i)].astype(f32), axis=1)
            acc[r] = part if acc[r] is None else acc[r] + part
    for r in range(rows):
        o_ref[pl.ds(r, 1), :] = acc[r][None, :].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("plan", "interpret"))
def _gemv_pallas(x, w, *, plan: Plan, interpret=False):
    m, k = x.shape
    n = w.shape[0]
    return pl.pallas_call(
        functools.partial(_kernel, block_k=plan.block_k, depth=plan.depth),
        grid=(pl.cdiv(n, plan.block_n),),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)),
                  pl.BlockSpec((plan.block_n, k), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((m, plan.block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=interpret,
        **triton_compiler_params(interpret, num_warps=plan.num_warps),
    )(x, w)


def gemv(x, w, *, impl="auto", plan: Plan | None = None):
    """``gemv_reference``'s signature and result; ``impl`` picks the path (``backend``).

    Inputs the kernel cannot take (``kernel_unsupported``) and traces under a
    tensor-parallel mesh go to the reference. No autodiff rule: training runs the reference.
    """
    mode = resolve_impl(impl, op="gemv")
    if mode == "reference" or kernel_unsupported(x, w, plan) or tensor_parallel_mesh() is not None:
        return gemv_reference(x, w)
    plan = plan or default_plan(x.shape[0], w.shape[0], x.shape[1])
    with triton_interpret_scope(mode) as interpret:
        return _gemv_pallas(x, w, plan=plan, interpret=interpret)
