"""Load-time weight quantization for the MTP head's projections.

The drafter runs once per draft token on the critical path of every decode step, so
its projections are memory-bound GEMVs: fewer weight bytes is a faster draft, and a
coarser grid is a less accurate one (lower acceptance). Three precisions span that
trade, mirroring the reference system's ``MtpQuantization``:

* ``bf16``  - 2 bytes/weight, the checkpoint as is.
* ``fp8``   - 1 byte/weight: E4M3 values, one f32 scale per output row.
* ``nvfp4`` - 0.5 byte/weight (+ 1 byte per 16): E2M1 values in 16-wide blocks along
  the contraction dimension, an E4M3 scale per block and one f32 scale per tensor
  (the NVIDIA NVFP4 recipe).

This module decides which tensors of a param tree are quantized and to what; the formats,
their rounding and the GEMM that takes them are `mtp.ops.quantized`.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mtp.model.params import is_expert_stack
from mtp.ops.fp8 import BlockFp8Weight
from mtp.ops.fp8 import dequantize as dequantize_block_fp8
from mtp.ops.quantized import NVFP4_BLOCK, quantize_fp8, quantize_nvfp4

QUANT_CHOICES = ("bf16", "fp8", "nvfp4")
_ALIASES = {"fp4": "nvfp4"}


def parse_quant(name: str) -> str:
    """Normalises a ``--mtp_quant`` value; a typo must fail loudly, not fall back."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in QUANT_CHOICES:
        raise ValueError(
            f"unknown --mtp_quant {name!r}; choose one of {', '.join(QUANT_CHOICES)}"
        )
    return key


def supports_drafter_prefill(quant: str) -> bool:
    """Whether the drafter is prefilled from the prompt with the head at this precision.

    A policy, not a limit of the code: `mtp.ops.quantized.linear` runs a quantized weight at any row count,
    so the drafter prefill (`turn_start.append_from_hiddens`) works with an fp8/nvfp4 head, as the
    refeed's batched appends already do. The reference system prefills the drafter only for a bf16 head, and this
    follows it so that quantized-head runs measure the configuration it serves (the
    README's MTP-precision sweep). The engine arms its cross-turn carry only with it.
    """
    return parse_quant(quant) == "bf16"


def _check_2d(w: jax.Array, name: str) -> None:
    if w.ndim != 2:
        raise ValueError(
            f"{name}: expected a 2-D [out_features, in_features] weight, got shape {tuple(w.shape)}"
        )


def quantize(w: jax.Array, quant: str, name: str = "weight"):
    """Quantizes a ``[out, in]`` weight, or a stack of routed experts ``[E, out, in]`` (``name`` a
    stacked expert tensor, `params.is_expert_stack`) expert by expert, each with the scales it
    would have alone; ``name`` otherwise only labels errors.

    bf16 returns the weight unchanged: it is the reference precision, and rounding an
    f32 training weight here would silently change what "bf16" measures. A block-scaled
    FP8 weight (an FP8 checkpoint's, `mtp.ops.fp8`) is likewise the checkpoint as is at
    bf16, and is requantized from the weight it stands for at fp8 / nvfp4.
    """
    quant = parse_quant(quant)
    if quant == "bf16" and isinstance(w, BlockFp8Weight):
        return w
    w = dequantize_block_fp8(w) if isinstance(w, BlockFp8Weight) else jnp.asarray(w)
    stacked = is_expert_stack(name) and w.ndim == 3
    _check_2d(w[0] if stacked else w, name)
    if quant == "bf16":
        return w
    if quant == "nvfp4" and w.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"{name}: nvfp4 needs in_features to be a multiple of {NVFP4_BLOCK}, "
            f"got shape {tuple(w.shape)}"
        )
    one = quantize_fp8 if quant == "fp8" else quantize_nvfp4
    return jax.vmap(one)(w) if stacked else one(w)


_PROJECTIONS = frozenset(
    {"fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)


def is_projection_weight(name: str) -> bool:
    """Predicate for ``quantize_params``: the ``.weight`` of an MTP projection.

    Matches dense, shared-expert and routed-expert projections (the stacked
    ``...experts.up_proj.weight``); leaves the router (``mlp.gate``), the shared
    expert gate, norms and embeddings alone, as the reference system does.
    """
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _PROJECTIONS


def _is_norm(name: str) -> bool:
    return any(part.endswith("norm") for part in name.split("."))


def quantize_params(
    params: Mapping, quant: str, predicate: Callable[[str], bool], prefix: str = ""
) -> dict:
    """A copy of a nested param dict with every selected 2-D projection quantized.

    Leaves are named by their dotted path (the checkpoint tensor name). Norm scales and
    1-D tensors are never touched, whatever the predicate says: they multiply
    elementwise rather than contract, so quantizing them saves nothing and costs
    accuracy. A stack of routed experts is quantized expert by expert (`quantize`); any
    other selected tensor of rank above 2 is an error, not a silent skip.
    """
    quant = parse_quant(quant)
    out = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out[key] = quantize_params(value, quant, predicate, name)
        elif np.ndim(value) >= 2 and not _is_norm(name) and predicate(name):
            out[key] = quantize(value, quant, name)
        else:
            out[key] = value
    return out
