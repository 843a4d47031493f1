"""The speculative loop's forced acceptance (`speculative_loop(synthetic_acceptance=...)`), a benchmark option."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtp.generation import generate, prepare_decode
from mtp.metrics import AcceptanceStats
from mtp.speculative import SpecConfig, speculative_loop
from tests.conftest import random_params, tiny_config

K = 4  # three drafts per verify step
MAX_NEW = 64


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config("tiny_moe")
    params = random_params(cfg, 3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (7, 12, 5, 9, 16, 3, 11, 8)]
    return cfg, params, prompts


def _run(setup, rate, seed=0):
    cfg, params, prompts = setup
    call = prepare_decode(cfg, params, prompts, SpecConfig(verify_width=K, max_new_tokens=MAX_NEW), seed=seed)
    _, _, toks, n, metrics = speculative_loop(*call.args, synthetic_acceptance=rate)
    toks, n = np.asarray(toks), np.asarray(n)
    return [toks[i, : n[i]].tolist() for i in range(len(n))], metrics


def test_rate_one_accepts_every_draft(setup):
    tokens, m = _run(setup, 1.0)
    steps, accepted = np.asarray(m.steps), np.asarray(m.accepted)
    assert (steps > 0).all()
    np.testing.assert_array_equal(accepted, (K - 1) * steps)
    np.testing.assert_array_equal(np.asarray(m.accepted_at_least)[:, -1], steps)
    # K tokens a step: the budget is reached in ceil((MAX_NEW - 1) / K) steps.
    np.testing.assert_array_equal(steps, -(-(MAX_NEW - 1) // K))
    assert all(len(t) == MAX_NEW for t in tokens)


def test_rate_zero_accepts_none_and_decodes_plain_greedy(setup):
    cfg, params, prompts = setup
    tokens, m = _run(setup, 0.0)
    assert int(np.asarray(m.accepted).sum()) == 0
    np.testing.assert_array_equal(np.asarray(m.steps), MAX_NEW - 1)  # one token a step
    # With nothing accepted, each step emits the verify's token at the last real token:
    # the target's greedy next token, so the turn is plain greedy decoding.
    plain = generate(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW), speculative=False)
    assert tokens == plain.tokens
    assert all(len(set(t)) > 3 for t in tokens)  # not a degenerate repeat


def test_rate_point_eight_matches_its_expected_acceptance_length(setup):
    alpha, d = 0.8, K - 1
    # Accepted drafts per step: the run of successes before the first failure, capped at d.
    p_at_least = alpha ** np.arange(1, d + 1)  # P(accepted >= i), i = 1..d
    p_exact = np.append(-np.diff(np.concatenate([[1.0], p_at_least])), p_at_least[-1])  # P(accepted = 0..d)
    mean = float(np.sum(np.arange(d + 1) * p_exact))
    var = float(np.sum((np.arange(d + 1) - mean) ** 2 * p_exact))
    steps = accepted = 0
    at_least = np.zeros(d)
    for seed in range(3):  # 8 sequences each: a few hundred verify steps
        _, m = _run(setup, alpha, seed)
        steps += int(np.asarray(m.steps).sum())
        accepted += int(np.asarray(m.accepted).sum())
        at_least += np.asarray(m.accepted_at_least).sum(axis=0)
    assert steps > 300
    stderr = np.sqrt(var / steps)
    stats = AcceptanceStats(steps=steps, draft_tokens=d * steps, accepted=accepted)
    assert abs(stats.mean_acceptance_length - (1 + mean)) < 4 * stderr, (stats.mean_acceptance_length, 1 + mean)
    # Each position's rate against alpha^i, within four binomial standard errors.
    bound = 4 * np.sqrt(p_at_least * (1 - p_at_least) / steps)
    assert np.all(np.abs(at_least / steps - p_at_least) < bound), (at_least / steps, p_at_least)


def test_rate_is_traced_one_compile_serves_every_rate(setup):
    cfg, params, prompts = setup
    call = prepare_decode(cfg, params, prompts, SpecConfig(verify_width=K, max_new_tokens=8))
    lowered = [speculative_loop.lower(*call.args, synthetic_acceptance=jnp.float32(r)).as_text() for r in (0.3, 0.9)]
    assert lowered[0] == lowered[1]
