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
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import numpy as np

from mtp.config import ModelConfig
from mtp.model.params import EXPERT_STACK

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
            return np.stack(arrays)
        rows = self.cfg.moe_intermediate_size
        return {"gate_proj": lambda a: a[:, :rows], "up_proj": lambda a: a[:, rows:],
                "down_proj": lambda a: a}[m["proj"]](arrays[0])

    def split(self, name: str, array: np.ndarray) -> dict[str, np.ndarray]:
        """The checkpoint tensors that hold the tree's tensor ``name`` alone (the inverse of `build`);
        a fused gate and up, which share one tensor, are joined by `tree_to_checkpoint`."""
        m = EXPERT_STACK.match(name)
        if m is None:
            return {self._name(name): array}
        parts = self.sources(name)
        if not self.fused_experts:
            return dict(zip(parts, array))
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
                    fused = np.concatenate([halves["gate_proj"], halves["up_proj"]], axis=1)
                    yield self.sources(name)[0], np.ascontiguousarray(fused)
                continue
            for part, value in self.split(name, array).items():
                yield part, np.ascontiguousarray(value)


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

    def build(self, name, arrays):
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        if name.endswith(".in_proj_qkvz.weight"):
            qkv, z = arrays
            cols = qkv.shape[1]
            q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
            groups = (q.reshape(nk, dk, cols), k.reshape(nk, dk, cols), v.reshape(nk, r * dv, cols),
                      z.reshape(nk, r * dv, cols))
            return np.concatenate(groups, axis=1).reshape(-1, cols)
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
            q, k, v, z = np.split(array.reshape(nk, 2 * dk + 2 * r * dv, cols),
                                  [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            flat = lambda x: x.reshape(-1, cols)
            return {parts[0]: np.concatenate([flat(q), flat(k), flat(v)]), parts[1]: flat(z)}
        if name.endswith(".in_proj_ba.weight"):
            parts = self.sources(name)
            b, a = np.split(array.reshape(nk, 2 * r, cols), [r], axis=1)
            return {parts[0]: b.reshape(-1, cols), parts[1]: a.reshape(-1, cols)}
        return super().split(name, array)


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
