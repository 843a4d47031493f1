"""The MTP drafter's input projection as one op: ``fc_gemm`` (`api`), its pure-JAX definition and the
kernel path's load-time inputs (`reference`), the Mosaic GPU kernels and their tile plans (`mosaic`)."""

from mtp.ops.fc_gemm.api import fc_gemm
from mtp.ops.fc_gemm.reference import fc_gemm_reference, fold_fc_weight, normed_embed_rows, row_mean_squares

__all__ = ["fc_gemm", "fc_gemm_reference", "fold_fc_weight", "normed_embed_rows", "row_mean_squares"]
