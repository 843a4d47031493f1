"""Joint target + MTP training: learning, no retrace, exact resume, and the HF export.

Every test trains the same 2-layer model on the same synthetic stream, so the
jitted step compiles once for the whole module (`mtp.train.steps_for` caches it).
The stream is a run of ``+stride`` counters with random restarts: both the next
token and the one after it are predictable from the current one, so a few steps
must cut both losses well below chance.
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import train_tiny
from mtp import train as T
from mtp.checkpoint import load_pretrained
from mtp.model.params import flatten
from mtp.model.target import forward_with_hiddens
from mtp import mtp_head

VOCAB = 64
STEPS = 24
ROOT = pathlib.Path(__file__).resolve().parents[1]

MODEL = {
    "model_type": "qwen3_next", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
    "full_attention_interval": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "partial_rotary_factor": 0.5, "intermediate_size": 64, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "num_experts": 0, "tie_word_embeddings": True, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 256,
}


def counter_stream(n: int, seed: int) -> np.ndarray:
    """Counters ``t -> (t + 3) mod VOCAB`` restarting at random values every 8..24 tokens."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, np.uint16)
    i = 0
    while i < n:
        length = int(rng.integers(8, 25))
        start = int(rng.integers(0, VOCAB))
        seg = (start + 3 * np.arange(length)) % VOCAB
        out[i : i + length] = seg[: n - i]
        i += length
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    data = root / "data"
    data.mkdir()
    np.save(data / "train.npy", counter_stream(20_000, seed=1))
    np.save(data / "heldout.npy", counter_stream(2_000, seed=2))
    (root / "model.json").write_text(json.dumps(MODEL))
    c = train_tiny.get_config()
    c.model = str(root / "model.json")
    c.model_overrides = {}
    c.data_dir = str(data)
    c.tokenizer = ""
    c.seq_len = 16
    c.batch_size = 8
    c.num_train_steps = STEPS
    c.checkpoint_every = STEPS // 2
    c.eval_every = STEPS // 2
    c.eval_windows = 16
    c.eval_batch_size = 8
    c.peak_lr = 2e-2
    return root, c


@pytest.fixture(scope="module")
def straight(setup):
    """One uninterrupted run of STEPS steps."""
    root, c = setup
    return T.train(c, root / "straight", progress=False)


