"""The Gated DeltaNet layer's decode and verify tokens after its conv as one kernel: ``gdn_steps``
(`api`), its pure-JAX definition and the layer's per-token math (`reference`), the kernel (`triton`)."""

from mtp.ops.gdn_step.api import gdn_step, gdn_steps
from mtp.ops.gdn_step.reference import HeadShape, gdn_step_reference, gdn_steps_reference
from mtp.ops.gdn_step.triton import MAX_STEPS

__all__ = ["MAX_STEPS", "HeadShape", "gdn_step", "gdn_step_reference", "gdn_steps", "gdn_steps_reference"]
