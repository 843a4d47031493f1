"""The tensors a run derives from the checkpoint's, built once at load, beside the checkpoint's own.

The checkpoint-named dict (`mtp.model.params.Params`) holds exactly the tensors a checkpoint
names (in their declared device layouts), so that it saves, shards and validates by name. A
run reads faster forms of some of them, which depend on how it computes (its
`ExecutionConfig`): each small projection group concatenated for one GEMM
(`gemm_layout.MergedLayer`), and the MTP head's fc kernel inputs (`FcPrepared`). `prepare_params`
builds them once, before the decode loops, and `PreparedParams` carries them beside the dict
as one pytree: the jitted steps and loops take it as an ordinary argument (arrays, not
statics), so building it again for the same model and config compiles nothing new.

A derived tensor changes how a value is computed, never which value: the merged weights and the
folded fc weight are those the steps would otherwise make inside every call, and the per-token
embedding norms differ from the fc kernel's own by one bf16 rounding (`mtp.ops.fc_gemm.fc_gemm`).
They are made from the params as laid out (on a mesh, in the shards `mtp.sharding` placed them
in): XLA lays each out from its inputs, the merged weights are made under no tensor-parallel
mesh (`gemm_layout.merged_layer`), and the fc's from replicated weights and the vocabulary-split
embedding table.
"""

from __future__ import annotations

import jax
from flax import struct

from mtp.execution import ExecutionConfig
from mtp.model.gemm_layout import DEFAULT, MergedLayer, merged_layer
from mtp.model.params import Params
from mtp.ops.dispatch import resolve_impl
from mtp.ops.fc_gemm import fold_fc_weight, row_mean_squares


@struct.dataclass
class FcPrepared:
    """What the MTP head's fc kernel takes made at load rather than per call (`mtp.ops.fc_gemm.fc_gemm`)."""

    weight_folded: jax.Array  # [H, 2H]: mtp.fc.weight with the two pre-fc norms' (1 + w) folded in
    # [V] f32: each token's embedding mean square, so the kernel's row-norm pass reads the hidden
    # half alone; None: the kernel computes the embed rows' norms itself (benchmarks compare the two)
    embed_mean_square: jax.Array | None


@struct.dataclass
class PreparedParams:
    """The checkpoint-named params and the tensors derived from them for a run (`prepare_params`).

    The model's cached paths (`mtp.model.target.prefill` / ``verify`` / ``decode``, the MTP head's
    steps, the decode loops) take this or a bare dict, which they read as prepared with nothing
    derived (`as_prepared`).
    """

    params: Params  # as the checkpoint names them, nothing added
    merged: tuple[MergedLayer, ...]  # the target's decoder layers, by index
    mtp_merged: MergedLayer  # the MTP head's decoder layer
    fc: FcPrepared | None  # None: the fc runs its reference, or folds per call, or is quantized


def prepare_params(params: Params, execution: ExecutionConfig = DEFAULT, *, drafting: bool = True,
                   fold_fc: bool | None = None) -> PreparedParams:
    """``params`` with the tensors that ``execution`` reads derived from them, once.

    Call it at load (after any quantization of the head, `mtp.mtp_head.quantize_head`), under
    the mesh the steps run on, with the config they run with, and pass the result to every step
    and loop. Each decoder layer's projection groups that ``execution`` merges are concatenated
    (`gemm_layout.merged_layer`). Where the MTP head drafts (``drafting``; False for plain
    decoding, which never runs it), so are its layer's, and the fc kernel's inputs (`FcPrepared`)
    are made where ``fold_fc`` says: by default where ``execution`` puts the fc GEMM on its
    kernel path, and only for a plain fc weight (a quantized or FP8 one takes `gemm_layout.dense`).
    """
    layers = params["model"].get("layers", {})
    head = params.get("mtp", {}) if drafting else {}
    mtp_layer = head.get("layers", {}).get("0")
    return PreparedParams(params=params,
                          merged=tuple(merged_layer(layers[str(i)], execution) for i in range(len(layers))),
                          mtp_merged=MergedLayer() if mtp_layer is None else merged_layer(mtp_layer, execution),
                          fc=_fc_prepared(params, execution, fold_fc) if head else None)


def _fc_prepared(params: Params, execution: ExecutionConfig, fold_fc: bool | None) -> FcPrepared | None:
    if fold_fc is None:
        fold_fc = resolve_impl(execution.impl_for("fc_gemm"), op="fc_gemm") != "reference"
    m = params["mtp"]
    if not fold_fc or not isinstance(m["fc"]["weight"], jax.Array):
        return None
    return FcPrepared(weight_folded=fold_fc_weight(m["pre_fc_norm_embedding"]["weight"],
                                                   m["pre_fc_norm_hidden"]["weight"], m["fc"]["weight"]),
                      embed_mean_square=row_mean_squares(params["model"]["embed_tokens"]["weight"]))


_NOTHING_DERIVED = ExecutionConfig(merge_projections=False)


def as_prepared(params: Params | PreparedParams) -> PreparedParams:
    """``params`` as the cached paths read them: a bare dict as prepared with nothing derived.

    Its steps compute the same values: each merged GEMM concatenates its weights in the step,
    and the fc kernel folds its weight per call and norms the embed rows itself.
    """
    if isinstance(params, PreparedParams):
        return params
    return prepare_params(params, _NOTHING_DERIVED, fold_fc=False)


__all__ = ["FcPrepared", "PreparedParams", "as_prepared", "prepare_params"]
