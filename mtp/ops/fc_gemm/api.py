"""``fc_gemm``: the MTP drafter's input projection (both RMSNorms, the concat, the fc GEMM), reference or kernel.

`mtp.ops.dispatch.choose` picks the path under the op name ``"fc_gemm"``: the Mosaic GPU
kernels (`mosaic`) on a GPU where they pay (``kernel_pays``) and take the inputs, the
pure-JAX definition (`reference`) elsewhere.
"""

from __future__ import annotations

import jax

from mtp.ops import dispatch
from mtp.ops.fc_gemm import mosaic
from mtp.ops.fc_gemm.reference import check_inputs, fc_gemm_reference, fold_fc_weight, normed_embed_rows
from mtp.ops.lowering import mosaic_interpret_scope


def kernel_pays(m: int, h: int) -> bool:
    """Where ``impl="auto"`` (no path named for the op: ``ExecutionConfig.impl_for``) takes the kernel on a GPU
    (results/kernels/).

    What decides is the fc op where the model runs it, a drafter append
    (``append_rows`` of the 1.38B-shaped model, CUPTI kernel time of the whole call, L2
    evicted): with the kernel it ran 1.08-1.46x faster at every bucket and batch measured,
    64-512 rows a sequence at batch 1, 2 and 4, M = 64..2048 (2026-11-30 20:55-21:47 UTC;
    512 rows at batch 1-4 1.08-1.15x earlier that day too). The op alone is not always faster
    there: against XLA's norm + concat + dot it is 1.03-1.35x at M = 64-128 (split-K) and from
    M = 512 (2026-11-29 and 2026-11-30), but 0.88-0.94x at M = 256 (2026-11-30), where the
    append still ran 1.39-1.41x faster: XLA's fc costs more inside the append than alone. At M <= 32 the op alone is
    1.13-1.25x (2026-11-30, L2 cold) but in the 1.38B model's propose step the kernel was not faster
    (0.302 vs 0.297 ms per draft, 2026-11-30; results/decode/decode_h200.md), so the propose step
    keeps the reference. Every measurement was at H = 2048 or 4096; a narrower model (the
    shipped default, H = 384) keeps the reference, unmeasured. Above ``small_m`` rows the
    kernel needs M to be a multiple of 8 (`mosaic.kernel_unsupported`; appends are multiples of 64).
    """
    return m >= 64 and h >= 2048



def fc_gemm(embed, hidden, norm_e_w, norm_h_w, w, *, eps, impl="auto", w_folded=None,
            embed_mean_square=None):
    """``concat(norm_e(embed), norm_h(hidden)) @ w.T`` -> [M, H] in embed's dtype.

    embed, hidden: [M, H]; norm_e_w, norm_h_w: [H] Qwen3-Next ``(1 + w)`` RMSNorm
    weights; w: [H, 2H] in the Hugging Face Linear layout, embedding columns first.
    f32 accumulation. ``impl`` picks the path (`mtp.ops.dispatch.choose`); the
    reference path is the Hugging Face numerics exactly. The kernel path needs the
    folded weight: pass ``w_folded = fold_fc_weight(norm_e_w, norm_h_w, w)`` made once
    at load; without it the kernel path folds here, per call (one more read and
    write of ``w``). ``"interpret"`` must be called eagerly, as interpret mode is
    switched on around this call's own lowering. Inputs the kernels cannot take
    (`mosaic.kernel_unsupported`) go to the reference whatever ``impl`` says, and so do those
    where the kernel does not pay (``kernel_pays``, for ``impl="auto"``).
    ``embed_mean_square``: [M] f32, each embed row's mean square known ahead (gathered from
    ``row_mean_squares`` of the embedding table): the kernel path then normalises the embed
    rows elementwise, which in the model fuses into the embedding gather, and its large-M
    pre-pass reads the hidden half alone. The reference computes every norm itself.
    """
    check_inputs(embed, hidden, norm_e_w, norm_h_w, w)
    if embed_mean_square is not None and embed_mean_square.shape != embed.shape[:1]:
        raise ValueError(f"embed_mean_square must be [M={embed.shape[0]}] (one per embed row); "
                         f"got {embed_mean_square.shape}")
    mode = dispatch.choose("fc_gemm", impl, lambda: mosaic.kernel_unsupported(embed, hidden, w),
                           lambda: kernel_pays(*embed.shape), mesh_kernel=True)
    if mode == "reference":
        return _reference_jit(embed, hidden, norm_e_w, norm_h_w, w, eps=eps)
    if w_folded is None:
        w_folded = fold_fc_weight(norm_e_w, norm_h_w, w)
    normed = embed_mean_square is not None
    if normed:
        embed = normed_embed_rows(embed, embed_mean_square, eps)
    # Pallas' GPU interpreter cannot store to an accumulator: the two-accumulator form then.
    with mosaic_interpret_scope(mode) as interpreted:
        return mosaic.fc_gemm_folded(embed, hidden, w_folded, eps=eps, embed_normed=normed,
                                     acc="two" if interpreted else "rescale")


_reference_jit = jax.jit(fc_gemm_reference, static_argnames=("eps", "impl"))
