"""Model configuration, read from and written to a Hugging Face ``config.json``.

`ModelConfig` is frozen and hashable so that it can be a static argument of
``jax.jit``: every shape in the model is a function of it. Field names follow the
Qwen3-Next ``config.json`` so that ``from_hf(to_hf(c)) == c`` and a real checkpoint's
config loads unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# Image-text models whose language model this codebase runs: their config nests it in text_config.
TEXT_CONFIG_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LAYER_KINDS = ("linear_attention", "full_attention")
MTP_HIDDEN_SOURCES = ("post_norm", "pre_norm")


class ConfigError(ValueError):
    """A config that this codebase cannot run, with the offending field named."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "qwen3_next"
    # Not part of the HF schema: an ablation switch of this codebase (DESIGN §2).
    mtp_hidden_source: str = "post_norm"

    def __post_init__(self):
        _validate(self)

    # ------------------------------------------------------------------ layout
    @property
    def full_attention_interval(self) -> int | None:
        """The period of the 3:1 pattern, when the layer types follow it."""
        for interval in range(1, self.num_hidden_layers + 1):
            if self.layer_types == _periodic_layer_types(self.num_hidden_layers, interval):
                return interval
        return None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def is_moe_layer(self, layer: int) -> bool:
        """HF's rule: MoE unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def mtp_is_moe(self) -> bool:
        """The MTP layer follows the model's FFN kind (MoE checkpoints carry MoE MTP)."""
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Build from a ``config.json`` path, a checkpoint directory, or its dict."""
        origin = "<dict>"
        if not isinstance(source, Mapping):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            origin = path
            try:
                with open(path) as f:
                    source = json.load(f)
            except FileNotFoundError as e:
                raise ConfigError(f"{path}: no config.json") from e
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from e
        raw = dict(source)
        if raw.get("model_type") in TEXT_CONFIG_OF:
            raw = _text_config(raw, origin)
        # transformers >= 5 nests the RoPE fields; older configs keep them top level.
        rope = raw.get("rope_parameters") or {}
        if rope:
            if rope.get("rope_type", "default") != "default":
                raise ConfigError(f"{origin}: rope_parameters.rope_type={rope['rope_type']!r} is not supported")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope:
                    raw.setdefault(key, rope[key])
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{origin}: model_type {model_type!r} is not supported; "
                f"expected one of {SUPPORTED_MODEL_TYPES}"
            )
        try:
            n = int(raw["num_hidden_layers"])
            layer_types = raw.get("layer_types")
            if layer_types is None:
                layer_types = _periodic_layer_types(n, int(raw.get("full_attention_interval", 4)))
            mtp_layers = raw.get("num_nextn_predict_layers", raw.get("mtp_num_hidden_layers", 0))
            eos = raw.get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            kwargs = dict(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                num_hidden_layers=n,
                num_attention_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(raw["num_key_value_heads"]),
                head_dim=int(raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])),
                # Absent where every FFN is MoE (Qwen3.5-MoE); `_validate` asks for it otherwise.
                intermediate_size=int(raw.get("intermediate_size", 0)),
                layer_types=tuple(layer_types),
                mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers", ()) or ()),
                num_nextn_predict_layers=int(mtp_layers or 0),
                eos_token_id=eos,
            )
        except KeyError as e:
            raise ConfigError(f"{origin}: missing required field {e.args[0]!r}") from e
        for field in dataclasses.fields(cls):
            if field.name in kwargs or field.name not in raw:
                continue
            kwargs[field.name] = _coerce(field, raw[field.name])
        if raw.get("rope_scaling"):
            raise ConfigError(f"{origin}: rope_scaling={raw['rope_scaling']!r} is not supported")
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        interval = self.full_attention_interval
        if interval is not None:
            out["full_attention_interval"] = interval
        out["architectures"] = [ARCHITECTURES[self.model_type]]
        out["rope_scaling"] = None
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _text_config(raw: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """The language model's config of an image-text model (Qwen3.5): its ``text_config``.

    Only text runs here; the vision tower's config and weights are ignored. Positions of
    text tokens are the same on all three of multimodal RoPE's axes, which makes it the
    plain RoPE this model computes, so ``mrope_section`` needs nothing.
    """
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"{origin}: model_type {raw['model_type']!r} needs a text_config object")
    out = dict(text)
    if out.get("model_type") != TEXT_CONFIG_OF[raw["model_type"]]:
        raise ConfigError(f"{origin}: text_config.model_type {out.get('model_type')!r} is not "
                          f"{TEXT_CONFIG_OF[raw['model_type']]!r}")
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in out and key in raw:
            out[key] = raw[key]
    return out


def _periodic_layer_types(n: int, interval: int) -> tuple[str, ...]:
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
    )


def _coerce(field: dataclasses.Field, value: Any) -> Any:
    if value is None:
        return None
    kind = str(field.type)
    if kind.startswith("int"):
        return int(value)
    if kind.startswith("float"):
        return float(value)
    if kind.startswith("bool"):
        return bool(value)
    return value


def _validate(c: ModelConfig) -> None:
    def bad(field: str, why: str):
        raise ConfigError(f"config field {field}={getattr(c, field)!r}: {why}")

    if c.model_type not in SUPPORTED_MODEL_TYPES:
        bad("model_type", f"expected one of {SUPPORTED_MODEL_TYPES}")
    if len(c.layer_types) != c.num_hidden_layers:
        bad("layer_types", f"has {len(c.layer_types)} entries for {c.num_hidden_layers} layers")
    for t in c.layer_types:
        if t not in LAYER_KINDS:
            bad("layer_types", f"unknown layer type {t!r}; expected one of {LAYER_KINDS}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_conv_kernel_dim"):
        if getattr(c, name) <= 0:
            bad(name, "must be positive")
    if c.num_attention_heads % c.num_key_value_heads:
        bad("num_attention_heads", f"not a multiple of num_key_value_heads={c.num_key_value_heads}")
    if c.linear_layers and c.linear_num_value_heads % c.linear_num_key_heads:
        bad("linear_num_value_heads", f"not a multiple of linear_num_key_heads={c.linear_num_key_heads}")
    if not 0 < c.partial_rotary_factor <= 1 or c.rotary_dim % 2:
        bad("partial_rotary_factor", f"gives an odd or empty rotary dim {c.rotary_dim}")
    if c.hidden_act != "silu":
        bad("hidden_act", "only silu is supported")
    if c.attention_bias:
        bad("attention_bias", "biased attention projections are not supported")
    if c.num_experts:
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            bad("num_experts_per_tok", f"must be in 1..num_experts={c.num_experts}")
        if c.moe_intermediate_size <= 0:
            bad("moe_intermediate_size", "must be positive for a MoE model")
        if c.decoder_sparse_step <= 0:
            bad("decoder_sparse_step", "must be positive")
    dense = [i for i in range(c.num_hidden_layers) if not c.is_moe_layer(i)]
    if c.intermediate_size <= 0 and (dense or (c.has_mtp and not c.mtp_is_moe)):
        bad("intermediate_size", f"must be positive: the FFNs of layers {dense or ['mtp']} are dense")
    if c.num_nextn_predict_layers not in (0, 1):
        bad("num_nextn_predict_layers", "only a single MTP layer is supported")
    if c.mtp_hidden_source not in MTP_HIDDEN_SOURCES:
        bad("mtp_hidden_source", f"expected one of {MTP_HIDDEN_SOURCES}")
