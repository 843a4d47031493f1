"""The parameter tree: names, shapes and initialisation.

Parameters are a nested dict whose dotted paths are exactly the Hugging Face tensor
names of a Qwen3-Next checkpoint (``model.layers.3.self_attn.q_proj.weight``), so a
checkpoint maps onto the tree with no renaming table. `param_shapes` is the single
source of truth for that mapping: checkpoint loading validates against it and
`init_params` builds from it.

One declared exception: a MoE layer's routed experts are stacked, on every device
layout, into ``mlp.experts.{gate,up,down}_proj.weight`` of shape ``[E, I, H]``,
``[E, I, H]`` and ``[E, H, I]`` (each expert in the Hugging Face ``[out, in]``
orientation), so the routed-expert op (`mtp.ops.moe`) can gather the selected
experts' weights and an expert-parallel mesh can split them. A checkpoint stores
them per expert (``mlp.experts.{e}.gate_proj.weight``) or fused per layer;
`mtp.hf_layout` stacks and splits them.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mtp.config import ModelConfig

Params = dict[str, Any]

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A stacked routed-expert tensor of the tree: ``<stem>experts.<proj>.weight`` [E, out, in].
EXPERT_STACK = re.compile(r"^(?P<stem>.*\.mlp\.experts\.)(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def is_expert_stack(name: str) -> bool:
    """Whether the tree's tensor ``name`` is a stack of routed experts ``[E, out, in]``."""
    return EXPERT_STACK.match(name) is not None


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inner, hidden),
        f"{prefix}.up_proj.weight": (inner, hidden),
        f"{prefix}.down_proj.weight": (hidden, inner),
    }


def ffn_shapes(cfg: ModelConfig, prefix: str, moe: bool) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    if not moe:
        return _mlp_shapes(prefix, h, cfg.intermediate_size)
    shapes = {f"{prefix}.gate.weight": (cfg.num_experts, h)}
    shapes.update({name: (cfg.num_experts, *shape)
                   for name, shape in _mlp_shapes(f"{prefix}.experts", h, cfg.moe_intermediate_size).items()})
    if cfg.shared_expert_intermediate_size:
        shapes.update(_mlp_shapes(f"{prefix}.shared_expert", h, cfg.shared_expert_intermediate_size))
        shapes[f"{prefix}.shared_expert_gate.weight"] = (1, h)
    return shapes


def attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        # q_proj emits, per head, the query followed by its output gate.
        f"{prefix}.q_proj.weight": (cfg.num_attention_heads * d * 2, h),
        f"{prefix}.k_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}.v_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{prefix}.q_norm.weight": (d,),
        f"{prefix}.k_norm.weight": (d,),
    }


def linear_attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        f"{prefix}.in_proj_qkvz.weight": (2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, h),
        f"{prefix}.in_proj_ba.weight": (2 * hv, h),
        f"{prefix}.conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{prefix}.dt_bias": (hv,),
        f"{prefix}.A_log": (hv,),
        f"{prefix}.norm.weight": (cfg.linear_value_head_dim,),
        f"{prefix}.out_proj.weight": (h, cfg.linear_value_dim),
    }


def decoder_layer_shapes(cfg: ModelConfig, prefix: str, kind: str, moe: bool):
    h = cfg.hidden_size
    shapes = {
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.post_attention_layernorm.weight": (h,),
    }
    if kind == "full_attention":
        shapes.update(attention_shapes(cfg, f"{prefix}.self_attn"))
    else:
        shapes.update(linear_attention_shapes(cfg, f"{prefix}.linear_attn"))
    shapes.update(ffn_shapes(cfg, f"{prefix}.mlp", moe))
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    shapes = {
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
    }
    shapes.update(decoder_layer_shapes(cfg, "mtp.layers.0", "full_attention", cfg.mtp_is_moe))
    return shapes


def param_shapes(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint and its shape, in checkpoint order."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(decoder_layer_shapes(cfg, f"model.layers.{i}", kind, cfg.is_moe_layer(i)))
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    if include_mtp and cfg.has_mtp:
        shapes.update(mtp_shapes(cfg))
    return shapes


# ---------------------------------------------------------------- tree helpers
def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def unflatten(flat: Mapping[str, Any]) -> Params:
    tree: Params = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# ---------------------------------------------------------------- initialisation
def _init_one(name: str, shape: tuple[int, ...], key, dtype) -> jax.Array:
    if name.endswith("A_log"):
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if name.endswith("dt_bias"):
        return jnp.ones(shape, dtype)
    if name.endswith("linear_attn.norm.weight"):
        return jnp.ones(shape, dtype)  # the gated norm scales by w, not (1 + w)
    if len(shape) == 1:
        return jnp.zeros(shape, dtype)  # (1 + w) norms start at identity
    std = 0.02 if "embed_tokens" in name or "lm_head" in name else 1.0 / math.sqrt(shape[-1])
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight") or name.endswith("out_proj.weight"):
        std = std / 2.0
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, include_mtp: bool = True) -> Params:
    """Random weights of every tensor of `param_shapes`.

    One key per checkpoint tensor, in checkpoint order: a layer's experts take the keys
    of ``experts.0.gate_proj``, ``experts.0.up_proj``, ``experts.0.down_proj``,
    ``experts.1.gate_proj``, ... as a per-expert checkpoint lists them, and each expert is
    drawn as that tensor alone would be. The weights of a seed are then the same whether
    the tree stacks its experts or not.
    """
    shapes = param_shapes(cfg, include_mtp)
    experts = cfg.num_experts
    count = sum(experts if is_expert_stack(n) else 1 for n in shapes)
    keys = jax.random.split(key, count)
    flat, at = {}, 0
    for name, shape in shapes.items():
        m = EXPERT_STACK.match(name)
        if m is None:
            flat[name] = _init_one(name, shape, keys[at], dtype)
            at += 1
            continue
        proj = EXPERT_PROJECTIONS.index(m["proj"])
        if proj == 0:  # a layer's three stacks come in EXPERT_PROJECTIONS order and share its experts' keys
            n = experts * len(EXPERT_PROJECTIONS)  # keys[at:at + n], typed or raw uint32 keys alike
            group = keys[at:at + n].reshape(experts, len(EXPERT_PROJECTIONS), *keys.shape[1:])
            at += n
        flat[name] = jax.vmap(lambda k: _init_one(name, shape[1:], k, dtype))(group[:, proj])
    return unflatten(flat)


def perturb_norms(params: Params, key: jax.Array, scale: float = 0.1) -> Params:
    """Give every 1-D weight random values, so tests exercise the norm scales too."""
    flat = flatten(params)
    keys = jax.random.split(key, len(flat))
    out = {}
    for (name, w), k in zip(flat.items(), keys):
        if w.ndim == 1 and not name.endswith("A_log"):
            w = w + scale * jax.random.normal(k, w.shape, jnp.float32).astype(w.dtype)
        out[name] = w
    return unflatten(out)


def count_params(params: Params, include_mtp: bool = True) -> int:
    return int(sum(np.prod(v.shape) for n, v in flatten(params).items()
                   if include_mtp or not n.startswith("mtp.")))
