"""How a checkpoint family lays out the parameter tree's tensors on disk.

The model computes on Qwen3-Next's layout, and a Qwen3-Next checkpoint holds exactly the
tree's tensors (`mtp.model.params`). Qwen3.5 checkpoints (``model_type`` ``qwen3_5_text``,
or the ``qwen3_5`` image-text model around it) hold the same model with two differences:

* The Gated DeltaNet input projections are four tensors, ``in_proj_qkv``, ``in_proj_z``,
  ``in_proj_b`` and ``in_proj_a``, with q, k, v, z, b and a each contiguous over heads.
  Qwen3-Next interleaves them per key-head group into ``in_proj_qkvz`` (q, k, v, z of
  group g) and ``in_proj_ba`` (b, a of group g). The conv, A_log, dt_bias and norm
  tensors are the same in both, since both feed the conv the channels as q | k | v.
* The image-text model nests the text model under ``model.language_model.`` and carries a
  vision tower (``model.visual.``), which this text-only codebase skips.
* A MoE checkpoint may hold each layer's experts per expert (``experts.{e}.gate_proj``, ...,
  as transformers writes them) or fused (``experts.gate_up_proj`` [E, 2 I, H] with gate
  first, ``experts.down_proj`` [E, H, I]), as vLLM's Qwen3.5 loaders read them. Both load;
  saving writes them per expert.

A `Layout` maps between the two: the checkpoint's tensor names and shapes, the tree's
tensors built from the checkpoint's on load, and split back on save. Rows are only
regrouped, never recomputed, so a round trip is exact.

An FP8 checkpoint's ``in_proj_qkv`` and ``in_proj_z`` are regrouped with their block scales
(`mtp.ops.fp8.regroup`): in whole 128-row blocks where the groups' rows come in whole blocks
(Qwen3.5's own head dims, 128 and 2 x 128 rows a key-head group), so ``in_proj_qkvz`` keeps
the checkpoint's blocks; otherwise with one scale row per weight row, still 8-bit and exact.
The model then computes on one FP8 ``in_proj_qkvz``, as it does on a Qwen3-Next checkpoint,
rather than on two projections kept apart, and a save cuts the blocks back exactly.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator, Mapping

import numpy as np

from mtp.config import ModelConfig
from mtp.ops.fp8 import BlockFp8Weight
from mtp.ops.fp8 import regroup as fp8_regroup

VL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
QWEN35_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
_EXPERT = re.compile(r"^(?P<stem>.*\.mlp\.experts\.)(?P<e>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")


class Layout:
    """Qwen3-Next's own layout: the tree's tensors under their own names."""

    skipped_prefixes: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def shapes(self, tree_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensor names and shapes for the tree's ``tree_shapes``."""
        return dict(tree_shapes)

    def sources(self, name: str) -> tuple[str, ...]:
        """The checkpoint tensors the tree's tensor ``name`` is built from."""
        return (name,)

    def build(self, name: str, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        """The tree's tensor ``name`` from its ``sources``, in that order."""
        return arrays[0]

    def split(self, name: str, array: np.ndarray) -> dict[str, np.ndarray]:
        """The checkpoint tensors that hold the tree's tensor ``name`` (the inverse of `build`)."""
        return {name: array}

    def tree_to_checkpoint(self, flat: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        """``(checkpoint name, array)`` of each tensor that holds the tree's ``flat``, as saved."""
        for name, array in flat.items():
            for part, value in self.split(name, array).items():
                yield part, value if isinstance(value, BlockFp8Weight) else np.ascontiguousarray(value)


class Qwen35Layout(Layout):
    """Qwen3.5: separate Gated DeltaNet projections; optionally the image-text model's names."""

    skipped_prefixes = (VISION_PREFIX,)

    def __init__(self, cfg: ModelConfig, prefix: str = "model.", fused_experts: bool = False):
        super().__init__(cfg)
        self.prefix, self.fused_experts = prefix, fused_experts
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.nk, self.r = nk, nv // nk
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def _name(self, name: str) -> str:
        return self.prefix + name[len("model."):] if name.startswith("model.") else name

    def shapes(self, tree_shapes):
        out = {}
        for name, shape in tree_shapes.items():
            out.update(self._part_shapes(name, shape))
        return out

    def _part_shapes(self, name, shape):
        if name.endswith(".in_proj_qkvz.weight"):
            qkv, z = self.sources(name)
            kdim, vdim = self.nk * self.dk, self.nk * self.r * self.dv
            return {qkv: (2 * kdim + vdim, shape[1]), z: (vdim, shape[1])}
        if name.endswith(".in_proj_ba.weight"):
            b, a = self.sources(name)
            return {b: (self.nk * self.r, shape[1]), a: (self.nk * self.r, shape[1])}
        expert = self._fused_expert(name)
        if expert:
            (fused,), e, kind = expert
            rows, cols = shape
            experts = self.cfg.num_experts
            return {} if e else {fused: (experts, 2 * rows, cols) if kind != "down" else (experts, rows, cols)}
        return {self._name(name): shape}

    def _fused_expert(self, name):
        """``(sources, expert, "gate" | "up" | "down")`` of a per-expert tensor read from fused ones, else None."""
        m = _EXPERT.match(name) if self.fused_experts else None
        if m is None:
            return None
        part = "down_proj" if m["kind"] == "down" else "gate_up_proj"
        return (self._name(m["stem"] + part),), int(m["e"]), m["kind"]

    def sources(self, name):
        base = self._name(name)
        if name.endswith(".in_proj_qkvz.weight"):
            stem = base[: -len("in_proj_qkvz.weight")]
            return (stem + "in_proj_qkv.weight", stem + "in_proj_z.weight")
        if name.endswith(".in_proj_ba.weight"):
            stem = base[: -len("in_proj_ba.weight")]
            return (stem + "in_proj_b.weight", stem + "in_proj_a.weight")
        expert = self._fused_expert(name)
        return expert[0] if expert else (base,)

    def _qkvz_rows(self) -> np.ndarray:
        """For each row of ``in_proj_qkvz``, its row in ``concat([in_proj_qkv, in_proj_z])``."""
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        kd, vd = nk * dk, nk * r * dv
        q, k = np.arange(kd).reshape(nk, dk), kd + np.arange(kd).reshape(nk, dk)
        v, z = 2 * kd + np.arange(vd).reshape(nk, r * dv), 2 * kd + vd + np.arange(vd).reshape(nk, r * dv)
        return np.concatenate([q, k, v, z], axis=1).reshape(-1)

    def build(self, name, arrays):
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        if name.endswith(".in_proj_qkvz.weight"):
            return _take_rows(arrays, self._qkvz_rows(), name)
        if name.endswith(".in_proj_ba.weight"):
            b, a = arrays
            cols = b.shape[1]
            return np.concatenate([b.reshape(nk, r, cols), a.reshape(nk, r, cols)], axis=1).reshape(-1, cols)
        expert = self._fused_expert(name)
        if expert:
            _, e, kind = expert
            rows = self.cfg.moe_intermediate_size
            return arrays[0][e] if kind == "down" else arrays[0][e, :rows] if kind == "gate" else arrays[0][e, rows:]
        return arrays[0]

    def split(self, name, array):
        if self.fused_experts:
            raise ValueError("checkpoints are saved with their experts one by one")
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        parts = self.sources(name)
        cols = array.shape[-1]
        if name.endswith(".in_proj_qkvz.weight"):
            source_rows = np.argsort(self._qkvz_rows())  # each checkpoint row's row in the tree's tensor
            qkv_rows = 2 * nk * dk + nk * r * dv
            return {parts[0]: _take_rows((array,), source_rows[:qkv_rows], name),
                    parts[1]: _take_rows((array,), source_rows[qkv_rows:], name)}
        if name.endswith(".in_proj_ba.weight"):
            b, a = np.split(array.reshape(nk, 2 * r, cols), [r], axis=1)
            return {parts[0]: b.reshape(-1, cols), parts[1]: a.reshape(-1, cols)}
        return {parts[0]: array}


def _take_rows(arrays, rows: np.ndarray, name: str):
    """Rows ``rows`` of the arrays stacked along their rows: plain arrays, or FP8 weights with their scales."""
    if all(isinstance(a, BlockFp8Weight) for a in arrays):
        return fp8_regroup.take_rows(fp8_regroup.concat_rows(list(arrays)), rows)
    if any(isinstance(a, BlockFp8Weight) for a in arrays):
        raise ValueError(f"{name}: its checkpoint tensors must be all FP8 or all not, got "
                         f"{[type(a).__name__ for a in arrays]}")
    return np.concatenate(arrays)[rows]


def layout_of(cfg: ModelConfig, checkpoint_names: Iterator[str] | None = None) -> Layout:
    """The layout of ``cfg``'s family; for Qwen3.5, the image-text names if the checkpoint uses them."""
    if cfg.model_type not in QWEN35_TYPES:
        return Layout(cfg)
    names = list(checkpoint_names or ())
    nested = any(n.startswith(VL_PREFIX) for n in names)
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    return Qwen35Layout(cfg, VL_PREFIX if nested else "model.", fused)


def read_tree(layout: Layout, tree_names, read: Callable[[str], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of each of the tree's ``tree_names``, built from checkpoint tensors ``read(name)``.

    The two checkpoint tensors read last are kept: a layer's fused experts serve every expert's
    gate, up and down in turn, and are read once, not once per expert.
    """
    recent: dict[str, np.ndarray] = {}

    def cached(part: str) -> np.ndarray:
        if part not in recent:
            recent[part] = read(part)
            if len(recent) > 2:
                del recent[next(iter(recent))]
        return recent[part]

    for name in tree_names:
        yield name, layout.build(name, tuple(cached(part) for part in layout.sources(name)))
