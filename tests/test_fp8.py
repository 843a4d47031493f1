"""Block-scaled FP8 weights: the op, the model on FP8 weights, and Qwen's FP8 checkpoint layout."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtp.ops import fp8


def _numpy_dequantize(values, scale, block):
    rows, cols = values.shape[-2:]
    s = np.repeat(np.repeat(np.asarray(scale, np.float32), block[0], -2)[..., :rows, :], block[1], -1)[..., :cols]
    return np.asarray(values).astype(np.float32) * s


# ====================================================================== the op
@pytest.mark.parametrize("shape, block", [((200, 300), (128, 128)), ((3, 130, 129), (128, 128)),
                                          ((40, 20), (16, 8))])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_quantize_is_the_checkpoints_recipe_with_partial_edge_blocks(shape, block, scale_dtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.1, 10.0, size=shape[:-2] + (shape[-2], 1))
    w[..., :block[0], :block[1]] = 0.0  # an all-zero block keeps a finite scale and exact zeros
    q = fp8.quantize(w, block, scale_dtype)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale_inv.dtype == jnp.float32
    assert q.scale_inv.shape == fp8.scale_shape(shape, block) == (*shape[:-2], -(-shape[-2] // block[0]),
                                                                 -(-shape[-1] // block[1]))
    # The scale of each block is its amax / 448 (rounded to the stored dtype), computed here in numpy.
    nbr, nbc = q.scale_inv.shape[-2:]
    padded = np.zeros((*shape[:-2], nbr * block[0], nbc * block[1]), np.float32)
    padded[..., :shape[-2], :shape[-1]] = w
    amax = np.abs(padded.reshape(*shape[:-2], nbr, block[0], nbc, block[1])).max(axis=(-3, -1))
    scale = np.asarray(q.scale_inv)
    stored = ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else np.float32
    np.testing.assert_array_equal(scale.astype(stored).astype(np.float32), scale)  # a save stores it exactly
    # XLA may divide by 448 as a multiply by its reciprocal: one f32 ulp, before the rounding to bf16.
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 448.0, 1.0), rtol=2e-7 if stored == np.float32 else 2**-8)
    s = np.repeat(np.repeat(scale, block[0], -2)[..., :shape[-2], :], block[1], -1)[..., :shape[-1]]
    want = np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), want.view(np.uint8))
    # dequantize is the definition, values times their block's scale; the error is E4M3's.
    deq = np.asarray(fp8.dequantize(q))
    np.testing.assert_array_equal(deq, _numpy_dequantize(q.values, q.scale_inv, block))
    assert np.all(deq[..., :block[0], :block[1]] == 0)
    assert np.all(np.abs(deq - w) <= np.abs(w) * 2.0**-4 + s * 2.0**-9)


def test_quantize_of_a_dequantized_weight_gives_it_back():
    w = fp8.quantize(np.random.default_rng(1).normal(size=(150, 260)).astype(np.float32))
    again = fp8.quantize(fp8.dequantize(w))
    np.testing.assert_array_equal(np.asarray(again.values).view(np.uint8), np.asarray(w.values).view(np.uint8))
    np.testing.assert_allclose(np.asarray(again.scale_inv), np.asarray(w.scale_inv), rtol=2e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a16_matmul_is_the_dequantized_product(dtype):
    rng = np.random.default_rng(2)
    w = fp8.quantize(rng.normal(size=(200, 300)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(2, 7, 300)), dtype)
    y = fp8.matmul(x, w)
    assert y.dtype == jnp.float32 and y.shape == (2, 7, 200)
    plain = jnp.einsum("...i,oi->...o", x, fp8.dequantize(w).astype(dtype), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))
    exact = np.asarray(x, np.float64) @ _numpy_dequantize(w.values, w.scale_inv, w.block).astype(np.float64).T
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(y), exact, rtol=tol, atol=tol * np.abs(exact).max())


def test_w8a8_is_close_to_w8a16_and_its_activation_scales_are_per_token_and_128_columns():
    rng = np.random.default_rng(3)
    w = fp8.quantize(rng.normal(size=(96, 300)).astype(np.float32))
    x = rng.normal(size=(16, 300)).astype(np.float32) * rng.uniform(0.01, 100.0, size=(16, 1))
    xq, xs = fp8.quantize_activations(jnp.asarray(x), 128)
    assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (16, 3)
    amax = np.stack([np.abs(x[:, i:i + 128]).max(axis=1) for i in range(0, 300, 128)], axis=1)
    np.testing.assert_allclose(np.asarray(xs), amax / 448.0, rtol=2e-7)
    a16 = np.asarray(fp8.matmul(jnp.asarray(x), w))
    a8 = np.asarray(fp8.matmul(jnp.asarray(x), w, mode="w8a8"))
    # E4M3 rounds each activation by at most 2^-4 of its magnitude (half a step of 3 mantissa
    # bits; subnormals below 2^-6 of a group's scale by at most 2^-10 of the scale): a bound on
    # every output. With random signs the errors add up like noise: each element's relative error
    # is at most uniform on +-2^-4 (RMS 2^-4 / sqrt(3) = 3.6%), so the output's RMS error stays under 4%.
    wd = np.abs(np.asarray(fp8.dequantize(w), np.float64))
    xs_cols = np.repeat(np.asarray(xs, np.float64), 128, axis=1)[:, :300]
    bound = (2.0**-4 * np.abs(x) + 2.0**-10 * 448 * xs_cols) @ wd.T
    assert np.all(np.abs(a8 - a16) <= bound * (1 + 1e-5))
    rms = lambda a: np.sqrt(np.mean(np.square(a, dtype=np.float64), axis=1))
    rel = rms(a8 - a16) / rms(a16)
    assert rel.max() < 0.04 and rel.min() > 0.005  # and the activations were really rounded
    with pytest.raises(ValueError, match="mode='w4a4'"):
        fp8.matmul(jnp.asarray(x), w, mode="w4a4")


def test_block_fp8_weight_is_a_pytree_that_jits_once():
    rng = np.random.default_rng(4)
    w = fp8.quantize(rng.normal(size=(3, 40, 70)).astype(np.float32), (16, 32), "bfloat16")
    leaves, tree = jax.tree.flatten(w)
    assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).block == (16, 32)
    traces = []

    @jax.jit
    def f(x, w):
        traces.append(1)
        return fp8.matmul(x, jax.tree.map(lambda a: a[0], w))

    x = jnp.asarray(rng.normal(size=(5, 70)), jnp.float32)
    w2 = fp8.quantize(rng.normal(size=(3, 40, 70)).astype(np.float32), (16, 32), "bfloat16")
    np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(fp8.matmul(x, jax.tree.map(lambda a: a[0], w))))
    f(x, w2)
    assert len(traces) == 1
    with pytest.raises(ValueError, match=r"2-D weight \[out, 70\].*\(3, 40, 70\)"):
        fp8.matmul(x, w)


# ====================================================================== Qwen's FP8 checkpoint layout
import json  # noqa: E402
import pathlib  # noqa: E402

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from mtp.checkpoint import (SCALE_SUFFIX, CheckpointError, load_pretrained, may_be_fp8,  # noqa: E402
                            save_pretrained)
from mtp.config import ModelConfig  # noqa: E402
from mtp.model import forward  # noqa: E402
from mtp.model.params import flatten  # noqa: E402
from tests.conftest import random_params, tiny_config  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "models"
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _model(kind: str) -> ModelConfig:
    """Tiny models whose hidden size (136) spans two 128-column blocks, the second partial.

    ``qwen35``'s Gated DeltaNet groups (8 + 8 + 16 rows) do not fill whole blocks, so its
    ``in_proj_qkvz`` regroups row by row; ``qwen35_aligned`` has Qwen3.5's own head dim (128),
    so the groups move in whole blocks.
    """
    if kind == "qwen35_aligned":
        return ModelConfig.from_hf(CONFIGS / "tiny_qwen35.json").replace(
            hidden_size=136, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
            linear_value_head_dim=128)
    name = {"dense": "tiny_dense", "moe": "tiny_moe", "qwen35": "tiny_qwen35", "qwen35_moe_fused": "tiny_qwen35_moe"}[kind]
    return ModelConfig.from_hf(CONFIGS / f"{name}.json").replace(hidden_size=136)


def _numpy_quantize(w, scale_dtype):
    """The checkpoints' recipe in numpy: amax / 448 per 128 x 128 block, E4M3 values of w / scale."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // 128), -(-cols // 128)
    padded = np.zeros((*w.shape[:-2], nr * 128, nc * 128), np.float32)
    padded[..., :rows, :cols] = w
    amax = np.abs(padded.reshape(*w.shape[:-2], nr, 128, nc, 128)).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(scale_dtype)
    s = np.repeat(np.repeat(scale.astype(np.float32), 128, -2)[..., :rows, :], 128, -1)[..., :cols]
    return np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn), scale


