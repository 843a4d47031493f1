"""The hybrid target model (Gated DeltaNet + gated attention)."""

from mtp.model.params import init_params, param_shapes
from mtp.model.target import (StepOutput, VerifyOutput, commit, decode, forward,
                              forward_with_hiddens, prefill, verify)

__all__ = ["init_params", "param_shapes", "StepOutput", "VerifyOutput", "commit", "decode",
           "forward", "forward_with_hiddens", "prefill", "verify"]
