"""The routed-expert op (`mtp.ops.moe`) and the MoE layer built on it: both sparse forms equal a
dense all-experts oracle (values and gradients, plain and quantized experts), the model on many
experts decodes losslessly, and a decode step costs what its active experts cost."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.expert_scaling import decode_step_cost
from mtp import quant
from mtp.serving import Engine, EngineConfig, run_sessions
from mtp.ops import quantized
from mtp.generation import generate
from mtp.model import layers, target
from mtp.ops.moe import reference, routed_experts
from mtp.speculative import SpecConfig
from tests.conftest import IdPrompts, agreeing_params, id_sessions, paged_cache, random_params, tiny_config

F32 = jnp.float32


def dense_oracle(x, expert_ids, expert_weights, gate, up, down, shared=None):
    """Every expert on every row, weighted by a routing matrix that is zero off the selected experts,
    plus the shared expert's gated output (`reference.SharedExpert`): the MoE as it was computed
    before the op, kept only as this test's oracle."""
    dt = x.dtype
    w = lambda a: (a.dequantize() if hasattr(a, "dequantize") else a).astype(dt)
    g = jnp.einsum("nh,eih->nei", x, w(gate), preferred_element_type=F32).astype(dt)
    u = jnp.einsum("nh,eih->nei", x, w(up), preferred_element_type=F32).astype(dt)
    y = jnp.einsum("nei,ehi->neh", jax.nn.silu(g) * u, w(down), preferred_element_type=F32).astype(dt)
    experts = reference.num_experts(gate)
    routing = jnp.sum(jax.nn.one_hot(expert_ids, experts, dtype=F32) * expert_weights[..., None], axis=1)
    out = jnp.einsum("ne,neh->nh", routing, y.astype(F32))
    if shared is None:
        return out
    sg = jnp.dot(x, w(shared.gate).T, preferred_element_type=F32).astype(dt)
    su = jnp.dot(x, w(shared.up).T, preferred_element_type=F32).astype(dt)
    sy = jnp.dot(jax.nn.silu(sg) * su, w(shared.down).T, preferred_element_type=F32).astype(dt)
    return out + shared.weight[:, None] * sy.astype(F32)


def oracle_ffn(x, router, gate, up, down, shared=None, impl=None):
    """`mtp.ops.moe.moe_ffn` with its experts computed by the dense oracle (the routing is the op's)."""
    ids, weights = reference.route(router, x.shape[0], x.dtype)
    return dense_oracle(x, ids, weights, gate, up, down, shared=shared)


def _experts(seed, experts, hidden, inner, dtype=F32):
    k = jax.random.split(jax.random.key(seed), 3)
    gate = jax.random.normal(k[0], (experts, inner, hidden), F32) / np.sqrt(hidden)
    up = jax.random.normal(k[1], (experts, inner, hidden), F32) / np.sqrt(hidden)
    down = jax.random.normal(k[2], (experts, hidden, inner), F32) / np.sqrt(inner)
    return tuple(a.astype(dtype) for a in (gate, up, down))


