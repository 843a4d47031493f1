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
import re
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
class Fp8Quantization:
    """``config.json``'s ``quantization_config`` of a block-scaled FP8 checkpoint (``quant_method: fp8``).

    Qwen's FP8 checkpoints store their Linear weights as E4M3 values with one
    ``weight_scale_inv`` per 128 x 128 block (`mtp.ops.fp8`), and scale activations per token
    at run time (``activation_scheme: dynamic``). ``modules_to_not_convert`` lists the modules
    kept in bf16, with transformers' matching rule (`converts`). ``extra``: the object's other
    keys, ``(key, JSON text)`` sorted, which mean nothing here and are written back as read.
    """

    fmt: str = "e4m3"
    weight_block_size: tuple[int, ...] = (128, 128)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] | None = None
    extra: tuple[tuple[str, str], ...] = ()

    QUANT_METHOD = "fp8"

    def __post_init__(self):
        def bad(field: str, why: str):
            raise _field_error(f"quantization_config.{field}", getattr(self, field), why)

        if self.fmt != "e4m3":
            bad("fmt", "only e4m3 (float8_e4m3fn) weights are supported")
        if tuple(self.weight_block_size) != (128, 128):
            bad("weight_block_size", "only [128, 128] blocks are supported (Qwen's FP8 checkpoints)")
        if self.activation_scheme != "dynamic":
            bad("activation_scheme", "only dynamic activation scales are supported (a static scheme "
                                     "needs per-layer input scales)")

    def converts(self, module: str) -> bool:
        """Whether the checkpoint may hold ``module``'s (a tensor name without ``.weight``) weight in FP8.

        transformers' rule (``should_convert_module``): an entry excludes a module it matches as
        a regular expression from the start of the name (so ``model.layers.0`` excludes
        that layer's modules) or that ends with it (``mlp.gate``).
        """
        return not any(re.match(key, module) or module.endswith(key) for key in self.modules_to_not_convert or ())

    @classmethod
    def from_hf(cls, raw: Any) -> "Fp8Quantization":
        if not isinstance(raw, Mapping):
            raise _field_error("quantization_config", raw, "expected an object")
        raw = dict(raw)
        method = raw.pop("quant_method", None)
        if method != cls.QUANT_METHOD:
            raise _field_error("quantization_config.quant_method", method,
                               f"only {cls.QUANT_METHOD!r} (block-scaled FP8) checkpoints are supported")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in raw and f.name != "extra":
                kwargs[f.name] = _coerce(f"quantization_config.{f.name}", f.type, raw.pop(f.name))
        kwargs["extra"] = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in raw.items()))
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        out = {k: json.loads(v) for k, v in self.extra}
        out.update(quant_method=self.QUANT_METHOD, fmt=self.fmt, weight_block_size=list(self.weight_block_size),
                   activation_scheme=self.activation_scheme)
        if self.modules_to_not_convert is not None:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out


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
    # A block-scaled FP8 checkpoint's `Fp8Quantization`; None for a bf16 / f32 one.
    quantization_config: Fp8Quantization | None = None
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
        """Build from a ``config.json`` path, a checkpoint directory, or its dict.

        Every problem is a `ConfigError` that starts with the file (``<dict>`` for a
        dict), so a user holding several checkpoints knows which config to fix.
        """
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
            if not isinstance(source, Mapping):
                raise ConfigError(f"{path}: not a JSON object")
        try:
            return cls._from_raw(dict(source))
        except ConfigError as e:
            raise ConfigError(f"{origin}: {e}") from e

    @classmethod
    def _from_raw(cls, raw: dict[str, Any]) -> "ModelConfig":
        if raw.get("model_type") in TEXT_CONFIG_OF:
            raw = _text_config(raw)
        # transformers >= 5 nests the RoPE fields; older configs keep them top level.
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"rope_parameters={rope!r} is not an object")
        if rope:
            if rope.get("rope_type", "default") != "default":
                raise ConfigError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope:
                    raw.setdefault(key, rope[key])
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        if raw.get("rope_scaling"):
            raise ConfigError(f"rope_scaling={raw['rope_scaling']!r} is not supported")
        # HF spellings that differ from the fields: an aliased MTP depth, EOS as a list, and null
        # meaning "none" (MTP layers, dense-only layers) or "derive it" (the three below).
        raw["num_nextn_predict_layers"] = raw.get("num_nextn_predict_layers", raw.get("mtp_num_hidden_layers")) or 0
        raw["mlp_only_layers"] = raw.get("mlp_only_layers") or ()
        if isinstance(raw.get("eos_token_id"), list):
            raw["eos_token_id"] = raw["eos_token_id"][0] if raw["eos_token_id"] else None
        for derived in ("layer_types", "head_dim", "intermediate_size"):
            if raw.get(derived) is None:
                raw.pop(derived, None)
        # Absent where every FFN is MoE (Qwen3.5-MoE); `_validate` asks for it otherwise.
        raw.setdefault("intermediate_size", 0)
        quantization = raw.pop("quantization_config", None)
        fields = dataclasses.fields(cls)
        kwargs = {f.name: _coerce(f.name, f.type, raw[f.name]) for f in fields if f.name in raw}
        if quantization is not None:
            kwargs["quantization_config"] = Fp8Quantization.from_hf(quantization)

        def required(name: str) -> Any:
            if name not in kwargs:
                raise ConfigError(f"missing required field {name!r}")
            return kwargs[name]

        if "layer_types" not in kwargs:
            interval = _coerce("full_attention_interval", "int", raw.get("full_attention_interval", 4))
            if interval <= 0:
                raise _field_error("full_attention_interval", interval, "must be positive")
            kwargs["layer_types"] = _periodic_layer_types(required("num_hidden_layers"), interval)
        if "head_dim" not in kwargs:
            heads = required("num_attention_heads")
            if heads <= 0:
                raise _field_error("num_attention_heads", heads, "must be positive")
            kwargs["head_dim"] = required("hidden_size") // heads
        for f in fields:
            if f.default is dataclasses.MISSING:
                required(f.name)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["quantization_config"]
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config.to_hf()
        out["layer_types"] = list(self.layer_types)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        interval = self.full_attention_interval
        if interval is not None:
            out["full_attention_interval"] = interval
        out["architectures"] = [ARCHITECTURES[self.model_type]]
        out["rope_scaling"] = None
        if self.model_type != "qwen3_next":  # Qwen3.5 readers (vLLM's qwen3_5_mtp) look for their own key
            out["mtp_num_hidden_layers"] = self.num_nextn_predict_layers
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config of an image-text model (Qwen3.5): its ``text_config``.

    Only text runs here; the vision tower's config and weights are ignored. Positions of
    text tokens are the same on all three of multimodal RoPE's axes, which makes it the
    plain RoPE this model computes, so ``mrope_section`` needs nothing.
    """
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"model_type {raw['model_type']!r} needs a text_config object")
    out = dict(text)
    if out.get("model_type") != TEXT_CONFIG_OF[raw["model_type"]]:
        raise ConfigError(f"text_config.model_type {out.get('model_type')!r} is not "
                          f"{TEXT_CONFIG_OF[raw['model_type']]!r}")
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "quantization_config"):
        if key not in out and key in raw:
            out[key] = raw[key]
    return out


def _periodic_layer_types(n: int, interval: int) -> tuple[str, ...]:
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
    )


def _as_bool(value: Any) -> bool:
    """JSON true/false (or 0/1); ``bool("false")`` would silently be True."""
    if value not in (True, False):
        raise TypeError(f"{value!r} is not a boolean")
    return bool(value)


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


_SCALARS = {"int": int, "float": float, "bool": _as_bool, "str": _as_str}


def _coerce(name: str, kind: str, value: Any) -> Any:
    """``value`` as the field type ``kind`` (its annotation text), or a `ConfigError` naming the field.

    A malformed config.json must fail by naming the field it got wrong, not as a bare
    ``int()`` error deep in the model; ``None`` is accepted only where the type allows it.
    """
    scalar = kind.removesuffix(" | None")
    if value is None and scalar != kind:
        return None
    item = scalar.removeprefix("tuple[").removesuffix(", ...]")
    many = item != scalar
    try:
        if many:
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{value!r} is not a list")
            return tuple(_SCALARS[item](v) for v in value)
        return _SCALARS[item](value)
    except (TypeError, ValueError, OverflowError) as e:
        raise _field_error(name, value, f"expected {f'a list of {item}' if many else kind}") from e


def _field_error(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config field {name}={value!r}: {why}")


def _validate(c: ModelConfig) -> None:
    def bad(field: str, why: str):
        raise _field_error(field, getattr(c, field), why)

    if c.model_type not in SUPPORTED_MODEL_TYPES:
        bad("model_type", f"expected one of {SUPPORTED_MODEL_TYPES}")
    # Sizes before the checks below, which divide by some of them or count layers.
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_conv_kernel_dim"):
        if getattr(c, name) <= 0:
            bad(name, "must be positive")
    if len(c.layer_types) != c.num_hidden_layers:
        bad("layer_types", f"has {len(c.layer_types)} entries for {c.num_hidden_layers} layers")
    for t in c.layer_types:
        if t not in LAYER_KINDS:
            bad("layer_types", f"unknown layer type {t!r}; expected one of {LAYER_KINDS}")
    if c.num_attention_heads % c.num_key_value_heads:
        bad("num_attention_heads", f"not a multiple of num_key_value_heads={c.num_key_value_heads}")
    if c.linear_layers:
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim"):
            if getattr(c, name) <= 0:
                bad(name, "must be positive in a model with linear-attention layers")
        if c.linear_num_value_heads % c.linear_num_key_heads:
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
