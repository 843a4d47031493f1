"""The residual add and the norm after it as one kernel: ``add_rms_norm`` (`api`), its pure-JAX
definition and the model's ``add_rows`` (`reference`), the kernel (`triton`)."""

from mtp.ops.add_rms_norm.api import add_rms_norm
from mtp.ops.add_rms_norm.reference import add_rms_norm_reference, add_rows

__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rows"]