def _read(path: pathlib.Path) -> dict:
    """Every tensor of a checkpoint written by these tests (one file), as numpy; FP8 ones from their bytes."""
    file = path / "model.safetensors"
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32}[info["dtype"]]
        begin, end = info["data_offsets"]
        out[name] = (info["dtype"], np.frombuffer(data[begin:end], dtype).reshape(info["shape"]))
    return out


def _official(tmp_path, kind: str, scale_dtype=np.float32, seed: int = 0, name: str = "fp8", quantize=_numpy_quantize):
    """``(dir, twin_dir, tensors)``: a tiny model as Qwen publishes FP8 checkpoints, written here with
    safetensors, and its dequantized twin (the FP8 tensors as the f32 weights they stand for).
    ``quantize(w, scale_dtype) -> (values, scales)`` makes each FP8 tensor."""
    cfg = _model(kind)
    bf16 = save_pretrained(tmp_path / f"{name}_bf16", cfg,
                           jax.tree.map(lambda a: a.astype(jnp.bfloat16), random_params(cfg, seed)),
                           fused_experts=kind.endswith("_fused"))  # experts.gate_up_proj [E, 2 I, H], one FP8 tensor
    raw = json.loads((bf16 / "config.json").read_text())
    tensors, twin = {}, {}
    for tensor, (_, value) in _read(bf16).items():
        if may_be_fp8(tensor):
            q, s = quantize(value, scale_dtype)
            tensors[tensor], tensors[tensor + SCALE_SUFFIX] = q, s
            twin[tensor] = _numpy_dequantize(q, s, (128, 128))
        else:
            tensors[tensor] = twin[tensor] = value
    # What Qwen's lists hold: the modules with weights of 2 dims and more kept in bf16 (conv1d too).
    kept = sorted(t.removesuffix(".weight") for t, v in tensors.items()
                  if v.ndim >= 2 and v.dtype != ml_dtypes.float8_e4m3fn and not t.endswith(SCALE_SUFFIX))
    dirs = []
    for sub, content, config in ((name, tensors, raw | {"quantization_config": FP8_CONFIG | {
            "modules_to_not_convert": kept}}), (f"{name}_twin", twin, raw)):
        d = tmp_path / sub
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(content, str(d / "model.safetensors"))
        dirs.append(d)
    return dirs[0], dirs[1], tensors


