"""The Gated DeltaNet conv of decode and verify tokens, with the state after each, as one kernel:
``conv_steps`` (`api`), its pure-JAX definition and the layer's conv (`reference`), the kernel (`triton`)."""

from mtp.ops.conv_step.api import conv_steps
from mtp.ops.conv_step.reference import conv_steps_reference

__all__ = ["conv_steps", "conv_steps_reference"]
