"""Hugging Face checkpoint I/O: ``config.json`` + ``*.safetensors`` (single or sharded).

The checkpoint's tensor names are the parameter tree's dotted paths
(`mtp.model.params`) in Qwen3-Next checkpoints, so loading is a validation against
`param_shapes` rather than a renaming, except that the tree stacks each layer's routed
experts ``[E, ...]`` where a checkpoint stores them per expert or fused; a Qwen3.5
checkpoint splits a few more tensors differently. `mtp.hf_layout` regroups both. Every problem a checkpoint can have -- a tensor missing, misshapen, of
an unsupported dtype or unexpected, a shard missing or cut short -- is reported as a
`CheckpointError` that names the tensor and the file, because the usual cause is a
config.json that does not match its weights, and the name is what points at it.

Block-scaled FP8 checkpoints (Qwen's ``*-FP8``: ``quantization_config.quant_method = fp8``)
load unchanged and stay 8-bit: each ``F8_E4M3`` tensor and its ``<name>_scale_inv`` become one
`mtp.ops.fp8.BlockFp8Weight` leaf of the tree, and a save writes both back with their own names
and dtypes. ``load_pretrained(..., weight_quant="fp8")`` quantizes a bf16 checkpoint's Linear
weights the same way at load, as if the checkpoint had been published in FP8.

Loading reads one tensor at a time and hands it to a ``place`` callback, so a
sharded loader can put each tensor straight onto its devices without the whole
model ever sitting in host memory. Saving is atomic: a checkpoint directory either
is the complete old one or the complete new one, never a mixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import struct
import tempfile
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtp.config import ConfigError, Fp8Quantization, ModelConfig
from mtp.hf_layout import layout_of, read_tree
from mtp.model.params import Params, flatten, param_shapes, unflatten
from mtp.ops import fp8
from mtp.ops.fp8.regroup import to_block_rows

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Training-split frequency of each token id (int64[vocab_size]), for a reduced draft vocabulary.
TOKEN_COUNTS_NAME = "token_counts.npy"

# safetensors dtype tag -> numpy dtype, for the float formats the model computes in.
SUPPORTED_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
}
# Files a checkpoint directory usually carries beside its weights, worth keeping on re-save.
DEFAULT_EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "generation_config.json", "README.md", TOKEN_COUNTS_NAME)
_RESERVED = (CONFIG_NAME, SINGLE_NAME, INDEX_NAME)

FP8_TAG = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" is scaled by "<module>.weight_scale_inv"
SCALE_DTYPES = {"F32": "float32", "BF16": "bfloat16"}
# The modules an FP8 checkpoint may hold in FP8: the Linear projections (checkpoint names, so
# Qwen3.5's separate in_proj_qkv / in_proj_z too, and fused experts' gate_up_proj / down_proj).
# Everything else stays bf16: norms, embeddings, lm_head, the router (mlp.gate), the
# shared_expert_gate, and the Gated DeltaNet's in_proj_ba / in_proj_b / in_proj_a, conv1d,
# A_log and dt_bias (small, and precision-sensitive).
FP8_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_qkv", "in_proj_z",
                         "out_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc"})
WEIGHT_QUANT_CHOICES = ("none", "fp8")

Place = Callable[[str, "np.ndarray | fp8.BlockFp8Weight"], "jax.Array | fp8.BlockFp8Weight"]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read; names tensor and file."""


def module_of(name: str) -> str:
    """The module a checkpoint tensor belongs to: its name without a trailing ``.weight``."""
    return name.removesuffix(".weight")