def _is_fp8(a) -> bool:
    return isinstance(a, fp8.BlockFp8Weight)


def _dequantized(params):
    return jax.tree.map(lambda a: fp8.dequantize(a) if _is_fp8(a) else a, params, is_leaf=_is_fp8)


def _tokens(cfg, seed=0, shape=(2, 11)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape), jnp.int32)


@pytest.mark.parametrize("kind, scale_dtype", [("dense", np.float32), ("moe", ml_dtypes.bfloat16),
                                               ("qwen35", np.float32), ("qwen35_aligned", ml_dtypes.bfloat16),
                                               ("qwen35_moe_fused", np.float32)])
def test_an_official_fp8_checkpoint_stays_8_bit_and_computes_its_dequantized_model(tmp_path, kind, scale_dtype):
    path, twin_path, tensors = _official(tmp_path, kind, scale_dtype)
    cfg, params = load_pretrained(path)
    twin_cfg, twin = load_pretrained(twin_path)
    assert cfg.quantization_config is not None and cfg.quantization_config.weight_block_size == (128, 128)
    assert cfg.replace(quantization_config=None) == twin_cfg
    flat, twin_flat = flatten(params), flatten(twin)
    fp8_names = [n for n, a in flat.items() if _is_fp8(a)]
    # Every projection is FP8 on the device (the MTP head's fc and layer included), the rest is not.
    assert "mtp.fc.weight" in fp8_names and any("in_proj_qkvz" in n for n in fp8_names)
    assert {n for n in flat if not _is_fp8(flat[n])} == {n for n in flat if not may_be_fp8(n)}
    for name in fp8_names:
        w = flat[name]
        assert isinstance(w.values, jax.Array) and w.values.dtype == jnp.float8_e4m3fn, name
        assert w.scale_inv.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(fp8.dequantize(w)), np.asarray(twin_flat[name]), err_msg=name)
    qkvz = flat["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert qkvz.block == ((1, 128) if kind in ("qwen35", "qwen35_moe_fused") else (128, 128))
    if kind in ("moe", "qwen35_moe_fused"):  # the routed experts stacked [E, I, H], with their own scales
        gate = flat["model.layers.0.mlp.experts.gate_proj.weight"]
        # Per-expert tensors keep their blocks; the gate's rows of a fused gate_up_proj (2 x 16 rows
        # in one block) keep theirs row by row.
        assert gate.block == ((128, 128) if kind == "moe" else (1, 128))
        assert gate.scale_inv.shape == (cfg.num_experts, 1 if kind == "moe" else 16, 2)
    else:
        assert flat["model.layers.0.mlp.gate_proj.weight"].scale_inv.shape[-1] == 2  # 136 columns: 2 blocks
    # The model on FP8 weights computes exactly what its dequantized twin does.
    tokens = _tokens(cfg)
    logits = forward(cfg, params, tokens)
    np.testing.assert_array_equal(np.asarray(logits, np.float32), np.asarray(forward(twin_cfg, twin, tokens), np.float32))
    assert np.all(np.isfinite(np.asarray(logits, np.float32)))


@pytest.mark.parametrize("kind, scale_dtype", [("moe", np.float32), ("qwen35", ml_dtypes.bfloat16),
                                               ("qwen35_aligned", np.float32), ("qwen35_moe_fused", ml_dtypes.bfloat16)])
def test_a_save_round_trip_writes_the_checkpoint_back_exactly(tmp_path, kind, scale_dtype):
    path, _, tensors = _official(tmp_path, kind, scale_dtype)
    cfg, params = load_pretrained(path)
    out = save_pretrained(tmp_path / "resaved", cfg, params, fused_experts=kind.endswith("_fused"))
    written = _read(out)
    assert sorted(written) == sorted(tensors)
    for name, (tag, value) in written.items():
        want = tensors[name]
        assert value.dtype == want.dtype and value.shape == want.shape, name
        assert value.tobytes() == want.tobytes(), name
    assert written["mtp.fc.weight"][0] == "F8_E4M3"
    if kind.endswith("_fused"):
        assert written["model.layers.0.mlp.experts.gate_up_proj"][0] == "F8_E4M3"
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved == json.loads((path / "config.json").read_text())["quantization_config"]


def _rewrite(path: pathlib.Path, config=None, drop=(), put=None):
    """``path``'s checkpoint with its config replaced, tensors dropped or replaced."""
    tensors = {n: v for n, (_, v) in _read(path).items() if n not in drop}
    tensors.update(put or {})
    save_file(tensors, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_every_bad_fp8_file_is_a_named_error(tmp_path):
    path, _, tensors = _official(tmp_path, "moe")
    raw = json.loads((path / "config.json").read_text())
    quant = raw["quantization_config"]
    q_proj = "model.layers.1.self_attn.q_proj.weight"

    def fails(pattern, **change):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text((path / "config.json").read_text())
        (d / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
        _rewrite(d, **change)
        with pytest.raises(CheckpointError, match=pattern.replace("FILE", re.escape(str(d / "model.safetensors")))
                           .replace("CONFIG", re.escape(str(d / "config.json")))):
            load_pretrained(d)

    load_pretrained(path)  # the original loads; every change below breaks one thing
    fails(r"CONFIG.*quantization_config.quant_method='awq'.*only 'fp8'",
          config=raw | {"quantization_config": quant | {"quant_method": "awq"}})
    fails(r"CONFIG.*quantization_config.weight_block_size=\(64, 64\).*only \[128, 128\]",
          config=raw | {"quantization_config": quant | {"weight_block_size": [64, 64]}})
    fails(r"CONFIG.*quantization_config.fmt='e5m2'", config=raw | {"quantization_config": quant | {"fmt": "e5m2"}})
    fails(rf"FILE: FP8 tensor '{q_proj}' has no block scales '{q_proj}_scale_inv'", drop=[q_proj + SCALE_SUFFIX])
    fails(rf"FILE: scale tensor '{q_proj}_scale_inv' has shape \(1, 1\), but its FP8 weight '{q_proj}' of shape "
          rf"\(128, 136\) needs \(1, 2\)", put={q_proj + SCALE_SUFFIX: np.ones((1, 1), np.float32)})
    fails(rf"FILE: scale tensor '{q_proj}_scale_inv' has dtype F16",
          put={q_proj + SCALE_SUFFIX: tensors[q_proj + SCALE_SUFFIX].astype(np.float16)})
    router = "model.layers.0.mlp.gate.weight"
    q, s = _numpy_quantize(tensors[router], np.float32)
    fails(rf"FILE: tensor '{router}' is F8_E4M3, but module 'model.layers.0.mlp.gate' must stay bf16",
          put={router: q, router + SCALE_SUFFIX: s})
    ba = "model.layers.0.linear_attn.in_proj_ba.weight"
    q, s = _numpy_quantize(tensors[ba], np.float32)
    fails(rf"FILE: tensor '{ba}' is F8_E4M3, but module .*in_proj_ba' must stay bf16",
          put={ba: q, ba + SCALE_SUFFIX: s}, config=raw | {"quantization_config": quant | {"modules_to_not_convert": []}})
    fails(rf"FILE: tensor '{q_proj}' is F8_E4M3, but CONFIG's quantization_config.modules_to_not_convert keeps "
          rf"module 'model.layers.1.self_attn.q_proj' in bf16",
          config=raw | {"quantization_config": quant | {"modules_to_not_convert": ["model.layers.1.self_attn.q_proj"]}})
    fails(r"FILE: tensor '.*\.weight' is F8_E4M3, but CONFIG has no quantization_config",
          config={k: v for k, v in raw.items() if k != "quantization_config"})
    norm = "model.norm.weight"
    fails(rf"FILE: tensor '{norm}_scale_inv' scales '{norm}', which is BF16, not F8_E4M3",
          put={norm + SCALE_SUFFIX: np.ones((1, 2), np.float32)})


# ====================================================================== quantized at load, and decoding
from mtp.execution import ExecutionConfig  # noqa: E402
from mtp.generation import generate  # noqa: E402
from mtp.speculative import SpecConfig  # noqa: E402
from tests.conftest import agreeing_params  # noqa: E402


def test_weight_quant_fp8_quantizes_a_bf16_checkpoint_as_the_official_ones_are(tmp_path):
    cfg = _model("qwen35")
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), random_params(cfg, 3))
    path = save_pretrained(tmp_path / "bf16", cfg, params)
    qcfg, qparams = load_pretrained(path, weight_quant="fp8")
    # The same as the checkpoint published in FP8: each checkpoint tensor quantized, then regrouped.
    # (fp8.quantize is the numpy recipe up to an ulp of a scale: test_quantize_is_the_checkpoints_recipe.)
    def quantize(w, scale_dtype):
        q = fp8.quantize(w, scale_dtype=scale_dtype)
        return np.asarray(q.values), np.asarray(q.scale_inv).astype(scale_dtype)

    official, _, tensors = _official(tmp_path, "qwen35", seed=3, name="published", quantize=quantize)
    ocfg, oparams = load_pretrained(official)
    for (name, a), b in zip(flatten(qparams).items(), flatten(oparams).values()):
        assert _is_fp8(a) == _is_fp8(b) == may_be_fp8(name), name
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), name
    assert qcfg == ocfg  # quantization_config included: modules_to_not_convert lists the bf16 Linears
    written = _read(save_pretrained(tmp_path / "saved", qcfg, qparams))
    assert {n: v.tobytes() for n, (_, v) in written.items()} == {n: v.tobytes() for n, v in tensors.items()}
    with pytest.raises(CheckpointError, match="weight_quant='int4'; choose one of none, fp8"):
        load_pretrained(path, weight_quant="int4")


