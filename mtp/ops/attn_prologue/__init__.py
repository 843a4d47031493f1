"""A gated-attention layer's work between its q/k/v GEMM and attention as one kernel: ``attn_prologue``
(`api`), its pure-JAX definition with the layer's norms, RoPE and gate split (`reference`), the kernel
(`triton`)."""

from mtp.ops.attn_prologue.api import attn_prologue
from mtp.ops.attn_prologue.reference import AttentionShape, attn_prologue_reference

__all__ = ["AttentionShape", "attn_prologue", "attn_prologue_reference"]
