"""The routed-expert FFN of a MoE layer: ``routed_experts`` (`api`), its sparse pure-JAX
reference (`reference`)."""

from mtp.ops.moe.api import routed_experts

__all__ = ["routed_experts"]