@pytest.mark.parametrize("name, verify_width, mtp_quant", [("tiny_dense", 3, "bf16"), ("tiny_moe", 4, "nvfp4")])
def test_greedy_speculative_decoding_with_fp8_weights_is_token_identical(tmp_path, name, verify_width, mtp_quant):
    cfg = tiny_config(name).replace(tie_word_embeddings=False)
    path = save_pretrained(tmp_path / name, cfg, agreeing_params(cfg, 11, 0.01))
    cfg, params = load_pretrained(path, weight_quant="fp8")
    fp8_leaves = [a for a in jax.tree.leaves(params, is_leaf=_is_fp8) if _is_fp8(a)]
    assert len(fp8_leaves) > 20 and all(a.values.dtype == jnp.float8_e4m3fn for a in fp8_leaves)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 17, 9)]
    spec = SpecConfig(max_new_tokens=14, verify_width=verify_width)
    plain = generate(cfg, params, prompts, spec, speculative=False).tokens
    assert all(len(set(t)) >= 3 for t in plain), plain
    res = generate(cfg, params, prompts, spec, mtp_quant=mtp_quant)
    assert res.tokens == plain
    assert 0 < res.stats.accepted < res.stats.draft_tokens, res.stats  # drafts both accepted and rejected


# ====================================================================== sharded
_SHARDED_FP8 = r"""
import json, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from jax.sharding import PartitionSpec as P
from mtp import sharding as S
from mtp.checkpoint import load_pretrained, save_pretrained
from mtp.model import forward
from tests.conftest import random_params, tiny_config
# gate/up [256, 136] split on rows and down [136, 256] on columns: 128 a device, whole blocks;
# q_proj's 64 rows would cut a block in two: replicated.
cfg = tiny_config("tiny_dense").replace(hidden_size=136, intermediate_size=256)
with tempfile.TemporaryDirectory() as tmp:
    save_pretrained(tmp, cfg, random_params(cfg, 5))
    qcfg, one = load_pretrained(tmp, weight_quant="fp8")
    mesh = S.make_mesh(tp=2)
    _, split = S.load_sharded(tmp, mesh, weight_quant="fp8")
layer = split["model"]["layers"]["0"]
specs = {name: (w.values.sharding.spec, w.scale_inv.sharding.spec, str(w.values.dtype)) for name, w in
         (("gate", layer["mlp"]["gate_proj"]["weight"]), ("down", layer["mlp"]["down_proj"]["weight"]),
          ("q", split["model"]["layers"]["1"]["self_attn"]["q_proj"]["weight"]))}
tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
with S.on_mesh(mesh):
    got = np.asarray(jax.jit(forward, static_argnums=0)(qcfg, split, tokens))
want = np.asarray(forward(qcfg, one, tokens))
print(json.dumps({"specs": {k: [str(a), str(b), d] for k, (a, b, d) in specs.items()},
                  "max_err": float(np.abs(got - want).max()), "scale": float(np.abs(want).max()),
                  "argmax_equal": bool(np.array_equal(got.argmax(-1), want.argmax(-1)))}))
"""


