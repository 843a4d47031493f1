"""The model with its Pallas kernels switched on: still lossless, still the model.

On a GPU the compiled Mosaic GPU kernels run; on a CPU the same kernel code runs
through Pallas' GPU interpreter, switched on around the whole jitted program. The
shipped checkpoint is used in its own bf16, the dtype the kernels take, so the
decode and verify attention of the target and the drafter go through the paged
attention kernel (prefill chunks are wider than the kernel's 64 query rows and
take the reference, as on a GPU) and the drafter's input projection through the
fc GEMM kernel.
"""

import contextlib
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtp.cache.state import TargetCache
from mtp.checkpoint import load_pretrained
from mtp.data.sessions import Session, Turn
from mtp.serving import Engine, EngineConfig, run_sessions
from mtp.execution import ExecutionConfig
from mtp.generation import generate
from mtp.model import target
from mtp.ops.paged_attention.mosaic import kernel_unsupported
from mtp.speculative import SpecConfig
from tests.conftest import IdPrompts

CKPT = pathlib.Path(__file__).resolve().parents[1] / "assets" / "default_model"
PROMPTS = [[5, 17, 300, 42, 7, 99, 1000, 12, 13, 8, 77], [8, 9, 10, 400]]


def kernels_on():
    """Compiled kernels on a GPU, the Pallas GPU interpreter elsewhere."""
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())


@pytest.fixture(scope="module")
def shipped():
    cfg, params = load_pretrained(CKPT)
    assert jax.tree.leaves(params)[0].dtype == jnp.bfloat16
    return cfg, params


def test_decode_shapes_are_the_kernels(shipped):
    """Guards the premise of this file: the kernel, not its fallback, serves decode and verify."""
    cfg, _ = shipped
    pages = jnp.zeros((4, 16, cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16)
    for q_len in (1, 4, 8):
        q = jnp.zeros((2, q_len, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)
        assert kernel_unsupported(q, pages) is None


def test_speculative_with_kernels_equals_plain_greedy_with_kernels(shipped):
    """Plain steps at the verify's width: on a GPU, bf16 GEMMs of other shapes may round
    differently (`SpecConfig.plain_width`), which is numerics, not a lossless-ness bug."""
    cfg, params = shipped
    spec = SpecConfig(verify_width=3, max_new_tokens=12, execution=ExecutionConfig.everywhere("pallas"), plain_width=3)
    with kernels_on():
        fast = generate(cfg, params, PROMPTS, spec, speculative=True)
        plain = generate(cfg, params, PROMPTS, spec, speculative=False)
    assert fast.tokens == plain.tokens
    assert fast.stats.accepted > 0  # drafts were accepted, so the drafter path ran too


def test_kernel_logits_match_the_reference(shipped):
    """One verify step over cached ragged prompts, kernels vs references: bf16-close logits.

    (Tokens are not compared across implementations: different kernels may round a
    near-tie differently, and that is numerics, not a defect.)"""
    cfg, params = shipped
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 40)), jnp.int32)
    logits = {}
    for impl in ("reference", "pallas"):
        cache = TargetCache.create(cfg, 2, 16, 16, 4, jnp.bfloat16)
        cache = cache.replace(block_tables=jnp.arange(1, 9, dtype=jnp.int32).reshape(2, 4))
        cache, _ = target.prefill(cfg, params, cache, tokens[:, :36], jnp.zeros(2, jnp.int32),
                                  jnp.asarray([36, 30], jnp.int32), execution=ExecutionConfig.everywhere("reference"))
        with kernels_on() if impl == "pallas" else contextlib.nullcontext():
            _, vout = target.verify(cfg, params, cache, tokens[:, 36:], execution=ExecutionConfig.everywhere(impl))
        logits[impl] = np.asarray(vout.logits, np.float32)
    ref, got = logits["reference"], logits["pallas"]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


def test_carry_engine_with_kernels_is_lossless(shipped):
    """Two turns of one session through the engine's carry policy, kernels on."""
    cfg, params = shipped
    rng = np.random.default_rng(4)
    sessions = [Session("k0", "synthetic", tuple(
        Turn(" ".join(map(str, rng.integers(1, cfg.vocab_size, 9))), 8) for _ in range(2)))]
    prompts = IdPrompts(rng.integers(1, cfg.vocab_size, 40).tolist())
    ecfg = EngineConfig(policy="carry", max_context=256, num_pages=64, drafter_pages=64,
                        marconi_min_tokens=64, execution=ExecutionConfig.everywhere("pallas"))
    spec = SpecConfig(verify_width=3, max_new_tokens=8, plain_width=3)
    plain_cfg = dataclasses.replace(ecfg, policy="cold", speculative=False)
    with kernels_on():
        fast = run_sessions(Engine(cfg, params, ecfg, spec), sessions, prompts)
        plain = run_sessions(Engine(cfg, params, plain_cfg, spec), sessions, prompts)
    assert [r.output for r in fast] == [r.output for r in plain]


def test_speculative_with_the_triton_attention_equals_plain(shipped, monkeypatch):
    """The Triton-lowered paged attention (opt-in: a config entry of its own) in both loops: still lossless."""
    from mtp.ops.paged_attention import triton

    calls = []
    run = triton.paged_attention_triton
    monkeypatch.setattr(triton, "paged_attention_triton", lambda *a, **k: calls.append(1) or run(*a, **k))
    choice = "pallas" if jax.default_backend() == "gpu" else "interpret"
    cfg, params = shipped
    spec = SpecConfig(verify_width=3, max_new_tokens=12, plain_width=3,
                      execution=ExecutionConfig().with_kernels(paged_attention_triton=choice))
    fast = generate(cfg, params, PROMPTS, spec, speculative=True)
    plain = generate(cfg, params, PROMPTS, spec, speculative=False)
    assert calls, "the Triton form never ran"
    assert fast.tokens == plain.tokens
    assert fast.stats.accepted > 0


def test_speculative_with_the_fc_kernel_as_loaded_equals_plain(shipped, monkeypatch):
    """The fc kernel as a GPU load sets it up (`prepare_params` folds the weight and makes the
    per-token embed mean squares, so the embed rows arrive normalised): still lossless, and the
    normalised form is the one that ran."""
    from mtp.ops.fc_gemm import mosaic

    normed = []
    run = mosaic.fc_gemm_folded
    monkeypatch.setattr(mosaic, "fc_gemm_folded",
                        lambda *a, **k: normed.append(k.get("embed_normed")) or run(*a, **k))
    cfg, params = shipped
    spec = SpecConfig(verify_width=3, max_new_tokens=12, plain_width=3,
                      execution=ExecutionConfig().with_kernels(fc_gemm="interpret"))
    fast = generate(cfg, params, PROMPTS, spec, speculative=True)
    plain = generate(cfg, params, PROMPTS, spec, speculative=False)
    ref_spec = dataclasses.replace(spec, execution=ExecutionConfig().with_kernels(fc_gemm="reference"))
    ref = generate(cfg, params, PROMPTS, ref_spec, speculative=True)  # the drafter through the reference fc
    assert normed and all(normed), normed
    assert fast.tokens == plain.tokens
    # Lossless whatever the drafter computes; its acceptance tells that it drafted as the reference does.
    assert fast.stats.accepted > 0 and fast.stats.accepted == ref.stats.accepted
