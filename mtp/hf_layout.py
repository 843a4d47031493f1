"""How a checkpoint lays out the parameter tree's tensors on disk.

The model computes on Qwen3-Next's layout (`mtp.model.params`), and a Qwen3-Next
checkpoint holds the tree's tensors under their own names but for the routed experts:

* A MoE checkpoint holds each layer's experts per expert (``experts.{e}.gate_proj.weight``,
  ..., as transformers writes them) or fused (``experts.gate_up_proj`` [E, 2 I, H] with gate
  first, ``experts.down_proj`` [E, H, I], as vLLM's Qwen3.5 loaders read them). The tree
  stacks them (``experts.gate_proj.weight`` [E, I, H], ``experts.up_proj.weight`` [E, I, H],
  ``experts.down_proj.weight`` [E, H, I]). Both load in either family; saving writes them per
  expert unless asked for the fused form (``save_pretrained(..., fused_experts=True)``).

Qwen3.5 checkpoints (``model_type`` ``qwen3_5_text``, or the ``qwen3_5`` image-text model
around it) hold the same model with two more differences:

* The Gated DeltaNet input projections are four tensors, ``in_proj_qkv``, ``in_proj_z``,
  ``in_proj_b`` and ``in_proj_a``, with q, k, v, z, b and a each contiguous over heads.
  Qwen3-Next interleaves them per key-head group into ``in_proj_qkvz`` (q, k, v, z of
  group g) and ``in_proj_ba`` (b, a of group g). The conv, A_log, dt_bias and norm
  tensors are the same in both, since both feed the conv the channels as q | k | v.
* The image-text model nests the text model under ``model.language_model.`` and carries a
  vision tower (``model.visual.``), which this text-only codebase skips.

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

from typing import Callable, Iterator, Mapping

import numpy as np

from mtp.config import ModelConfig
from mtp.model.params import EXPERT_STACK
from mtp.ops.fp8 import BlockFp8Weight
from mtp.ops.fp8 import regroup as fp8_regroup

VL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
QWEN35_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"


def stores_fused_experts(checkpoint_names) -> bool:
    """Whether a checkpoint with these tensor names stores its experts fused per layer."""
    return any(n.endswith(".mlp.experts." + FUSED_GATE_UP) for n in checkpoint_names)


class Layout:
    """Qwen3-Next's own layout: the tree's tensors under their own names, experts per expert or fused."""

    skipped_prefixes: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, fused_experts: bool = False):
        self.cfg, self.fused_experts = cfg, fused_experts

    def _name(self, name: str) -> str:
        """The checkpoint's name of a tree tensor it stores as it is."""
        return name

    def shapes(self, tree_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensor names and shapes for the tree's ``tree_shapes``."""
        out = {}
        for name, shape in tree_shapes.items():
            out.update(self._part_shapes(name, shape))
        return out

    def _part_shapes(self, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        m = EXPERT_STACK.match(name)
        if m is None:
            return {self._name(name): shape}
        experts, rows, cols = shape
        if not self.fused_experts:
            return {part: (rows, cols) for part in self.sources(name)}
        if m["proj"] == "up_proj":
            return {}  # the gate's fused tensor holds it
        (fused,) = self.sources(name)
        return {fused: (experts, 2 * rows, cols) if m["proj"] == "gate_proj" else shape}

    def sources(self, name: str) -> tuple[str, ...]:
        """The checkpoint tensors the tree's tensor ``name`` is built from."""
        m = EXPERT_STACK.match(name)
        if m is None:
            return (self._name(name),)
        stem = self._name(m["stem"])
        if self.fused_experts:
            return (stem + (FUSED_DOWN if m["proj"] == "down_proj" else FUSED_GATE_UP),)
        return tuple(f"{stem}{e}.{m['proj']}.weight" for e in range(self.cfg.num_experts))

    def build(self, name: str, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        """The tree's tensor ``name`` from its ``sources``, in that order.

        Per-expert tensors are stacked here, one projection of one layer at a time, so a
        load holds at most that projection twice (its parts and the stack) beside what it
        has already placed.
        """
        m = EXPERT_STACK.match(name)
        if m is None:
            return arrays[0]
        if not self.fused_experts:
            return _stack(arrays)
        rows = self.cfg.moe_intermediate_size
        gate_up = {"gate_proj": np.arange(rows), "up_proj": np.arange(rows, 2 * rows)}.get(m["proj"])
        return arrays[0] if gate_up is None else _take_rows(arrays, gate_up, name)

    def split(self, name: str, array: np.ndarray) -> dict[str, np.ndarray]:
        """The checkpoint tensors that hold the tree's tensor ``name`` alone (the inverse of `build`);
        a fused gate and up, which share one tensor, are joined by `tree_to_checkpoint`."""
        m = EXPERT_STACK.match(name)
        if m is None:
            return {self._name(name): array}
        parts = self.sources(name)
        if not self.fused_experts:
            return dict(zip(parts, _unstack(array)))
        if m["proj"] != "down_proj":
            raise ValueError(f"{name}: a fused gate_up_proj holds the gate and the up stack; "
                             f"tree_to_checkpoint joins them")
        return {parts[0]: array}

    def tree_to_checkpoint(self, flat: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        """``(checkpoint name, array)`` of each tensor that holds the tree's ``flat``, as saved."""
        pending: dict[str, dict[str, np.ndarray]] = {}
        for name, array in flat.items():
            m = EXPERT_STACK.match(name)
            if self.fused_experts and m is not None and m["proj"] != "down_proj":
                halves = pending.setdefault(m["stem"], {})
                halves[m["proj"]] = array
                if len(halves) == 2:  # gate first, as the fused tensor holds them
                    del pending[m["stem"]]
                    gate, up = halves["gate_proj"], halves["up_proj"]
                    fused = _take_rows((gate, up), np.arange(gate.shape[-2] + up.shape[-2]), name)
                    yield self.sources(name)[0], _contiguous(fused)
                continue
            for part, value in self.split(name, array).items():
                yield part, _contiguous(value)


class Qwen35Layout(Layout):
    """Qwen3.5: separate Gated DeltaNet projections; optionally the image-text model's names."""

    skipped_prefixes = (VISION_PREFIX,)

    def __init__(self, cfg: ModelConfig, prefix: str = "model.", fused_experts: bool = False):
        super().__init__(cfg, fused_experts)
        self.prefix = prefix
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.nk, self.r = nk, nv // nk
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def _name(self, name: str) -> str:
        return self.prefix + name[len("model."):] if name.startswith("model.") else name

    def _part_shapes(self, name, shape):
        if name.endswith(".in_proj_qkvz.weight"):
            qkv, z = self.sources(name)
            kdim, vdim = self.nk * self.dk, self.nk * self.r * self.dv
            return {qkv: (2 * kdim + vdim, shape[1]), z: (vdim, shape[1])}
        if name.endswith(".in_proj_ba.weight"):
            b, a = self.sources(name)
            return {b: (self.nk * self.r, shape[1]), a: (self.nk * self.r, shape[1])}
        return super()._part_shapes(name, shape)

    def sources(self, name):
        base = self._name(name)
        if name.endswith(".in_proj_qkvz.weight"):
            stem = base[: -len("in_proj_qkvz.weight")]
            return (stem + "in_proj_qkv.weight", stem + "in_proj_z.weight")
        if name.endswith(".in_proj_ba.weight"):
            stem = base[: -len("in_proj_ba.weight")]
            return (stem + "in_proj_b.weight", stem + "in_proj_a.weight")
        return super().sources(name)

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
        return super().build(name, arrays)

    def split(self, name, array):
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        cols = array.shape[-1]
        if name.endswith(".in_proj_qkvz.weight"):
            parts = self.sources(name)
            source_rows = np.argsort(self._qkvz_rows())  # each checkpoint row's row in the tree's tensor
            qkv_rows = 2 * nk * dk + nk * r * dv
            return {parts[0]: _take_rows((array,), source_rows[:qkv_rows], name),
                    parts[1]: _take_rows((array,), source_rows[qkv_rows:], name)}
        if name.endswith(".in_proj_ba.weight"):
            parts = self.sources(name)
            b, a = np.split(array.reshape(nk, 2 * r, cols), [r], axis=1)
            return {parts[0]: b.reshape(-1, cols), parts[1]: a.reshape(-1, cols)}
        return super().split(name, array)


# Plain arrays and FP8 weights (`mtp.ops.fp8.regroup`, which moves each row's scale with it) alike:
def _take_rows(arrays, rows: np.ndarray, name: str):
    """Rows ``rows`` (second-to-last axis) of the arrays joined along their rows."""
    if all(isinstance(a, BlockFp8Weight) for a in arrays):
        return fp8_regroup.take_rows(fp8_regroup.concat_rows(list(arrays)), rows)
    if any(isinstance(a, BlockFp8Weight) for a in arrays):
        raise ValueError(f"{name}: its checkpoint tensors must be all FP8 or all not, got "
                         f"{[type(a).__name__ for a in arrays]}")
    return np.concatenate(arrays, axis=-2)[..., rows, :]


def _stack(arrays):
    """Per-expert tensors as one ``[E, ...]`` stack."""
    return fp8_regroup.stack(arrays) if isinstance(arrays[0], BlockFp8Weight) else np.stack(arrays)


def _unstack(array):
    """A ``[E, ...]`` stack's experts, one by one."""
    return fp8_regroup.unstack(array) if isinstance(array, BlockFp8Weight) else list(array)


def _contiguous(value):
    return value if isinstance(value, BlockFp8Weight) else np.ascontiguousarray(value)


def layout_of(cfg: ModelConfig, checkpoint_names: Iterator[str] | None = None,
              fused_experts: bool = False) -> Layout:
    """The layout of ``cfg``'s family and of a checkpoint with ``checkpoint_names``: fused experts
    if it stores them so (or ``fused_experts``); for Qwen3.5, the image-text names if it uses them."""
    names = list(checkpoint_names or ())
    fused = fused_experts or stores_fused_experts(names)
    if cfg.model_type not in QWEN35_TYPES:
        return Layout(cfg, fused)
    nested = any(n.startswith(VL_PREFIX) for n in names)
    return Qwen35Layout(cfg, VL_PREFIX if nested else "model.", fused)


def read_tree(layout: Layout, tree_names, read: Callable[[str], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of each of the tree's ``tree_names``, built from checkpoint tensors ``read(name)``.

    The two checkpoint tensors read last are kept: a layer's fused ``gate_up_proj`` serves its
    gate and its up stack in turn, and is read once.
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