def _routing(seed, rows, k, experts):
    """Distinct experts per row drawn from a skewed distribution: a few experts take many rows,
    most take none or one, so the groups are uneven and many are empty."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** 1.5
    p = rng.permutation(p / p.sum())
    ids = np.stack([rng.choice(experts, k, replace=False, p=p) for _ in range(rows)]).astype(np.int32)
    w = rng.uniform(0.05, 1.0, (rows, k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w / w.sum(axis=1, keepdims=True))


FORMS = {
    "gather": reference.routed_experts_gather,
    "segments": reference.routed_experts_segments,
    "segments_1_row_tiles": functools.partial(reference.routed_experts_segments, rows_per_tile=1),
    "segments_5_row_tiles": functools.partial(reference.routed_experts_segments, rows_per_tile=5),
    "op": routed_experts,
}


@pytest.mark.parametrize("experts, rows, k", [(64, 1, 4), (64, 7, 8), (256, 3, 10), (256, 48, 4), (128, 90, 2)])
@pytest.mark.parametrize("form", FORMS)
def test_sparse_forms_equal_the_dense_oracle(form, experts, rows, k):
    hidden, inner = 24, 12
    gate, up, down = _experts(rows + k, experts, hidden, inner)
    ids, w = _routing(experts + rows, rows, k, experts)
    x = jax.random.normal(jax.random.key(rows), (rows, hidden), F32)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=experts)
    assert (counts == 0).any()  # empty groups
    if rows * k > experts:
        assert counts.max() > 2  # and a group of several rows
    got = jax.jit(FORMS[form])(x, ids, w, gate, up, down)
    assert got.dtype == F32 and got.shape == (rows, hidden)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense_oracle(x, ids, w, gate, up, down)),
                               rtol=2e-5, atol=2e-6)


def test_the_op_switches_form_on_the_static_pair_count(monkeypatch):
    """Gather up to GATHER_MAX_PAIRS pairs, and never past the expert count; segments above."""
    used = []
    for name in ("routed_experts_gather", "routed_experts_segments"):
        orig = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _orig=orig, _name=name: used.append(_name) or _orig(*a))
    cap = reference.GATHER_MAX_PAIRS
    for experts, limit in ((4 * cap, cap), (cap // 4, cap // 4)):  # the limit is capped at the expert count
        gate, up, down = _experts(0, experts, 8, 4)
        for rows in (limit // 2, limit // 2 + 1):
            ids, w = _routing(rows, rows, 2, experts)
            routed_experts(jnp.ones((rows, 8)), ids, w, gate, up, down)
    assert used == ["routed_experts_gather", "routed_experts_segments"] * 2


@pytest.mark.parametrize("form", ["gather", "segments", "segments_5_row_tiles"])
def test_gradients_equal_the_dense_oracles(form):
    """Training differentiates through the op: in x, the routing weights and every expert weight
    (the unselected experts' gradients are zero, as the oracle's)."""
    experts, rows, k, hidden, inner = 64, 30, 4, 16, 8
    gate, up, down = _experts(3, experts, hidden, inner)
    ids, w = _routing(4, rows, k, experts)
    x = jax.random.normal(jax.random.key(5), (rows, hidden), F32)
    probe = jax.random.normal(jax.random.key(6), (rows, hidden), F32)
    loss = lambda f: lambda x, w, g, u, d: jnp.sum(f(x, ids, w, g, u, d) * probe)
    args = (x, w, gate, up, down)
    got = jax.jit(jax.grad(loss(FORMS[form]), argnums=range(5)))(*args)
    want = jax.jit(jax.grad(loss(dense_oracle), argnums=range(5)))(*args)
    for name, a, b in zip(("x", "expert_weights", "gate", "up", "down"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
    unused = np.setdiff1d(np.arange(experts), np.asarray(ids))
    assert unused.size and not np.asarray(got[2])[unused].any()


@pytest.mark.parametrize("form", ["gather", "segments"])
def test_bf16_keeps_the_roundings(form):
    """In bf16 both forms round where the oracle does: they agree to bf16's own precision."""
    gate, up, down = _experts(7, 64, 32, 16, jnp.bfloat16)
    ids, w = _routing(8, 40, 4, 64)
    x = jax.random.normal(jax.random.key(9), (40, 32), F32).astype(jnp.bfloat16)
    got = jax.jit(FORMS[form])(x, ids, w, gate, up, down)
    want = dense_oracle(x, ids, w, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
@pytest.mark.parametrize("form", ["gather", "segments"])
def test_quantized_experts_equal_the_oracle_on_their_dequantized_weights(mode, form):
    """The MTP head's quantized experts (`mtp.quant`, per expert): the op gathers the selected
    experts' codes and scales and dequantizes only those."""
    gate, up, down = _experts(10, 64, 32, 16)
    name = "mtp.layers.0.mlp.experts.{}_proj.weight"
    q = [quant.quantize(a, mode, name=name.format(p)) for a, p in ((gate, "gate"), (up, "up"), (down, "down"))]
    assert all(isinstance(a, quantized.Fp8Weight if mode == "fp8" else quantized.Nvfp4Weight) for a in q)
    ids, w = _routing(11, 20, 4, 64)
    x = jax.random.normal(jax.random.key(12), (20, 32), F32)
    got = jax.jit(FORMS[form])(x, ids, w, *q)
    want = dense_oracle(x, ids, w, *(quantized.dequantize(a) for a in q))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    # Genuinely quantized: the result is not what the unquantized experts give.
    assert not np.allclose(np.asarray(got), np.asarray(dense_oracle(x, ids, w, gate, up, down)), atol=1e-4)


@pytest.mark.parametrize("impl", ["auto", "reference", "pallas", "interpret"])
def test_every_impl_runs_the_reference_on_f32_inputs(impl):
    """The kernels (`mtp.ops.moe.mosaic`) take 16-bit inputs only: f32 ones go to the reference
    whatever ``impl`` says (tests/test_moe_kernels.py has the kernels' own dispatch)."""
    gate, up, down = _experts(13, 32, 16, 8)
    ids, w = _routing(14, 5, 3, 32)
    x = jax.random.normal(jax.random.key(15), (5, 16), F32)
    np.testing.assert_array_equal(np.asarray(routed_experts(x, ids, w, gate, up, down, impl=impl)),
                                  np.asarray(reference.routed_experts(x, ids, w, gate, up, down)))


def test_bad_inputs_are_named():
    gate, up, down = _experts(16, 8, 16, 4)
    ids, w = _routing(17, 3, 2, 8)
    x = jnp.ones((3, 16))
    cases = [
        ((x[None], ids, w, gate, up, down), r"x must be \[N, H\], got shape \(1, 3, 16\)"),
        ((x, ids.astype(F32), w, gate, up, down), r"expert_ids must be integer \[N=3, k\]"),
        ((x, ids, w.astype(jnp.bfloat16), gate, up, down), r"expert_weights must be float32 \(3, 2\)"),
        ((x, ids, w, gate[:, :, :8], up, down), r"gate and up must be \[E, I, H=16\], got gate \(8, 4, 8\)"),
        ((x, ids, w, gate, up, down[:4]), r"down must be \[E=8, H=16, I=4\], got \(4, 16, 4\)"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            routed_experts(*args)
    with pytest.raises(ValueError, match="impl"):
        routed_experts(x, ids, w, gate, up, down, impl="fast")


# ---------------------------------------------------------------- the MoE layer and the model
@pytest.fixture
def oracle_moe(monkeypatch):
    """`layers.moe` with its routed experts computed by the dense oracle."""
    def use():
        monkeypatch.setattr(layers, "moe_ffn", oracle_ffn)
    return use


@pytest.fixture(scope="module")
def many():
    cfg = tiny_config("tiny_moe_many")
    assert cfg.num_experts >= 64
    return cfg, random_params(cfg, seed=21)


@pytest.mark.parametrize("lead", [(3, 1), (3, 5), (2, 40)])  # decode, verify (K = 5), a prefill chunk
def test_the_layer_equals_the_dense_oracle_at_every_row_shape(many, oracle_moe, lead):
    cfg, params = many
    p = params["model"]["layers"]["0"]["mlp"]
    x = jax.random.normal(jax.random.key(sum(lead)), (*lead, cfg.hidden_size), F32)
    got = jax.jit(layers.moe, static_argnums=2)(p, x, cfg)
    oracle_moe()
    want = jax.jit(layers.moe, static_argnums=2)(p, x, cfg)
    assert got.shape == x.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_ragged_prefill_and_decode_equal_the_dense_oracles_forward(many, oracle_moe):
    """A ragged batch prefilled (the segments form) and decoded (the gather form) through the
    many-expert model gives the logits of the no-cache forward with the dense oracle's experts."""
    cfg, params = many
    b = 3
    toks = jax.random.randint(jax.random.key(22), (b, 24), 0, cfg.vocab_size)
    lens = np.array([16, 5, 11], np.int32)
    cache = paged_cache(cfg, b, blocks=8)
    cache, out = target.prefill(cfg, params, cache, toks[:, :16], jnp.zeros(b, jnp.int32), jnp.asarray(lens))
    steps = []
    for step in range(4):
        cache, o = target.decode(cfg, params, cache, toks[np.arange(b), lens + step][:, None])
        steps.append(np.asarray(o.logits[:, 0]))
    oracle_moe()
    ref = np.asarray(target.forward(cfg, params, toks))
    for i in range(b):
        np.testing.assert_allclose(np.asarray(out.logits[i, :lens[i]]), ref[i, :lens[i]], atol=3e-5)
    for step, logits in enumerate(steps):
        np.testing.assert_allclose(logits, ref[np.arange(b), lens + step], atol=3e-5)


def test_the_models_gradient_equals_the_dense_oracles(many, oracle_moe):
    """Training's gradient (next-token cross-entropy through `forward`) on the many-expert model,
    every parameter, as with the dense oracle's experts; the segments form runs (2 x 12 x 4 pairs)."""
    cfg, params = many
    toks = jax.random.randint(jax.random.key(27), (2, 13), 0, cfg.vocab_size)

    def loss(p):
        logits = target.forward(cfg, p, toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1))

    got = jax.jit(jax.grad(loss))(params)
    oracle_moe()
    want = jax.jit(jax.grad(loss))(params)
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    for path, w in flat_want:  # f32 summation orders differ; the recurrence amplifies them a little
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(flat_got[path]), w, rtol=1e-3, atol=2e-4 * np.abs(w).max(),
                                   err_msg=jax.tree_util.keystr(path))
    experts = np.asarray(got["model"]["layers"]["0"]["mlp"]["experts"]["gate_proj"]["weight"])
    assert np.abs(experts).sum() > 0


# ---------------------------------------------------------------- lossless on many experts
MAX_NEW = 12


@pytest.fixture(scope="module")
def agreeing_many():
    """The many-expert model with an untied head whose MTP head agrees with it often, not always."""
    cfg = tiny_config("tiny_moe_many").replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, seed=23, mixing=0.01)
    rng = np.random.default_rng(24)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (6, 15, 9)]
    base = generate(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW), speculative=False)
    assert all(len(set(t)) >= 3 for t in base.tokens), base.tokens
    return cfg, params, prompts, base.tokens


