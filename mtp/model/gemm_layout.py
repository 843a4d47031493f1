"""How the model's GEMMs are laid out for XLA: small-row pads, merged projections, reductions.

The model's math (`mtp.model.layers`, `gated_deltanet`, `target`, `mtp.mtp_head`) calls `dense`,
`dense_columns` and `module_columns` for every projection; this module decides how each product
reaches XLA, from the GEMM-layout switches of ``execution`` (`mtp.execution.ExecutionConfig`, a
static of the jitted callers), and nothing else changes a result's value beyond f32 rounding. Each
layout is there because it measured faster on a GPU (`docs/gpu.md`, "XLA layout switches"): a
one-row product padded to two rows (`pads_weight`), the projections of one input as one GEMM
(`dense_columns`, `merged_layer`), a few-row product with a small weight as multiply + sum
(`linear`), and a step's residual stream padded once rather than per GEMM (`stream_rows`). The
weight may be plain, block-scaled FP8 (`mtp.ops.fp8`) or quantized (`mtp.ops.quantized`).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from mtp.execution import ExecutionConfig
from mtp.ops import fp8, lowering, quantized
from mtp.ops.lowering import tensor_parallel_mesh

DEFAULT = ExecutionConfig()


def _gpu_default_switch(value: bool | None) -> bool:
    """A GEMM-layout switch of an `ExecutionConfig`: ``None``, on exactly on a GPU."""
    return lowering.on_gpu() if value is None else value


def pad_small_gemms(execution: ExecutionConfig = DEFAULT) -> bool:
    """Whether `dense` pads a one-row product with a large weight to 2 rows.

    On by default on a GPU, where XLA's GEMM streams such weights faster for 2 rows
    than for 1 (measured, see ``PAD_ROWS``); ``execution.pad_small_gemms`` decides instead
    (benchmarks flip it to compare; ``MTP_PAD_SMALL_GEMMS=0`` or ``1`` at an entry point).
    """
    return _gpu_default_switch(execution.pad_small_gemms)


def merge_projections(execution: ExecutionConfig = DEFAULT) -> bool:
    """Whether `dense_columns` runs projections of one input as one GEMM.

    On by default on a GPU, where a decode step's launches cost more than its small
    GEMMs' bytes (see ``dense_columns``); ``execution.merge_projections`` decides instead
    (``MTP_MERGE_PROJECTIONS`` at an entry point).
    """
    return _gpu_default_switch(execution.merge_projections)


def small_gemms_as_reduce(execution: ExecutionConfig = DEFAULT) -> bool:
    """Whether `linear` writes a few-row product with a small weight as a reduction.

    On by default on a GPU, where a small model's verify ran faster so (see ``linear``);
    ``execution.small_gemms_as_reduce`` decides instead (benchmarks flip it to compare;
    ``MTP_SMALL_GEMMS_AS_REDUCE`` at an entry point).
    """
    return _gpu_default_switch(execution.small_gemms_as_reduce)


def _measured(forced: int | None, default: int) -> int:
    """A layout bound: an `ExecutionConfig`'s forced value (tests force them on tiny models), else the measured one."""
    return default if forced is None else forced


# Plain decode at batch 1 multiplies one row by each weight: a weight stream. On the
# H200 (jax 0.11.2) XLA's GPU GEMM streams a large weight much slower for one row than
# for two (results/kernels/kernels_h200.md, "small-row GEMMs": [5632, 2048] at 1.8 TB/s for
# one row, 3.5 for two; [8192, 2048] 2.3 vs 4.3), so `dense` gives such a product a
# second, zero row there. Padding further (to 4 or 8 rows) measured slower than 2, and
# weights of at most 2048 x 4096 elements measured no gain (or a loss): they keep
# their shape. A model whose weights pad carries its whole one-row residual stream
# padded instead (`stream_rows`, chosen in `mtp.model.target`), so that the pad is one
# kernel per step rather than one per GEMM (results/decode/decode_h200.md, 2026-11-29).
PAD_ROWS = 2
PAD_MIN_WEIGHT = 2048 * 4096


