"""Sharded serving: one device mesh, and the layout of every parameter and cache array on it.

The model code has no notion of devices. Parameters and caches are placed on a
``Mesh`` with `NamedSharding`s and the unchanged jitted entry points (prefill,
verify, the greedy and speculative loops) are partitioned by XLA's SPMD
partitioner from those input layouts; XLA inserts the collectives, there is no
hand-written communication.

Mesh axes are ``("ep", "tp")``:

* ``tp`` (tensor parallel) splits attention heads, Gated DeltaNet key-head groups,
  FFN inner columns and the vocabulary;
* ``ep`` (expert parallel) splits the routed experts of MoE layers. Everything
  that is not an expert is replicated along ``ep`` (each ``ep`` group holds the
  whole non-expert model, tensor-parallel over its ``tp`` devices).

`param_specs` is the one table of parameter layouts, keyed by Hugging Face tensor
name; `cache_sharding` is the one place for cache layouts. A dimension that does
not divide evenly over ``tp`` (KV heads fewer than ``tp``, a vocabulary of 97) is
replicated rather than padded, so a layout never changes the arithmetic.

The params hold each layer's routed experts stacked, ``mlp.experts.{gate,up,down}_proj.weight``
of shape ``[E, ...]`` (`mtp.model.params`), on every mesh: ``ep`` splits that leading
expert axis, ``tp`` the experts' inner columns.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mtp import checkpoint
from mtp.cache.state import LinearState, PagedKV, TargetCache
from mtp.config import ModelConfig
from mtp.model.params import Params, flatten, param_shapes, unflatten
from mtp.mtp_head import DrafterCache
from mtp.ops.fp8 import BlockFp8Weight
from mtp.ops.lowering import TENSOR_AXIS

EP, TP = "ep", TENSOR_AXIS  # tp: the axis the Pallas kernels split on under a mesh too
AXES = (EP, TP)


# ====================================================================== mesh
def make_mesh(tp: int, ep: int = 1, devices=None) -> Mesh:
    """An ``ep x tp`` mesh over the first ``ep * tp`` of ``devices`` (default: all devices).

    Adjacent devices form a ``tp`` group: tensor parallelism all-reduces on every
    layer, so it gets the closest links; ``ep`` reduces once per MoE layer.
    """
    if tp < 1 or ep < 1:
        raise ValueError(f"mesh sizes must be positive, got tp={tp}, ep={ep}")
    devices = list(jax.devices() if devices is None else devices)
    need = tp * ep
    if len(devices) < need:
        raise ValueError(f"a mesh of ep={ep} x tp={tp} needs {need} devices, only {len(devices)} are available "
                         f"(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax)")
    return jax.make_mesh((ep, tp), AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:need])


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """``(tp, ep)`` of a mesh built by `make_mesh`."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes are {mesh.axis_names}, expected {AXES} (use make_mesh)")
    return mesh.shape[TP], mesh.shape[EP]


def check_expert_split(cfg: ModelConfig, mesh: Mesh) -> None:
    """Refuse an ``ep > 1`` mesh for a model without experts, or whose experts do not divide over ``ep``."""
    _, ep = mesh_sizes(mesh)
    if ep == 1:
        return
    if cfg.num_experts == 0:
        raise ValueError(f"mesh has ep={ep} but the model has no experts (num_experts=0); use ep=1")
    if cfg.num_experts % ep:
        raise ValueError(f"num_experts={cfg.num_experts} does not split evenly over ep={ep}")


# ====================================================================== parameter layouts
def _rows(ok: bool, ndim: int) -> P:
    """Split the leading dim over tp (column-parallel projection, per-head vector)."""
    return P(TP, *([None] * (ndim - 1))) if ok else P()


def _heads_rows(field: str):
    """Rows split on head boundaries: legal when the head count divides over tp.

    q_proj's rows are per head ``[query, gate]``, in_proj_qkvz/in_proj_ba rows are
    per key-head group: an even split of the rows is an even split of whole heads
    (groups) exactly when the head (group) count divides.
    """
    return lambda cfg, shape, tp: _rows(getattr(cfg, field) % tp == 0, len(shape))


