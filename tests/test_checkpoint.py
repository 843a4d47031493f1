"""Hugging Face checkpoint I/O: round trips, third-party files, and every way a load can fail."""

import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from mtp import checkpoint
from mtp.checkpoint import CheckpointError, load_pretrained, save_pretrained
from mtp.config import ModelConfig
from mtp.model import forward
from mtp.model.params import flatten, param_shapes, unflatten
from tests.conftest import per_expert_tensors

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "models"


def _cfg(name):
    return ModelConfig.from_hf(CONFIGS / f"{name}.json")


def _params(cfg, seed, dtype=jnp.float32):
    """Random weights of every tensor, norms included (numpy: eager init_params is slow on CI)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            w = (1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        flat[name] = jnp.asarray(w, dtype)
    return unflatten(flat)


def _assert_bit_exact(a, b):
    fa, fb = flatten(a), flatten(b)
    assert list(fa) == list(fb)
    for name in fa:
        x, y = np.asarray(fa[name]), np.asarray(fb[name])
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def _third_party(tmp_path, cfg, params, raw_config=None, tensors=None):
    """A checkpoint written without our saver: plain safetensors + a hand-made config dict."""
    d = tmp_path / "third_party"
    d.mkdir(exist_ok=True)
    raw = raw_config if raw_config is not None else cfg.to_hf()
    (d / "config.json").write_text(json.dumps(raw))
    if tensors is None:
        tensors = per_expert_tensors(params)
    save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shard", [None, 4096])
def test_round_trip_is_bit_exact(tmp_path, name, dtype, shard):
    cfg = _cfg(name)
    params = _params(cfg, seed=len(name) + (shard or 0), dtype=dtype)
    out = save_pretrained(tmp_path / "ckpt", cfg, params, max_shard_bytes=shard)
    files = sorted(p.name for p in out.iterdir())
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.endswith(".safetensors")]
        assert len(shards) > 1 and "model.safetensors.index.json" in files
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(per_expert_tensors(params))
        assert set(index["weight_map"].values()) == set(shards)
        for s in shards:  # each shard respects the limit unless it is a single big tensor
            assert os.path.getsize(out / s) <= shard + 8192 or len(
                [n for n, f in index["weight_map"].items() if f == s]) == 1
    cfg2, loaded = load_pretrained(out)
    assert cfg2 == cfg
    _assert_bit_exact(params, loaded)


def test_load_casts_when_asked(tmp_path):
    cfg = _cfg("tiny_dense")
    params = _params(cfg, 3)
    save_pretrained(tmp_path / "c", cfg, params)
    _, loaded = load_pretrained(tmp_path / "c", dtype=jnp.bfloat16)
    for name, v in flatten(loaded).items():
        assert v.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flatten(params)[name]).astype(ml_dtypes.bfloat16))


def test_place_sees_every_tensor_once(tmp_path):
    cfg = _cfg("tiny_moe")
    save_pretrained(tmp_path / "c", cfg, _params(cfg, 4), max_shard_bytes=2048)
    seen = []

    def place(name, array):
        assert isinstance(array, np.ndarray)
        seen.append(name)
        return jnp.asarray(array) * 1  # a device array made by the callback, not the loader

    _, loaded = load_pretrained(tmp_path / "c", place=place)
    assert sorted(seen) == sorted(param_shapes(cfg)) and len(seen) == len(set(seen))
    assert set(flatten(loaded)) == set(seen)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_third_party_checkpoint_gives_same_logits(tmp_path, name):
    cfg = _cfg(name)
    params = _params(cfg, 5)
    raw = json.loads((CONFIGS / f"{name}.json").read_text())  # HF field names, as a user would write
    d = _third_party(tmp_path, cfg, params, raw_config=raw)
    cfg2, loaded = load_pretrained(d)
    assert cfg2 == cfg
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 11), 0, cfg.vocab_size)
    run = jax.jit(forward, static_argnums=0)
    np.testing.assert_array_equal(np.asarray(run(cfg2, loaded, tokens)), np.asarray(run(cfg, params, tokens)))


def test_mtp_tensors_optional_only_without_mtp_layers(tmp_path):
    cfg = _cfg("tiny_dense")
    params = _params(cfg, 7)
    no_mtp = {k: v for k, v in per_expert_tensors(params).items() if not k.startswith("mtp.")}
    raw = cfg.to_hf() | {"num_nextn_predict_layers": 0}
    cfg0, loaded = load_pretrained(_third_party(tmp_path, cfg, params, raw_config=raw, tensors=no_mtp))
    assert not cfg0.has_mtp and "mtp" not in loaded
    with pytest.raises(CheckpointError, match=r"mtp\.pre_fc_norm_embedding\.weight.*missing from model\.safetensors"):
        load_pretrained(_third_party(tmp_path, cfg, params, tensors=no_mtp))
    # MTP weights the config does not ask for are a config/weights disagreement, not silently dropped.
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp\..*num_nextn_predict_layers is 0"):
        load_pretrained(_third_party(tmp_path, cfg, params, raw_config=raw))


def test_mtp_depth_comes_from_the_tensors_where_the_config_names_none(tmp_path):
    """Qwen3-Next's released config.json has no num_nextn_predict_layers (nor Qwen3.5's
    mtp_num_hidden_layers) though its weights carry the MTP layer: loading takes the layer."""
    cfg = _cfg("tiny_moe")
    params = _params(cfg, 8)
    raw = {k: v for k, v in cfg.to_hf().items() if k not in ("num_nextn_predict_layers", "mtp_num_hidden_layers")}
    got, loaded = load_pretrained(_third_party(tmp_path, cfg, params, raw_config=raw))
    assert got == cfg and got.has_mtp
    _assert_bit_exact(loaded, params)
    no_mtp = {k: v for k, v in per_expert_tensors(params).items() if not k.startswith("mtp.")}
    got, loaded = load_pretrained(_third_party(tmp_path, cfg, params, raw_config=raw, tensors=no_mtp))
    assert not got.has_mtp and "mtp" not in loaded  # silent config, no MTP weights: none
    assert checkpoint.load_config(tmp_path / "third_party") == got  # what sharded loads build from


def test_saved_directory_is_readable_as_the_umask_allows(tmp_path):
    cfg = _cfg("tiny_dense")
    old = os.umask(0o022)
    try:
        out = save_pretrained(tmp_path / "ckpt", cfg, _params(cfg, 9))
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)  # mkdtemp alone leaves 0700


def _write_good(tmp_path, shard=None):
    cfg = _cfg("tiny_moe")
    params = _params(cfg, 8)
    return cfg, params, save_pretrained(tmp_path / "ckpt", cfg, params, max_shard_bytes=shard)


def _rewrite_tensors(d, edit):
    file = d / "model.safetensors"
    from safetensors.numpy import load_file
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_missing_tensor_is_named(tmp_path):
    _, _, d = _write_good(tmp_path)
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*model\.safetensors"):
        load_pretrained(d)


def test_wrong_shape_is_named(tmp_path):
    _, _, d = _write_good(tmp_path)
    name = "model.layers.0.linear_attn.in_proj_ba.weight"

    def edit(t):
        t[name] = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)

    _rewrite_tensors(d, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*in_proj_ba\.weight.*\(3, 32\)"):
        load_pretrained(d)


def test_unsupported_dtype_is_named(tmp_path):
    _, _, d = _write_good(tmp_path)
    name = "model.layers.2.mlp.up_proj.weight"

    def edit(t):
        t[name] = np.random.default_rng(1).integers(-5, 5, t[name].shape).astype(np.int32)

    _rewrite_tensors(d, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*up_proj\.weight.*I32"):
        load_pretrained(d)


def test_unexpected_tensor_is_named(tmp_path):
    _, _, d = _write_good(tmp_path)
    _rewrite_tensors(d, lambda t: t.update({"model.layers.9.foo.weight": np.ones(4, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*unexpected tensor 'model\.layers\.9\.foo"):
        load_pretrained(d)


@pytest.mark.parametrize("shard", [None, 4096])
def test_truncated_file_is_named(tmp_path, shard):
    _, _, d = _write_good(tmp_path, shard)
    victim = sorted(d.glob("*.safetensors"))[-1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*truncated or corrupt"):
        load_pretrained(d)


def test_index_naming_missing_shard(tmp_path):
    _, _, d = _write_good(tmp_path, 4096)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (d / victim).unlink()
    first = next(n for n, f in index["weight_map"].items() if f == victim)
    with pytest.raises(CheckpointError, match=rf"'{first}'.*{victim}.*does not exist"):
        load_pretrained(d)


def test_index_disagreeing_with_shards(tmp_path):
    _, _, d = _write_good(tmp_path, 4096)
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = next(f for f in index["weight_map"].values() if f != index["weight_map"][name])
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_pretrained(d)


@pytest.mark.parametrize("index, match", [
    ({"weight_map": []}, "'weight_map' is a list, not an object"),
    ({"weight_map": {"model.norm.weight": 3}}, "'weight_map' maps tensor 'model.norm.weight' to 3, not a shard"),
    ({"weight_map": None}, "'weight_map' is a NoneType"),
    ({"metadata": {}}, "not a safetensors index with a 'weight_map'"),
])
def test_malformed_index_is_named(tmp_path, index, match):
    _, _, d = _write_good(tmp_path, 4096)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(str(d / "model.safetensors.index.json")) + ": " + match):
        load_pretrained(d)


@pytest.mark.parametrize("change, match", [
    ({"vocab_size": "abc"}, "vocab_size='abc': expected int"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: must be positive"),
])
def test_malformed_config_names_the_file_once(tmp_path, change, match):
    _, _, d = _write_good(tmp_path)
    raw = json.loads((d / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(d / 'config.json'))}: config field {match}"):
        load_pretrained(d)


def test_bad_model_type(tmp_path):
    cfg, params, d = _write_good(tmp_path)
    raw = json.loads((d / "config.json").read_text()) | {"model_type": "llama"}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json.*'llama'"):
        load_pretrained(d)


def test_config_not_matching_weights(tmp_path):
    cfg, params, d = _write_good(tmp_path)
    raw = json.loads((d / "config.json").read_text()) | {"hidden_size": 48}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*embed_tokens\.weight.*\(97, 32\).*\(97, 48\)"):
        load_pretrained(d)


def test_no_weights_at_all(tmp_path):
    cfg, _, d = _write_good(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(d)


# ---------------------------------------------------------------- saving
def test_bad_params_write_nothing(tmp_path):
    cfg = _cfg("tiny_dense")
    flat = flatten(_params(cfg, 9))
    cases = {
        "missing": ({k: v for k, v in flat.items() if k != "lm_head.weight"}, r"'lm_head\.weight'.*missing"),
        "shape": (flat | {"model.norm.weight": jnp.ones((31,))}, r"'model\.norm\.weight'.*\(31,\)"),
        "dtype": (flat | {"model.norm.weight": jnp.ones((32,), jnp.int32)}, r"'model\.norm\.weight'.*int32"),
        "extra": (flat | {"model.bogus": jnp.ones((2,))}, r"unexpected tensor 'model\.bogus'"),
    }
    for label, (bad, pattern) in cases.items():
        with pytest.raises(CheckpointError, match=pattern):
            save_pretrained(tmp_path / label, cfg, unflatten(bad))
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_existing_checkpoint(tmp_path, monkeypatch):
    cfg = _cfg("tiny_moe")
    old_params = _params(cfg, 10)
    target = save_pretrained(tmp_path / "ckpt", cfg, old_params, extra_files={"README.md": "old card"})
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    real_save = checkpoint.save_file
    calls = []

    def flaky_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the first shard lands on disk, the second write dies
            raise OSError("disk full (simulated)")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", flaky_save)
    with pytest.raises(OSError, match="simulated"):
        save_pretrained(target, cfg, _params(cfg, 11), max_shard_bytes=4096)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or aside dirs left
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    monkeypatch.setattr(checkpoint, "save_file", real_save)
    _, loaded = load_pretrained(target)
    _assert_bit_exact(old_params, loaded)


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    cfg = _cfg("tiny_dense")

    def broken(tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"half")
        raise OSError("interrupted (simulated)")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError, match="simulated"):
        save_pretrained(tmp_path / "new", cfg, _params(cfg, 12))
    assert list(tmp_path.iterdir()) == []


def test_resave_replaces_and_carries_extra_files(tmp_path):
    cfg = _cfg("tiny_dense")
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": "fake"}')
    first = save_pretrained(tmp_path / "ckpt", cfg, _params(cfg, 13), max_shard_bytes=4096,
                            extra_files={"tokenizer.json": tok, "README.md": "# card\n", "blob.bin": b"\x00\x01",
                                         "token_counts.npy": b"counts"},
                            metadata={"source": "test"})
    assert (first / "tokenizer.json").read_text() == '{"model": "fake"}'
    assert (first / "README.md").read_text() == "# card\n"
    assert (first / "blob.bin").read_bytes() == b"\x00\x01"
    carried = checkpoint.extra_files_from(first)
    assert set(carried) == {"tokenizer.json", "README.md", "token_counts.npy"}

    new_params = _params(cfg, 14)
    # Re-save into the same directory, single file this time: old shards must not linger.
    second = save_pretrained(tmp_path / "ckpt2", cfg, new_params, extra_files=carried)
    second = save_pretrained(first, cfg, new_params, extra_files=checkpoint.extra_files_from(second))
    names = sorted(p.name for p in second.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors", "token_counts.npy", "tokenizer.json"]
    _, loaded = load_pretrained(second)
    _assert_bit_exact(new_params, loaded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt2", "tokenizer.json"]


def test_bad_extra_file_names(tmp_path):
    cfg = _cfg("tiny_dense")
    params = _params(cfg, 15)
    for bad in ("config.json", "model.safetensors", "sub/dir.txt", "x.safetensors"):
        with pytest.raises(CheckpointError, match="reserved or not a plain file name"):
            save_pretrained(tmp_path / "c", cfg, params, extra_files={bad: "x"})
    with pytest.raises(CheckpointError, match="is not a file"):
        save_pretrained(tmp_path / "c", cfg, params, extra_files={"tokenizer.json": tmp_path / "absent"})
    with pytest.raises(CheckpointError, match="metadata must map str to str"):
        save_pretrained(tmp_path / "c", cfg, params, metadata={"step": 3})
    assert list(tmp_path.iterdir()) == []