@pytest.mark.parametrize("verify_width", [2, 3, 4, 5])
def test_speculative_decoding_on_many_experts_is_token_identical(agreeing_many, verify_width):
    cfg, params, prompts, base = agreeing_many
    res = generate(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW, verify_width=verify_width))
    assert res.tokens == base
    assert 0 < res.stats.accepted < res.stats.draft_tokens, res.stats


@pytest.mark.parametrize("policy, verify_width", [("cold", 2), ("blind", 3), ("rebuild", 4), ("carry", 5)])
def test_every_drafter_policy_on_many_experts_is_token_identical(agreeing_many, policy, verify_width):
    """Each policy of the engine at a verify width of its own, so K = 2..5 all run through it too."""
    cfg, params = agreeing_many[:2]
    prompts = IdPrompts(np.random.default_rng(25).integers(1, 97, 40).tolist())
    sessions = id_sessions(2, 3, seed=26, max_new=8)
    kw = dict(max_context=192, num_pages=120, drafter_pages=120, marconi_min_tokens=32)
    plain = run_sessions(Engine(cfg, params, EngineConfig(policy="cold", speculative=False, **kw),
                                SpecConfig(max_new_tokens=8)), sessions, prompts)
    res = run_sessions(Engine(cfg, params, EngineConfig(policy=policy, **kw),
                              SpecConfig(max_new_tokens=8, verify_width=verify_width)), sessions, prompts)
    want = {(r.request.session_id, r.request.prompt): r.output for r in plain}
    assert len(res) == len(want) == 6
    assert all(want[(r.request.session_id, r.request.prompt)] == r.output for r in res)
    accepted = sum(r.stats.acceptance.accepted for r in res)
    drafted = sum(r.stats.acceptance.draft_tokens for r in res)
    assert 0 < accepted < drafted