def _heads_cols(field: str):
    """Row-parallel output projection: its input columns follow the heads' split."""
    return lambda cfg, shape, tp: P(None, TP) if getattr(cfg, field) % tp == 0 else P()


def _vocab(cfg, shape, tp):
    return _rows(cfg.vocab_size % tp == 0, len(shape))


def _ffn_in(cfg, shape, tp):
    """gate/up ``[I, H]`` (or stacked ``[E, I, H]``): inner rows over tp, experts over ep."""
    inner = TP if shape[-2] % tp == 0 else None
    return P(EP, inner, None) if len(shape) == 3 else P(inner, None)


def _ffn_out(cfg, shape, tp):
    """down ``[H, I]`` (or stacked ``[E, H, I]``): inner columns over tp, experts over ep."""
    inner = TP if shape[-1] % tp == 0 else None
    return P(EP, None, inner) if len(shape) == 3 else P(None, inner)


def _replicated(cfg, shape, tp):
    return P()


# The one table. Every tensor name must match exactly one pattern (checked), so a
# tensor kind added to the model cannot silently fall through to some default.
# The Gated DeltaNet conv runs on channels grouped per key head (`gated_deltanet`), so
# its input, output and state split on key-head boundaries with in_proj_qkvz and no
# collective. Its weight stays in the checkpoint's [q | k | v] order, which no even
# split aligns with those groups, so it is replicated (C x K, e.g. 8192 x 4: tiny) and
# each device gathers its own channels of it (`mtp.ops.conv_step.reference.grouped_conv_weight`).
# Replicated, and why:
#  * mtp.fc: its output feeds a norm over the full hidden; splitting it would buy an
#    all-gather per draft for a single [H, 2H] matrix;
#  * the router and shared-expert gate: [E, H] and [1, H], read whole by every token;
#  * norm scales: vectors over the hidden or head dim, which are never split;
#  * conv1d: see above.
_RULES: tuple[tuple[re.Pattern, Callable[[ModelConfig, tuple, int], P]], ...] = tuple(
    (re.compile(pattern), rule) for pattern, rule in (
        (r"^(model\.embed_tokens|lm_head)\.weight$", _vocab),
        (r"self_attn\.q_proj\.weight$", _heads_rows("num_attention_heads")),
        (r"self_attn\.[kv]_proj\.weight$", _heads_rows("num_key_value_heads")),
        (r"self_attn\.o_proj\.weight$", _heads_cols("num_attention_heads")),
        (r"linear_attn\.in_proj_(qkvz|ba)\.weight$", _heads_rows("linear_num_key_heads")),
        # Per value head. Value heads are numbered group-major, so when the key-head
        # groups split these follow them; when only the value heads divide, the
        # replicated projections are sliced locally, which costs nothing.
        (r"linear_attn\.(dt_bias|A_log)$", _heads_rows("linear_num_value_heads")),
        (r"linear_attn\.out_proj\.weight$", _heads_cols("linear_num_value_heads")),
        (r"linear_attn\.conv1d\.weight$", _replicated),
        (r"mlp(\.shared_expert|\.experts)?\.(gate|up)_proj\.weight$", _ffn_in),
        (r"mlp(\.shared_expert|\.experts)?\.down_proj\.weight$", _ffn_out),
        (r"mlp\.(gate|shared_expert_gate)\.weight$", _replicated),
        (r"^mtp\.fc\.weight$", _replicated),
        (r"norm(_\w+)?\.weight$", _replicated),
    )
)


