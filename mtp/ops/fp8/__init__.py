"""Block-scaled FP8 weights (Qwen's ``fp8`` checkpoints): the weight type, quantize / dequantize,
and the w8a16 / w8a8 matmul (`api.matmul`, with its pure-JAX reference in `reference`)."""

from mtp.ops.fp8.api import matmul
from mtp.ops.fp8.reference import (BLOCK, E4M3_MAX, BlockFp8Weight, dequantize, expand_scales,
                                   quantize, quantize_activations, scale_shape)

__all__ = ["BLOCK", "E4M3_MAX", "BlockFp8Weight", "dequantize", "expand_scales", "matmul", "quantize",
           "quantize_activations", "scale_shape"]
