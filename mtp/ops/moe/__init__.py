"""The MoE FFN: ``moe_ffn`` from the router's logits and ``routed_experts`` from chosen experts (`api`),
their sparse pure-JAX reference (`reference`), the grouped GEMMs of many tokens (`mosaic`) and the
weight-streaming kernels of a decode or verify step (`triton`)."""

from mtp.ops.moe.api import moe_ffn, routed_experts
from mtp.ops.moe.reference import RouterLogits, SharedExpert

__all__ = ["RouterLogits", "SharedExpert", "moe_ffn", "routed_experts"]