# ---------------------------------------------------------------- cost follows the active experts
def _router_cost(cfg) -> dict:
    """The cost of one MoE layer's routing (`layers.router`, `reference.route`) for one row: its [E, H]
    logits, softmax and top-k follow the expert count by nature."""
    p = {"gate": {"weight": jax.ShapeDtypeStruct((cfg.num_experts, cfg.hidden_size), F32)}}
    x = jax.ShapeDtypeStruct((1, cfg.hidden_size), F32)

    def route(p, x, cfg):
        return reference.route(layers.router(p, x, cfg)[0], x.shape[0], x.dtype)
    return jax.jit(route, static_argnums=2).lower(p, x, cfg).compile().cost_analysis()


def _expert_cost(experts: int) -> dict:
    """The decode step's flops and bytes less what scales with E by nature: the routing, and the
    stacked expert weights' own size, which XLA's cost analysis charges in full to the gather
    that reads k of their experts."""
    cfg = tiny_config("tiny_moe").replace(num_experts=experts, num_experts_per_tok=2)
    step, router = decode_step_cost(cfg), _router_cost(cfg)
    moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))
    stacked = moe_layers * 3 * experts * cfg.moe_intermediate_size * cfg.hidden_size * 4
    return {"flops": step["flops"] - moe_layers * router["flops"],
            "bytes": step["bytes accessed"] - moe_layers * router["bytes accessed"] - stacked}