def test_fp8_weights_shard_on_whole_blocks_and_compute_what_one_device_does():
    import os
    import subprocess
    import sys

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=2"]))
    proc = subprocess.run([sys.executable, "-c", _SHARDED_FP8], env=env, cwd=pathlib.Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["specs"]["gate"] == ["P('tp', None)", "P('tp', None)", "float8_e4m3fn"]
    assert out["specs"]["down"] == ["P(None, 'tp')", "P(None, 'tp')", "float8_e4m3fn"]
    assert all("tp" not in spec for spec in out["specs"]["q"][:2])  # replicated
    # f32 sums split over two devices add up in another order: within f32 rounding (2e-5 of the
    # logits' scale measured with LLVM at level 0, as scripts/test.sh compiles).
    assert out["max_err"] <= 4e-5 * out["scale"] and out["argmax_equal"], out


def test_block_aligned_spec_keeps_only_splits_of_whole_blocks():
    from jax.sharding import PartitionSpec as P

    from mtp.sharding import block_aligned_spec

    sizes = {"tp": 2, "ep": 4}
    assert block_aligned_spec(P("tp", None), (256, 136), (128, 128), sizes) == P("tp", None)
    assert block_aligned_spec(P("tp", None), (192, 136), (128, 128), sizes) == P(None, None)
    assert block_aligned_spec(P(None, "tp"), (136, 512), (1, 128), sizes) == P(None, "tp")
    assert block_aligned_spec(P("ep", "tp", None), (8, 256, 136), (128, 128), sizes) == P("ep", "tp", None)
    assert block_aligned_spec(P("tp", None), (64, 136), (1, 128), sizes) == P("tp", None)  # row scales split anywhere


# ====================================================================== routed experts
@pytest.mark.parametrize("form", ["gather", "segments"])
def test_routed_experts_on_stacked_fp8_experts_dequantize_only_the_selected_ones(form):
    from mtp.ops.moe import reference as moe_ref

    rng = np.random.default_rng(6)
    experts, hidden, inner, n, k = 16, 136, 40, 9, 3
    gate, up = (fp8.quantize(rng.normal(size=(experts, inner, hidden)).astype(np.float32), scale_dtype="bfloat16")
                for _ in range(2))
    down = fp8.quantize(rng.normal(size=(experts, hidden, inner)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(n, hidden)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), n), jnp.float32)
    op = {"gather": moe_ref.routed_experts_gather, "segments": moe_ref.routed_experts_segments}[form]
    got = op(x, ids, weights, gate, up, down)
    want = op(x, ids, weights, *(fp8.dequantize(w) for w in (gate, up, down)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Only the selected experts' values and scales are read: the traced program gathers them
    # before any dequantize, so no f32 array of all E experts exists in it.
    jaxpr = str(jax.make_jaxpr(op)(x, ids, weights, gate, up, down))
    assert f"f32[{experts},{inner},{hidden}]" not in jaxpr and f"f32[{experts},{hidden},{inner}]" not in jaxpr


def test_greedy_speculative_decoding_on_the_fp8_kernel_is_token_identical(tmp_path, monkeypatch):
    """bf16 activations and FP8 weights with `mtp.ops.fp8.triton` (interpreted here) in both loops:
    the GPU's "auto" path at the rows the kernel takes."""
    from mtp.ops.fp8 import triton

    calls = []
    run = triton.w8a16
    monkeypatch.setattr(triton, "w8a16", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    path = save_pretrained(tmp_path / "m", cfg, agreeing_params(cfg, 11, 0.01))
    cfg, params = load_pretrained(path, dtype=jnp.bfloat16, weight_quant="fp8")
    prompts = [[5, 9, 2, 7, 3], [11, 4, 8]]
    spec = SpecConfig(max_new_tokens=8, verify_width=3, plain_width=3,
                      execution=ExecutionConfig().with_kernels(fp8_gemm="interpret"))
    plain = generate(cfg, params, prompts, spec, speculative=False).tokens
    res = generate(cfg, params, prompts, spec)
    assert calls and max(calls) <= triton.MAX_ROWS, calls
    assert res.tokens == plain
    assert res.stats.accepted > 0, res.stats


def test_greedy_speculative_decoding_on_the_fp8_grouped_gemms_is_token_identical(tmp_path, monkeypatch):
    """FP8 MoE experts above 16 rows a call (six prompts, verify width 3: 18 rows; the prefill's
    padded chunk) on `mtp.ops.moe.triton_grouped` (interpreted) in both loops. The tiny MoE model
    is widened to whole 128 x 128 scale blocks, which the kernels take."""
    from mtp.ops.moe import triton, triton_grouped

    calls = []
    run = triton_grouped.routed_experts_fp8
    monkeypatch.setattr(triton_grouped, "routed_experts_fp8", lambda *a, **k: calls.append(a[0].shape[0]) or run(*a, **k))
    cfg = tiny_config("tiny_moe").replace(tie_word_embeddings=False, hidden_size=128, moe_intermediate_size=128,
                                          shared_expert_intermediate_size=128)
    path = save_pretrained(tmp_path / "m", cfg, agreeing_params(cfg, 11, 0.01))
    cfg, params = load_pretrained(path, dtype=jnp.bfloat16, weight_quant="fp8")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 9, 3, 12, 7, 4)]
    spec = SpecConfig(max_new_tokens=6, verify_width=3, plain_width=3,
                      execution=ExecutionConfig().with_kernels(moe="interpret"))
    plain = generate(cfg, params, prompts, spec, speculative=False).tokens
    res = generate(cfg, params, prompts, spec)
    assert calls and min(calls) > triton.MAX_TOKENS, calls
    assert res.tokens == plain
    assert res.stats.accepted > 0, res.stats
