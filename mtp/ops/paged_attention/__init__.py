"""Attention over paged KV for decode and verify: ``paged_attention`` (`api`), its pure-JAX definition
(`reference`), the Mosaic GPU kernel (`mosaic`) and the Triton-lowered form with the merge both use
(`triton`)."""

from mtp.ops.paged_attention.api import paged_attention
from mtp.ops.paged_attention.reference import paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference"]
