"""The routed-expert FFN of a MoE layer: ``routed_experts`` (`api`), its sparse pure-JAX
reference (`reference`)."""

from mtp.ops.moe.api import routed_experts
from mtp.ops.moe.reference import SharedExpert

__all__ = ["SharedExpert", "routed_experts"]