def test_training_learns_the_stream_and_never_retraces(setup, straight):
    _, c = setup
    steps = T.steps_for(straight.model_cfg, straight.hp)
    heldout = T.eval_windows(np.load(pathlib.Path(c.data_dir) / "heldout.npy"), c.seq_len + 1, c.eval_windows)
    init = T.init_state(straight.model_cfg, straight.hp, c.seed, c.num_train_steps)
    before = T.evaluate(steps, init.params, heldout, c.eval_batch_size)
    after = straight.summary["heldout"]
    assert before["target_loss"] > 0.9 * np.log(VOCAB)  # starts near chance
    assert after["target_loss"] < before["target_loss"] - 1.0
    assert after["mtp_loss"] < before["mtp_loss"] - 1.0
    assert after["mtp_acc"] > 2 * before["mtp_acc"] + 0.05
    # The run's periodic eval was recorded, and more steps after it never retraced the step.
    kinds = [(h["kind"], h["step"]) for h in straight.history]
    assert ("eval", STEPS // 2) in kinds and ("eval", STEPS) in kinds
    traces = steps.traces["train"]
    stream = jnp.asarray(np.load(pathlib.Path(c.data_dir) / "train.npy"))
    state = jax.tree.map(jnp.copy, straight.state)
    for _ in range(3):
        state, metrics = steps.train(state, stream)
    assert int(state.step) == STEPS + 3 and np.isfinite(float(metrics["loss"]))
    assert steps.traces["train"] == traces
    assert straight.summary["traces"]["train"] <= 1


def test_resume_restores_state_and_continues_identically(setup, straight):
    root, c = setup
    work = root / "interrupted"
    first = T.train(c, work, stop_at_step=STEPS // 2 + 3, progress=False)
    assert first.summary["steps"] == STEPS // 2 + 3
    # The checkpoint written at the interruption is the state the run ended with.
    mngr = T._manager(work, c.keep_checkpoints)
    restored, meta = T.restore_checkpoint(mngr, STEPS // 2 + 3, straight.state)
    mngr.close()
    for a, b in zip(jax.tree.leaves(first.state.as_dict()), jax.tree.leaves(restored.as_dict())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta["train_seconds"] >= 0 and meta["wall_seconds"] > 0
    second = T.train(c, work, progress=False)
    assert second.summary["resumed_from"] == STEPS // 2 + 3
    assert second.summary["steps_this_run"] == STEPS - (STEPS // 2 + 3)
    for a, b in zip(jax.tree.leaves(straight.state.as_dict()), jax.tree.leaves(second.state.as_dict())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_time_budget_stops_and_keeps_a_resumable_checkpoint(setup):
    root, c = setup
    res = T.train(c, root / "budget", max_train_seconds=1e-3, progress=False)
    assert res.summary["steps"] == 0 and "time budget" in res.summary["stop_reason"]
    assert (root / "budget" / "checkpoints" / "0").is_dir()


@functools.partial(jax.jit, static_argnums=0)
def _both(cfg, params, tokens):
    out = forward_with_hiddens(cfg, params, tokens)
    return out.logits, mtp_head.forward_sequence(cfg, params, tokens, out.mtp_hidden(cfg.mtp_hidden_source))


def test_export_loads_back_with_the_trained_forward(setup, straight, tmp_path):
    _, c = setup
    out = T.export_default(tmp_path / "model", straight, command="python3 experiments/train.py (test)",
                           max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    cfg, params = load_pretrained(out)
    assert cfg == straight.model_cfg
    flat, trained = flatten(params), flatten(straight.state.params)
    assert set(flat) == set(trained) and any(n.startswith("mtp.") for n in flat)
    for name, w in flat.items():
        assert w.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(w), np.asarray(trained[name].astype(jnp.bfloat16)))
    tokens = jnp.asarray(counter_stream(2 * 24, seed=7).reshape(2, 24).astype(np.int32))
    got = _both(cfg, params, tokens)
    want = _both(cfg, straight.state.params, tokens)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(g - w)) < 0.05 * np.max(np.abs(w)) + 0.05
        assert np.mean(np.argmax(g, -1) == np.argmax(w, -1)) > 0.9
    card = (out / "README.md").read_text()
    assert f"steps: {STEPS} " in card and f"{straight.summary['heldout']['mtp_acc']:.4f}" in card
    # What `generate --mtp_vocab_size` reads: each id's count in the training stream.
    counts = np.load(out / "token_counts.npy")
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, np.bincount(np.load(pathlib.Path(c.data_dir) / "train.npy"), minlength=VOCAB))


def test_export_refuses_a_tokenizer_larger_than_the_vocab(straight, tmp_path):
    with pytest.raises(T.TrainError, match="vocab_size=64"):
        T.export_default(tmp_path / "m", straight, command="x",
                         tokenizer_path=ROOT / "assets" / "tokenizer" / "tokenizer.json")
    assert not (tmp_path / "m").exists()


def test_bad_data_is_refused_by_name(setup, tmp_path):
    _, c = setup
    np.save(tmp_path / "train.npy", np.full(200, VOCAB + 5, np.uint16))
    np.save(tmp_path / "heldout.npy", counter_stream(100, seed=3))
    with pytest.raises(T.TrainError, match=r"train\.npy: token id 69 is outside"):
        T.load_streams(tmp_path, VOCAB, 17)
    with pytest.raises(T.TrainError, match=r"heldout\.npy: 100 tokens, fewer than one window"):
        T.load_streams(tmp_path, 128, 101)
    with pytest.raises(T.TrainError, match="not ModelConfig fields"):
        T.load_model_config(c.model, {"hidden_sise": 8})


def test_fitted_horizon_shrinks_to_the_budget_and_never_grows():
    # 10 steps in 2 s: 5 steps/s. 3 s left from step 20 fit 15 more steps.
    assert T.fitted_horizon(20, 100, 10, 2.0, 3.0) == 35
    assert T.fitted_horizon(20, 30, 10, 2.0, 3.0) == 30  # the schedule ends first: kept
    assert T.fitted_horizon(20, 100, 10, 2.0, -5.0) == 21  # over budget: the next step still ends it