def pads_weight(w, execution: ExecutionConfig = DEFAULT) -> bool:
    """Whether a one-row product with ``w`` is padded: a plain weight of over ``PAD_MIN_WEIGHT``
    elements (``execution.pad_min_weight`` where set).

    Never an FP8 weight: its kernel (`mtp.ops.fp8.triton`) streams one row at 0.78-0.89x the bf16
    weight's time and two or more at 1.27-1.35x (results/kernels/fp8_few_rows_h200/), so a second
    row would cost it what it saves XLA's bf16 GEMM.
    """
    return isinstance(w, jax.Array) and w.size > _measured(execution.pad_min_weight, PAD_MIN_WEIGHT)


# Where `linear` writes a product as a reduction: what measured faster on the H200 (2026-11-30; the default
# model's verify at batch 1, K = 2..4, every weight <= 0.6M elements). At 8 rows and more the
# reduction, which reads the weight once per row, lost by far (up to 32 rows: batch 8's plain
# loop 0.73x, its K = 2 speculative loop 0.55x). The 1.38B model's verify compiles to the same
# kernels either way (its small weights merge into large ones, `dense_columns`; counted).
REDUCE_MAX_ROWS = 4
REDUCE_MAX_WEIGHT = 1 << 20


def linear(x: jax.Array, w, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """``x @ w.T`` for a HF ``[out, in]`` weight, plain or block-scaled FP8: f32 accumulation, x's dtype out.

    An FP8 weight (`mtp.ops.fp8.BlockFp8Weight`, as Qwen's FP8 checkpoints load) goes to the
    FP8 GEMM (`fp8.matmul`), which dequantizes it inside the GEMM: the weight stays 8-bit in
    device memory.

    A product of 2..``REDUCE_MAX_ROWS`` rows with a weight of at most ``REDUCE_MAX_WEIGHT``
    elements (a small model's verify; ``execution.reduce_max_rows`` and ``reduce_max_weight``
    where set) is written as multiply + sum where
    `small_gemms_as_reduce` says, and not under a tensor-parallel mesh (whose
    shardings were measured with GEMMs): XLA then emits one reduction kernel, as it does
    for a one-row product, instead of a Triton GEMM, and fuses its elementwise neighbours
    into it. The default model's speculative loop at batch 1 ran 1.11x faster at K = 2
    (results/decode/decode_h200.md, 2026-11-30, few-row products as reductions).
    """
    if isinstance(w, fp8.BlockFp8Weight):
        return fp8.matmul(x, w, impl=execution.impl_for("fp8_gemm"), gemv_impl=execution.impl_for("fp8_gemv"),
                          out_dtype=x.dtype)
    rows = math.prod(x.shape[:-1])
    if (1 < rows <= _measured(execution.reduce_max_rows, REDUCE_MAX_ROWS)
            and w.size <= _measured(execution.reduce_max_weight, REDUCE_MAX_WEIGHT)
            and small_gemms_as_reduce(execution) and tensor_parallel_mesh() is None):
        f32 = jnp.float32
        return jnp.sum(x[..., None, :].astype(f32) * w.astype(f32), axis=-1).astype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def padded_linear(x: jax.Array, w: jax.Array, rows_to: int, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """``x @ w.T`` computed on ``x``'s rows zero-padded to ``rows_to`` (the extra rows dropped)."""
    rows = math.prod(x.shape[:-1])
    return _padded_rows(x.reshape(rows, x.shape[-1]), w, rows_to, execution)[:rows].reshape(
        *x.shape[:-1], w.shape[0])


def _padded_rows(x2: jax.Array, w: jax.Array, rows_to: int, execution: ExecutionConfig) -> jax.Array:
    return linear(jnp.pad(x2, ((0, rows_to - x2.shape[0]), (0, 0))), w, execution)


def dense_rows(x: jax.Array, w, lead: tuple[int, ...] | None = None,
               execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """``dense`` as the GEMM wrote it: ``[R, out]`` with ``x``'s rows first, ``R >= rows``.

    Where ``dense`` pads a small product, the padding rows are kept. A kernel that reads
    only the first rows can then take the GEMM's own output buffer: XLA copies a sliced
    operand of a custom call (a device memcpy, measured costly inside CUDA graphs).
    ``x`` is ``[*lead, in]``, or with ``lead`` given, the padded residual stream's rows
    ``[R >= prod(lead), in]`` (``stream_rows``): a large weight then multiplies all R
    rows as they are (no pad kernel), a small one only the real rows.
    """
    rows = math.prod(x.shape[:-1] if lead is None else lead)
    x2 = x.reshape(-1, x.shape[-1])
    target_weight = isinstance(w, (jax.Array, fp8.BlockFp8Weight))  # plain or a checkpoint's FP8
    pads = pads_weight(w, execution)
    if x2.shape[0] > rows and not pads:
        x2 = x2[:rows]
    if target_weight:
        pad_rows = _measured(execution.pad_rows, PAD_ROWS)
        if x2.shape[0] < pad_rows and pads and pad_small_gemms(execution):
            return _padded_rows(x2, w, pad_rows, execution)
        return linear(x2, w, execution)
    return quantized.linear(x2, w)  # the MTP head's weights at ``--mtp_quant``


def dense(x: jax.Array, w, lead: tuple[int, ...] | None = None, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """``x @ w.T`` for a HF ``[out, in]`` weight, plain, block-scaled FP8 (`mtp.ops.fp8`) or
    quantized for the MTP head (`mtp.ops.quantized`) -> ``[*lead, out]``.

    ``lead``: ``x`` is the padded stream's rows (see ``dense_rows``); default ``x.shape[:-1]``.
    """
    lead = x.shape[:-1] if lead is None else lead
    return first_rows(dense_rows(x, w, lead, execution), lead)


class Columns(NamedTuple):
    """One product's columns in a GEMM's output rows: ``rows[:, start:start + width]``.

    A kernel can take ``rows`` and ``start`` and read its columns in place (XLA copies a
    sliced custom-call operand); ``view`` is the ``[*lead, width]`` array for everyone else.
    """

    rows: jax.Array
    start: int
    width: int

    def view(self, lead: tuple[int, ...]) -> jax.Array:
        return first_rows(self.rows[:, self.start:self.start + self.width], lead)


# Merged projections feed decode and verify steps; a prefill's GEMM of thousands of rows is
# compute-bound, gains nothing from one launch less, and may go to cuBLAS, which would
# write the concatenated weight out.
MERGE_MAX_ROWS = 64


def dense_columns(x: jax.Array, ws, lead: tuple[int, ...] | None = None,
                  merged: jax.Array | None = None, execution: ExecutionConfig = DEFAULT) -> list[Columns]:
    """``dense`` of one input by several weights, as one GEMM where they merge.

    A decode step is mostly small kernels, each a few µs of launch and tail inside a
    CUDA graph, so the small projections (``in_proj_ba``, ``k_proj``, ``v_proj``) cost
    more as GEMMs of their own than their bytes do. Their weights are concatenated
    with the large one's inside the trace: XLA fuses the concatenation into its Triton
    GEMM, which reads each weight in place (as its own dot merger does for gate and up),
    so nothing is copied and the step loses a launch per merged weight. Merged only
    where `merge_projections` says (a GPU by default), for plain weights, at
    most ``MERGE_MAX_ROWS`` rows, and not under a tensor-parallel mesh (the weights are
    split on the concatenated axis there). ``x`` and ``lead`` as in ``dense_rows``;
    ``merged``: ``ws`` already concatenated (`merged_layer`).
    """
    lead = x.shape[:-1] if lead is None else lead
    if merged is not None and merged.shape[0] != sum(w.shape[0] for w in ws):
        raise ValueError(f"merged weight has {merged.shape[0]} rows, the weights {[w.shape[0] for w in ws]}")
    if not (_mergeable(ws, execution) and math.prod(lead) <= MERGE_MAX_ROWS):
        return [Columns(y, 0, y.shape[-1]) for y in (dense_rows(x, w, lead, execution) for w in ws)]
    rows = dense_rows(x, jnp.concatenate(ws, axis=0) if merged is None else merged, lead, execution)
    starts = [0, *itertools.accumulate(w.shape[0] for w in ws)]
    return [Columns(rows, s, w.shape[0]) for s, w in zip(starts, ws)]


def _mergeable(ws, execution: ExecutionConfig) -> bool:
    """Whether `dense_columns` may merge these weights, at any rows (see there)."""
    return (len(ws) > 1 and merge_projections(execution) and tensor_parallel_mesh() is None
            and all(isinstance(w, jax.Array) and w.dtype == ws[0].dtype for w in ws))


# The projections `dense_columns` merges, by the module holding them (`module_columns` serves every caller).
MERGED_GROUPS = {"linear_attn": ("in_proj_qkvz", "in_proj_ba"), "self_attn": ("q_proj", "k_proj", "v_proj"),
                 "mlp": ("gate", "shared_expert_gate")}  # a MoE layer's router and its shared expert's gate
PREMERGE_MAX_WEIGHT = 2048 * 4096  # elements: the default model's groups (<= 0.6M) merge once, the 1.38B's (25M) do not


@struct.dataclass
class MergedLayer:
    """One decoder layer's `MERGED_GROUPS` weights, each group concatenated once ahead of the steps
    (`merged_layer`), by the module holding it; None where a group is not premerged."""

    linear_attn: jax.Array | None = None  # in_proj_qkvz, in_proj_ba
    self_attn: jax.Array | None = None  # q_proj, k_proj, v_proj
    mlp: jax.Array | None = None  # a MoE layer's gate (router), shared_expert_gate


def merged_layer(layer, execution: ExecutionConfig = DEFAULT) -> MergedLayer:
    """Each ``MERGED_GROUPS`` group of a decoder layer's params (``model.layers.<i>``, ``mtp.layers.0``),
    concatenated.

    ``dense_columns`` concatenates a group's weights inside the trace. Where XLA fuses
    that into its GEMM (the 1.38B model's decode) nothing is copied; where it does not
    (the default model's small weights at two rows and more: a verify, batch 8), the
    concatenation is a kernel that copies the weights, once per step inside a decode loop,
    since XLA does not hoist a concatenation (it makes a new buffer) out of a
    ``while_loop``. So the concatenated weights are made at load (`mtp.model.prepared`) and
    ``module_columns`` multiplies by them. Only for groups of at most ``PREMERGE_MAX_WEIGHT``
    elements (a large group's copy would cost memory, and XLA fused its concatenation in every
    program counted: `experiments/count_kernels.py`), and where ``dense_columns`` would merge at
    all (``merge_projections``, no tensor-parallel mesh, plain weights of one dtype): under a
    tensor-parallel mesh nothing is premerged, and a merged weight of replicated parts is
    replicated. Counted for an H200, the default model's loops lose the 6 concatenation kernels
    per iteration: speculative K = 2 at batch 1 119 -> 113 launches, plain at batch 8 93 -> 87.
    """

    def merged(module, names):
        ws = [module.get(n, {}).get("weight") for n in names] if isinstance(module, dict) else []
        if _mergeable(ws, execution) and sum(w.size for w in ws) <= PREMERGE_MAX_WEIGHT:
            return jnp.concatenate(ws, axis=0)
        return None

    return MergedLayer(**{key: merged(layer.get(key), names) for key, names in MERGED_GROUPS.items()})


def module_columns(p, x: jax.Array, names, lead: tuple[int, ...] | None = None,
                   execution: ExecutionConfig = DEFAULT, merged: jax.Array | None = None) -> list[Columns]:
    """`dense_columns` of a module's named projections; ``merged``: the group's weights concatenated
    ahead (the module's field of its layer's `MergedLayer`), for exactly these ``names``."""
    return dense_columns(x, [p[n]["weight"] for n in names], lead, merged=merged, execution=execution)


def stream_rows(x: jax.Array, pad: bool, execution: ExecutionConfig = DEFAULT) -> jax.Array:
    """The residual stream ``[*lead, H]`` as GEMM rows ``[R, H]``; with ``pad``, zero rows up to
    ``PAD_ROWS`` (``execution.pad_rows`` where set).

    Decode at batch 1 has one row, which ``dense`` pads to two before each large
    GEMM: a pad kernel per projection (53 in the 1.38B model's step). Padding the
    stream once instead keeps every norm, residual add and FFN on two rows and hands
    the GEMMs their input as is; the token mixers take the real rows. The padding rows
    stay zero through every layer (a norm, an FFN or an expert of zeros is zero) and are
    never read back as outputs.
    """
    x2 = x.reshape(-1, x.shape[-1])
    pad_rows = _measured(execution.pad_rows, PAD_ROWS)
    if pad and x2.shape[0] < pad_rows:
        x2 = jnp.pad(x2, ((0, pad_rows - x2.shape[0]), (0, 0)))
    return x2


def first_rows(y_rows: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """The ``prod(lead)`` real rows of a `dense_rows` result (or of the padded stream), as ``[*lead, out]``."""
    return y_rows.reshape(-1, y_rows.shape[-1])[:math.prod(lead)].reshape(*lead, y_rows.shape[-1])