def spec_for(name: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> P:
    """The PartitionSpec of one tensor, by its name (see `_RULES`)."""
    hits = [rule for pattern, rule in _RULES if pattern.search(name)]
    if len(hits) != 1:
        raise ValueError(f"tensor {name!r} matches {len(hits)} sharding rules in mtp.sharding._RULES; "
                         f"it must match exactly one")
    return hits[0](cfg, shape, tp)


def param_specs(cfg: ModelConfig, mesh: Mesh) -> dict[str, P]:
    """Every tensor's PartitionSpec on ``mesh``, flat by tensor name."""
    tp, _ = mesh_sizes(mesh)
    check_expert_split(cfg, mesh)
    return {name: spec_for(name, shape, cfg, tp) for name, shape in param_shapes(cfg).items()}


def param_sharding(cfg: ModelConfig, mesh: Mesh) -> Params:
    """A pytree of `NamedSharding` with the structure of the params on ``mesh``."""
    return unflatten({n: NamedSharding(mesh, s) for n, s in param_specs(cfg, mesh).items()})


def _put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Each device receives only its own slice of the host array."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def block_aligned_spec(spec: P, shape: tuple[int, ...], block: tuple[int, int], axis_sizes) -> P:
    """``spec`` for an FP8 weight of ``shape``: a split of its rows or columns kept where each
    device's part is whole ``block`` s, replicated where it would cut a block.

    A device's part of the values then comes with exactly its blocks' scales, which take the
    same spec (a dim of ``n`` blocks split ``k`` ways: ``n / k`` blocks each). ``axis_sizes``:
    the mesh's ``{axis: size}``.
    """
    parts = list(spec) + [None] * (len(shape) - len(spec))
    blocks = {len(shape) - 2: block[0], len(shape) - 1: block[1]}
    aligned = [None if axis is not None and dim in blocks and (shape[dim] // axis_sizes[axis]) % blocks[dim]
               else axis for dim, axis in enumerate(parts)]
    return P(*aligned)


def _place(value, spec: P, mesh: Mesh):
    """``value`` (host or device array, or an FP8 weight of two) laid out on ``mesh`` by ``spec``."""
    if isinstance(value, BlockFp8Weight):
        sharding = NamedSharding(mesh, block_aligned_spec(spec, value.shape, value.block, dict(mesh.shape)))
        return jax.tree.map(lambda a: _put(np.asarray(jax.device_get(a)), sharding), value)
    if isinstance(value, np.ndarray):
        return _put(value, NamedSharding(mesh, spec))
    return jax.device_put(value, NamedSharding(mesh, spec))


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Lay ``params`` (a checkpoint-named tree, on any devices) out on ``mesh``."""
    flat = flatten(params)
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(flat))
    extra = sorted(set(flat) - set(expected))
    if missing or extra:
        raise ValueError(f"params do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    specs = param_specs(cfg, mesh)
    return unflatten({name: _place(flat[name], specs[name], mesh) for name in specs})


def load_sharded(path: str | os.PathLike, mesh: Mesh, dtype=None, weight_quant: str = "none"
                 ) -> tuple[ModelConfig, Params]:
    """Read a Hugging Face checkpoint straight into its shards on ``mesh``.

    Each tensor goes from the file to its devices slice by slice, so no device ever
    holds more than its own shard (a layer's stacked experts are gathered on the host
    one projection at a time, `hf_layout.Layout.build`, then placed). An FP8 weight (an FP8
    checkpoint's, or ``weight_quant="fp8"`` as in `checkpoint.load_pretrained`) is split where
    each device's part is whole scale blocks, and replicated otherwise (`block_aligned_spec`).
    """
    specs = param_specs(checkpoint.load_config(path), mesh)
    return checkpoint.load_pretrained(path, dtype=dtype, place=lambda name, array: _place(array, specs[name], mesh),
                                      weight_quant=weight_quant)


# ====================================================================== cache layouts
def _kv_spec(cfg: ModelConfig, tp: int) -> P:
    """Pages ``[num_pages, page_size, Hkv, D]`` split on KV heads, else replicated.

    Cache specs name no trailing unsplit dimension, as a jitted call's outputs do: a
    cache made here then has the layout every call hands back, and the first call on
    it compiles nothing that a later one would not reuse."""
    return P(None, None, TP) if cfg.num_key_value_heads % tp == 0 else P()


def _conv_state_spec(cfg: ModelConfig, tp: int) -> P:
    """Conv inputs ``[B, K-1, C]``, grouped per key head: an even split of the channels.

    Where the key heads divide over ``tp`` that is a split on key-head groups, as
    ``in_proj_qkvz``'s. Where they do not, it is still the layout the partitioner gives
    the state the loops hand back (so the cache keeps one layout across calls).
    """
    return P(None, None, TP) if cfg.linear_conv_dim % tp == 0 else P()


def _recurrent_spec(cfg: ModelConfig, tp: int) -> P:
    """Delta-rule state ``[B, Hv, Dk, Dv]`` split on value heads, like dt_bias and A_log."""
    return P(None, TP) if cfg.linear_num_value_heads % tp == 0 else P()


def cache_sharding(cache: TargetCache | DrafterCache, cfg: ModelConfig, mesh: Mesh):
    """A pytree of `NamedSharding` with the structure of ``cache``.

    KV pages follow the KV heads of ``k_proj``/``v_proj``; the Gated DeltaNet
    recurrent state follows its value heads; the conv state follows the key-head
    groups of ``in_proj_qkvz`` (see the note on `_RULES`); block
    tables, lengths and row counters are small and read by every device.
    """
    tp, _ = mesh_sizes(mesh)
    rep = NamedSharding(mesh, P())
    kv = NamedSharding(mesh, _kv_spec(cfg, tp))
    pages = lambda p: PagedKV(k=tuple(kv for _ in p.k), v=tuple(kv for _ in p.v))
    if isinstance(cache, TargetCache):
        rec = NamedSharding(mesh, _recurrent_spec(cfg, tp))
        conv = NamedSharding(mesh, _conv_state_spec(cfg, tp))
        return TargetCache(
            kv=pages(cache.kv),
            linear=LinearState(conv=tuple(conv for _ in cache.linear.conv),
                               recurrent=tuple(rec for _ in cache.linear.recurrent)),
            block_tables=rep, lengths=rep)
    if isinstance(cache, DrafterCache):
        return DrafterCache(kv=pages(cache.kv), block_tables=rep, rows=rep, last_pair_key=rep)
    raise TypeError(f"cache_sharding takes a TargetCache or DrafterCache, got {type(cache).__name__}")


def shard_cache(cache: TargetCache | DrafterCache, cfg: ModelConfig, mesh: Mesh):
    """``cache`` laid out on ``mesh`` (the input is donated, as every cache is)."""
    return jax.device_put(cache, cache_sharding(cache, cfg, mesh), donate=True)


@functools.lru_cache(maxsize=64)
def _sharded_create(cls, cfg: ModelConfig, mesh: Mesh, args: tuple):
    make = lambda: cls.create(cfg, *args)
    return jax.jit(make, out_shardings=cache_sharding(jax.eval_shape(make), cfg, mesh))


def create_cache(cls: type, cfg: ModelConfig, mesh: Mesh | None, *args):
    """``cls.create(cfg, *args)`` made in its shards: no device ever holds the whole cache.

    A page pool sized for a mesh may not fit on one device, so it is created by a
    program whose outputs already have `cache_sharding`'s layout. One program per
    (class, config, mesh, sizes), compiled once. Without a mesh, the plain
    ``cls.create`` on the default device.
    """
    if mesh is None:
        return cls.create(cfg, *args)
    return _sharded_create(cls, cfg, mesh, args)()


def replicated(tree, mesh: Mesh | None):
    """``tree`` (an array or a pytree of them) whole on every device of ``mesh`` (unchanged
    without one): the small state every shard reads, such as block tables or the engine's
    captured hiddens."""
    return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))


def on_mesh(mesh: Mesh | None):
    """``jax.set_mesh(mesh)``, or nothing without one. Traces under it see the mesh, so the
    Pallas kernels run per shard (`mtp.ops.lowering.tensor_parallel_mesh`) instead of on whole arrays."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


__all__ = ["AXES", "EP", "TP", "cache_sharding", "check_expert_split", "create_cache", "load_sharded",
           "make_mesh", "mesh_sizes", "on_mesh", "param_sharding", "param_specs", "replicated", "shard_cache",
           "shard_params", "spec_for"]