def may_be_fp8(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` is a Linear weight an FP8 checkpoint holds in FP8."""
    parts = name.split(".")
    if parts[-1] == "weight":
        return len(parts) >= 2 and parts[-2] in FP8_MODULES
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in ("gate_up_proj", "down_proj")


def place_on_device(name: str, array):
    """`load_pretrained`'s default ``place``: the array (or an FP8 weight's two) on the default device."""
    return jax.tree.map(jnp.asarray, array)


# ====================================================================== loading
def load_pretrained(path: str | os.PathLike, dtype=None, place: Place | None = None,
                    weight_quant: str = "none") -> tuple[ModelConfig, Params]:
    """Read a Hugging Face checkpoint directory into ``(config, nested params)``.

    Each tensor keeps its file dtype (F32, BF16 or F16) unless ``dtype`` is given; an FP8
    checkpoint's FP8 weights stay `fp8.BlockFp8Weight` (8-bit values, f32 block scales)
    whatever ``dtype`` says. ``weight_quant="fp8"`` quantizes every other Linear weight
    (`may_be_fp8`, and not excluded by the config's ``modules_to_not_convert``) to FP8 blocks
    at load, with the returned config carrying the matching ``quantization_config``.
    ``place(name, array)`` turns each host array (or FP8 weight of host arrays) into device
    arrays as soon as it is read (default `place_on_device`). All headers are checked
    against the config before any tensor data is read, so a mismatch fails fast and names
    everything needed to find it.
    """
    root = pathlib.Path(path)
    cfg = load_config(root)
    cast = None if dtype is None else np.dtype(dtype)
    if cast is not None and cast not in SUPPORTED_DTYPES.values():
        raise CheckpointError(f"load dtype {cast} is not one of {sorted(map(str, SUPPORTED_DTYPES.values()))}")
    if weight_quant not in WEIGHT_QUANT_CHOICES:
        raise CheckpointError(f"weight_quant={weight_quant!r}; choose one of {', '.join(WEIGHT_QUANT_CHOICES)}")
    place = place or place_on_device

    every = _locate_tensors(root)
    layout = layout_of(cfg, every)
    every = {n: loc for n, loc in every.items() if not n.startswith(layout.skipped_prefixes)}
    scales = _pair_fp8_scales(cfg, root, every)
    locations = {n: loc for n, loc in every.items() if n not in scales.values()}  # the weights
    tree_shapes = param_shapes(cfg, include_mtp=True)
    _check_against_config(cfg, root, locations, layout.shapes(tree_shapes), fp8_names=set(scales))
    quantized = set()
    if weight_quant == "fp8":
        rule = cfg.quantization_config or Fp8Quantization()
        quantized = {n for n, (_, tag, _) in locations.items()
                     if tag != FP8_TAG and may_be_fp8(n) and rule.converts(module_of(n))}
        if cfg.quantization_config is None:
            kept = sorted(module_of(n) for n, (_, _, shape) in locations.items()
                          if len(shape) >= 2 and n not in quantized and n not in scales)
            cfg = cfg.replace(quantization_config=Fp8Quantization(modules_to_not_convert=tuple(kept)))

    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in {f for f, _, _ in every.values()}}
        headers: dict[pathlib.Path, tuple[int, dict]] = {}

        def read_one(name: str) -> np.ndarray:
            file, tag, _ = every[name]
            if tag == FP8_TAG:  # safetensors' numpy reader has no float8 dtype
                return _read_raw_fp8(file, name, headers)
            try:
                return handles[file].get_tensor(name)
            except SafetensorError as e:
                raise CheckpointError(f"{file}: cannot read tensor {name!r}: {e}") from e

        def read(name: str):
            if name in scales:
                scale_name = scales[name]
                return fp8.BlockFp8Weight(read_one(name), read_one(scale_name).astype(np.float32), fp8.BLOCK,
                                          SCALE_DTYPES[every[scale_name][1]])
            array = read_one(name)
            if name in quantized:
                return jax.tree.map(np.asarray, fp8.quantize(array))
            return array if cast is None else array.astype(cast)

        flat = {name: place(name, array) for name, array in read_tree(layout, tree_shapes, read)}
    return cfg, unflatten(flat)


def _pair_fp8_scales(cfg: ModelConfig, root: pathlib.Path, locations) -> dict[str, str]:
    """Each FP8 tensor's name -> its ``weight_scale_inv``'s, every pairing checked against the config.

    An FP8 tensor needs a ``quantization_config``, a module that may be FP8 and that
    ``modules_to_not_convert`` does not exclude, and a scale of F32 or BF16 whose shape is
    the weight's in 128 x 128 blocks (partial edge blocks rounded up).
    """
    config_file = root / CONFIG_NAME
    quant = cfg.quantization_config
    pairs = {}
    for name, (file, tag, shape) in locations.items():
        if tag != FP8_TAG:
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight != name and weight in locations and locations[weight][1] != FP8_TAG:
                raise CheckpointError(f"{file}: tensor {name!r} scales {weight!r}, which is "
                                      f"{locations[weight][1]}, not {FP8_TAG}")
            continue
        module = module_of(name)
        if quant is None:
            raise CheckpointError(f"{file}: tensor {name!r} is {FP8_TAG}, but {config_file} has no "
                                  f"quantization_config (an FP8 checkpoint's says quant_method: fp8)")
        if not may_be_fp8(name):
            raise CheckpointError(f"{file}: tensor {name!r} is {FP8_TAG}, but module {module!r} must stay bf16 "
                                  f"(only Linear projections are FP8: {', '.join(sorted(FP8_MODULES))})")
        if not quant.converts(module):
            raise CheckpointError(f"{file}: tensor {name!r} is {FP8_TAG}, but {config_file}'s "
                                  f"quantization_config.modules_to_not_convert keeps module {module!r} in bf16")
        scale = name + SCALE_SUFFIX
        if scale not in locations:
            raise CheckpointError(f"{file}: FP8 tensor {name!r} has no block scales {scale!r} in the checkpoint")
        scale_file, scale_tag, scale_shape = locations[scale]
        if scale_tag not in SCALE_DTYPES:
            raise CheckpointError(f"{scale_file}: scale tensor {scale!r} has dtype {scale_tag}; "
                                  f"supported: {', '.join(SCALE_DTYPES)}")
        want = fp8.scale_shape(shape, fp8.BLOCK)
        if scale_shape != want:
            raise CheckpointError(f"{scale_file}: scale tensor {scale!r} has shape {scale_shape}, but its FP8 "
                                  f"weight {name!r} of shape {shape} needs {want} (128 x 128 blocks)")
        pairs[name] = scale
    return pairs


def _read_raw_fp8(file: pathlib.Path, name: str, headers: dict) -> np.ndarray:
    """An ``F8_E4M3`` tensor as ``ml_dtypes.float8_e4m3fn``, read from the file's bytes."""
    if file not in headers:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            headers[file] = (8 + size, json.loads(f.read(size)))
    data_start, header = headers[file]
    info = header[name]
    begin, end = info["data_offsets"]
    with open(file, "rb") as f:
        f.seek(data_start + begin)
        data = f.read(end - begin)
    count = int(np.prod(info["shape"]))
    if len(data) != count:
        raise CheckpointError(f"{file}: tensor {name!r} is cut short ({len(data)} of {count} bytes)")
    return np.frombuffer(data, ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The checkpoint's `ModelConfig` as `load_pretrained` reads it (sharded loads build their
    shardings from it): ``config.json``, and the MTP depth from the weights where it names none.

    Qwen3-Next's released config.json has no ``num_nextn_predict_layers`` (serving engines
    assume one layer), though its weights carry that layer: the tensors say what the config
    does not. A config that states a depth, zero included, is taken at its word.
    """
    root = pathlib.Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    try:
        cfg = ModelConfig.from_hf(root)
    except ConfigError as e:  # already names config.json
        raise CheckpointError(str(e)) from e
    if not cfg.has_mtp and not _states_mtp_depth(root) and any(n.startswith("mtp.") for n in _locate_tensors(root)):
        cfg = cfg.replace(num_nextn_predict_layers=1)
    return cfg


def _states_mtp_depth(root: pathlib.Path) -> bool:
    """Whether config.json (or its ``text_config``) names the MTP depth at all, zero included."""
    raw = json.loads((root / CONFIG_NAME).read_text())
    scopes = [raw, raw.get("text_config")]
    return any(isinstance(c, dict) and ("num_nextn_predict_layers" in c or "mtp_num_hidden_layers" in c)
               for c in scopes)


def _open(file: pathlib.Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from e


def _locate_tensors(root: pathlib.Path) -> dict[str, tuple[pathlib.Path, str, tuple[int, ...]]]:
    """Every tensor of the checkpoint -> (file, safetensors dtype tag, shape), headers only."""
    index = root / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not an object")
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise CheckpointError(f"{index}: 'weight_map' maps tensor {name!r} to {shard!r}, not a shard file name")
        wanted: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            wanted.setdefault(shard, []).append(name)
        for shard, names in wanted.items():
            if not (root / shard).is_file():
                raise CheckpointError(
                    f"{index}: tensor {names[0]!r} (and {len(names) - 1} more) is mapped to shard "
                    f"{shard!r}, which does not exist in {root}")
        files = [root / s for s in wanted]
    elif (root / SINGLE_NAME).exists():
        weight_map, files = None, [root / SINGLE_NAME]
    else:
        files = sorted(root.glob("*.safetensors"))
        weight_map = None
        if not files:
            raise CheckpointError(f"{root}: no {SINGLE_NAME}, no {INDEX_NAME} and no *.safetensors files")

    out: dict[str, tuple[pathlib.Path, str, tuple[int, ...]]] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                if weight_map is not None and weight_map.get(name) != file.name:
                    raise CheckpointError(
                        f"{file}: holds tensor {name!r}, which {INDEX_NAME} maps to "
                        f"{weight_map.get(name)!r} instead")
                if name in out:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {out[name][0].name}")
                sl = f.get_slice(name)
                out[name] = (file, sl.get_dtype(), tuple(sl.get_shape()))
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in out:
                raise CheckpointError(f"{root / shard}: tensor {name!r} is listed in {INDEX_NAME} but absent")
    return out


def _check_against_config(cfg: ModelConfig, root: pathlib.Path, locations, expected, fp8_names=frozenset()) -> None:
    """Every tensor of ``expected`` (checkpoint name -> shape) present, shaped and typed; nothing else.

    ``fp8_names``: the FP8 weights `_pair_fp8_scales` found their scales for (their dtype is F8_E4M3).
    """
    config_file = root / CONFIG_NAME
    for name, shape in expected.items():
        if name not in locations:
            files = ", ".join(sorted({f.name for f, _, _ in locations.values()})) or "the weight files"
            raise CheckpointError(
                f"{root}: tensor {name!r} (shape {shape}) required by {config_file.name} is missing from {files}")
        file, tag, got = locations[name]
        if got != shape:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {got}, but {config_file.name} implies {shape}")
        if tag not in SUPPORTED_DTYPES and name not in fp8_names:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {tag}; supported: {', '.join(SUPPORTED_DTYPES)}, "
                f"and {FP8_TAG} with its block scales in an FP8 checkpoint")
    for name, (file, _, got) in locations.items():
        if name not in expected:
            hint = (" (num_nextn_predict_layers is 0 in config.json)"
                    if name.startswith("mtp.") and not cfg.has_mtp else "")
            raise CheckpointError(f"{file}: unexpected tensor {name!r} with shape {got}{hint}")


# ====================================================================== saving
def save_pretrained(path: str | os.PathLike, cfg: ModelConfig, params: Params,
                    max_shard_bytes: int | None = None, metadata: Mapping[str, str] | None = None,
                    extra_files: Mapping[str, str | bytes | os.PathLike] | None = None,
                    fused_experts: bool = False) -> pathlib.Path:
    """Write ``cfg`` and ``params`` as a Hugging Face checkpoint directory, atomically.

    Routed experts are written per expert (``experts.{e}.gate_proj.weight``, as transformers
    writes them), or with ``fused_experts`` fused per layer (``experts.gate_up_proj``,
    ``experts.down_proj``); ``hf_layout.stores_fused_experts`` tells which form a checkpoint
    holds, so a load and save writes back the file's own names.

    Tensors go to one ``model.safetensors``, or, when their total exceeds
    ``max_shard_bytes``, to ``model-0000i-of-0000n.safetensors`` shards with a
    ``model.safetensors.index.json``. ``metadata`` is stored in each safetensors
    header. ``extra_files`` maps a file name to its content: ``str`` is written as
    UTF-8 text, ``bytes`` as is, and an ``os.PathLike`` is copied from that path.

    Everything is written and fsynced in a temporary directory beside ``path`` and
    then renamed into place; an existing checkpoint at ``path`` is replaced only
    once the new one is complete, and survives unchanged if anything fails.
    """
    target = pathlib.Path(path).absolute()
    flat = flatten(params)
    _check_params(cfg, flat)
    extra = dict(extra_files or {})
    for name, content in extra.items():
        if name in _RESERVED or name.endswith(".safetensors") or pathlib.PurePath(name).name != name:
            raise CheckpointError(f"extra file name {name!r} is reserved or not a plain file name")
        if not isinstance(content, (str, bytes, os.PathLike)):
            raise CheckpointError(f"extra file {name!r}: content must be str, bytes or a path, "
                                  f"got {type(content).__name__}")
        if isinstance(content, os.PathLike) and not os.path.isfile(content):
            raise CheckpointError(f"extra file {name!r}: {os.fspath(content)} is not a file")
    bad_meta = {k: v for k, v in dict(metadata or {}).items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad_meta:
        raise CheckpointError(f"safetensors metadata must map str to str; got {bad_meta!r}")
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target}: exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)

    header = {"format": "pt", **dict(metadata or {})}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_json(tmp / CONFIG_NAME, cfg.to_hf())
        tensors = _with_fp8_scales(layout_of(cfg, fused_experts=fused_experts).tree_to_checkpoint(
            {name: _to_numpy(flat[name]) for name in param_shapes(cfg)}))
        shards = _plan_shards(tensors, max_shard_bytes)
        n = len(shards)
        weight_map = {}
        for i, names in enumerate(shards):
            file = SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file({name: tensors[name] for name in names}, str(tmp / file), metadata=header)
            _fsync_file(tmp / file)
            weight_map.update({name: file for name in names})
        if n > 1:
            total = sum(_nbytes(v) for v in tensors.values())
            _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        for name, content in extra.items():
            dest = tmp / name
            if isinstance(content, os.PathLike):
                shutil.copyfile(content, dest)
            else:
                dest.write_bytes(content.encode() if isinstance(content, str) else content)
            _fsync_file(dest)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would keep the checkpoint from other users
        _fsync_dir(tmp)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def extra_files_from(src: str | os.PathLike, names=DEFAULT_EXTRA_FILES) -> dict[str, pathlib.Path]:
    """The tokenizer / model-card files present in ``src``, as ``extra_files`` for a re-save."""
    root = pathlib.Path(src)
    return {n: root / n for n in names if (root / n).is_file()}


def _with_fp8_scales(tensors) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each FP8 weight as its values and ``<name>_scale_inv``, in 128 x 128 blocks."""
    out = {}
    for name, value in tensors:
        if isinstance(value, fp8.BlockFp8Weight):
            try:
                value = to_block_rows(value, fp8.BLOCK[0], name)
            except ValueError as e:
                raise CheckpointError(f"params: {e}") from e
            out[name] = np.ascontiguousarray(value.values)
            out[name + SCALE_SUFFIX] = np.ascontiguousarray(value.scale_inv.astype(np.dtype(value.scale_dtype)))
        else:
            out[name] = value
    return out


def _check_fp8_param(cfg: ModelConfig, name: str, w: fp8.BlockFp8Weight) -> None:
    if cfg.quantization_config is None:
        raise CheckpointError(f"params: tensor {name!r} is an FP8 weight, but the config has no quantization_config "
                              f"(cfg.replace(quantization_config=Fp8Quantization(...)))")
    if not may_be_fp8(name):
        raise CheckpointError(f"params: tensor {name!r} is an FP8 weight, but its module must stay bf16")
    if np.dtype(w.values.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
        raise CheckpointError(f"params: FP8 weight {name!r} holds {w.values.dtype} values, not float8_e4m3fn")
    want = fp8.scale_shape(w.shape, w.block)
    if tuple(w.scale_inv.shape) != want or w.block[1] != fp8.BLOCK[1] or w.scale_dtype not in SCALE_DTYPES.values():
        raise CheckpointError(f"params: FP8 weight {name!r} of shape {w.shape} has scales {tuple(w.scale_inv.shape)} "
                              f"in {w.block} blocks stored as {w.scale_dtype}; it needs {want} in blocks of "
                              f"128 columns, stored as float32 or bfloat16")


def _check_params(cfg: ModelConfig, flat: Mapping[str, Any]) -> None:
    expected = param_shapes(cfg, include_mtp=True)
    for name, shape in expected.items():
        if name not in flat:
            raise CheckpointError(f"params: tensor {name!r} (shape {shape}) required by the config is missing")
        value = flat[name]
        if isinstance(value, fp8.BlockFp8Weight):
            if value.shape != shape:
                raise CheckpointError(f"params: tensor {name!r} has shape {value.shape}, the config implies {shape}")
            _check_fp8_param(cfg, name, value)
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise CheckpointError(f"params: tensor {name!r} is a {type(value).__name__}, not an array")
        got = tuple(value.shape)
        if got != shape:
            raise CheckpointError(f"params: tensor {name!r} has shape {got}, the config implies {shape}")
        dt = np.dtype(value.dtype)
        if dt not in SUPPORTED_DTYPES.values():
            raise CheckpointError(f"params: tensor {name!r} has dtype {dt}; supported: float32, bfloat16, float16")
    for name in flat:
        if name not in expected:
            raise CheckpointError(f"params: unexpected tensor {name!r} (not in the config's parameter set)")


def _nbytes(value) -> int:
    if isinstance(value, fp8.BlockFp8Weight):
        return sum(_nbytes(part) for part in (value.values, value.scale_inv))
    return int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize


def _plan_shards(flat: Mapping[str, Any], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy in checkpoint order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes} must be positive")
    shards: list[list[str]] = [[]]
    size = 0
    for name, value in flat.items():
        nb = _nbytes(value)
        if max_shard_bytes is not None and shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb
    return shards


def _to_numpy(value):
    """A host copy of a device array, or of an FP8 weight's two."""
    return jax.tree.map(lambda a: np.ascontiguousarray(np.asarray(jax.device_get(a))), value)


def _write_json(file: pathlib.Path, obj) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    _fsync_file(file)


def _fsync_file(file: pathlib.Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Rename ``tmp`` to ``target``; an old ``target`` is moved aside first and removed last.

    Two renames on one filesystem: at every instant ``target`` is either absent
    (between them, and then the old copy sits beside it under a ``.old-`` name) or
    complete. If the second rename fails the old checkpoint is put back.
    """
    old = None
    if target.exists():
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rmdir(old)
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
