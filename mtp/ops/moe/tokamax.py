"""The routed-expert FFN through ``tokamax.ragged_dot`` (Mosaic GPU grouped GEMMs), an optional backend.

tokamax is not a dependency of the project (``pip install .[tokamax]`` adds it):
``available()`` says why it cannot be used here (not installed, or it fails to import), and
nothing but this module and ``experiments/bench_moe.py`` imports it. The api does not try it.

How it computes the reference's ``routed_experts``: the ``P = N k`` pairs sorted by expert
(``x`` gathered in that order, rows padded to a multiple of 8, which tokamax's Mosaic GPU
kernel requires), one ragged dot for gate and up together against ``[E, H, 2I]``, the
activation in XLA, one ragged dot against ``[E, I, H]``, and the weighted combine in
f32. tokamax's kernel contracts the weight's middle axis; given the Hugging Face
``[E, I, H]`` orientation it transposes the whole weight on every call, so its layout
is made once, at load (``tokamax_layout``), and passed in.

Why optional (2026-12-02, one H200, Qwen3-Next's shape, CUPTI device time of the whole op;
results/kernels/moe_kernels_h200.md): against the project's kernels (``mtp.ops.moe.mosaic``) it is
slower at decode sizes (77 / 140 / 443 us against 43 / 95 / 414 at 1 / 4 / 32 tokens) and
faster only for prefill chunks (829 / 1022 us against 964 / 1086 at 256 / 2048 tokens; 1203
against 1224 with a skewed routing). Its two grouped GEMMs stream as fast as ours there
(549 + 298 us against 559 + 291 at 2048 tokens); what it saves is in the gather around them.
That gain needs its own weight layout: a second copy of every expert (3.2 GB a layer at this
shape) beside the one the decode kernels read, or a transpose per call (a full read and write
of the weights, ~1.6 ms). It also imports ``xprof`` (32 MB) at import time and brings
pydantic and qwix.

Qwen's block-scaled FP8 experts are not an operand its Hopper path takes (its source, read
2026-12-06, `tokamax/_src/ops/ragged_dot/pallas_mosaic_gpu_kernel_sm90_quant*.py`): the sm90
quantized kernels read a ``qwix.QArray`` of integer values (int8 / int4, upcast in registers)
with one scale per output column and ``block_k`` inputs, and its FP8 kernel is for sm100. Taking
the checkpoint's E4M3 values would mean re-quantizing them to integers, which changes the weights;
so FP8 experts run the project's own grouped GEMMs that read the E4M3 values (`triton_grouped`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.cache
def available() -> str | None:
    """None when tokamax imports, else why not (the import's error)."""
    try:
        import tokamax  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return f"tokamax does not import: {type(e).__name__}: {e}"
    return None


def tokamax_layout(gate, up, down):
    """``(gate_up [E, H, 2I], down_t [E, I, H])``: the weights as tokamax's kernel reads them."""
    return jnp.concatenate([gate, up], axis=1).mT, down.mT


def _ragged_dot(lhs, rhs, group_sizes, dtype, implementation):
    import tokamax

    return tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=dtype,
                              implementation=implementation)


@functools.partial(jax.jit, static_argnames=("implementation",))
def routed_experts_tokamax(x, expert_ids, expert_weights, gate_up, down_t, *, implementation="mosaic"):
    """f32 ``[N, H]``: the reference's routed experts, given ``tokamax_layout``'s weights.

    ``implementation``: tokamax's backend, ``"mosaic"`` (its Mosaic GPU kernel) by default;
    ``"xla"`` runs anywhere (XLA's ``ragged_dot``).
    """
    n, k = expert_ids.shape
    e, h, two_i = gate_up.shape
    p = n * k
    rows = -(-p // 8) * 8
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    xs = jnp.zeros((rows, h), x.dtype).at[:p].set(x[order // k])
    gu = _ragged_dot(xs, gate_up, group_sizes, x.dtype, implementation).astype(jnp.float32)
    g, u = gu[:, :two_i // 2], gu[:, two_i // 2:]
    act = jax.nn.silu(g).astype(x.dtype).astype(jnp.float32)
    hs = (act * u).astype(x.dtype)
    ys = _ragged_dot(hs, down_t, group_sizes, x.dtype, implementation)[:p]
    inverse = jnp.zeros((p,), jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
    picked = ys[inverse].astype(jnp.float32).reshape(n, k, h)
    return jnp.einsum("nk,nkh->nh", expert_weights.astype(jnp.float32), picked)