def test_a_decode_steps_cost_does_not_follow_the_expert_count(monkeypatch):
    """256 experts against 8, top-2 both: the compiled step's flops and bytes (less routing and
    the weights' own size) within 1.5x. The dense oracle in the op's place fails the same bound."""
    few, lots = _expert_cost(8), _expert_cost(256)
    for key in ("flops", "bytes"):
        assert 0 < lots[key] <= 1.5 * few[key], (key, few, lots)
    monkeypatch.setattr(layers, "moe_ffn", oracle_ffn)
    dense_few, dense_lots = _expert_cost(8), _expert_cost(256)
    jax.clear_caches()
    assert dense_lots["flops"] > 4 * dense_few["flops"], (dense_few, dense_lots)


def test_the_padded_stream_routes_only_its_real_rows(monkeypatch):
    """A batch-1 GPU step carries its residual stream padded with zero rows (`gemm_layout.stream_rows`); a
    zero row's router logits tie, so routing it would read k experts of its own. The layer hands the
    op the real rows alone, and the padding rows' output is zero."""
    cfg = tiny_config("tiny_moe")
    p = random_params(cfg, 3)["model"]["layers"]["0"]["mlp"]
    x = jax.random.normal(jax.random.key(4), (1, cfg.hidden_size), jnp.float32)
    padded = jnp.concatenate([x, jnp.zeros((3, cfg.hidden_size), x.dtype)])
    rows_seen = []
    real_op = layers.moe_ffn
    monkeypatch.setattr(layers, "moe_ffn", lambda x, *a, **k: rows_seen.append(x.shape[0]) or real_op(x, *a, **k))
    out = layers.moe(p, padded, cfg, real_rows=1)
    assert rows_seen == [1]
    np.testing.assert_allclose(out[:1], layers.moe(p, x, cfg), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[1:], np.zeros((3, cfg.hidden_size)))
