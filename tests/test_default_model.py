"""The shipped default model: it loads, drafts well, and the carry keeps its context.

These run the real checkpoint in assets/default_model on a few evaluation turns, so
they check the claims the README makes about it, at CPU scale.
"""

import pathlib

import jax.numpy as jnp
import pytest

from mtp.checkpoint import load_pretrained
from mtp.data.sessions import load_preamble, load_sessions
from mtp.data.tokenizer import Tokenizer
from mtp.serving import Engine, EngineConfig, TextPrompts, run_sessions
from mtp.speculative import SpecConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "assets" / "default_model"


@pytest.fixture(scope="module")
def shipped():
    cfg, params = load_pretrained(CKPT, dtype=jnp.float32)
    tok = Tokenizer.load(CKPT / "tokenizer.json")
    sessions = load_sessions(ROOT / "assets" / "sessions" / "eval_sessions.jsonl")[:1]
    prompts = TextPrompts(tok, load_preamble(ROOT / "assets" / "sessions" / "preamble.txt"))
    return cfg, params, sessions, prompts


def _warm_acceptance(shipped, policy, turns=4, refeed=False):
    cfg, params, sessions, prompts = shipped
    sess = [s.__class__(s.session_id, s.source, s.turns[:turns]) for s in sessions]
    spec = SpecConfig(verify_width=2, max_new_tokens=128, eos_id=cfg.eos_token_id, refeed_accepted=refeed)
    eng = Engine(cfg, params, EngineConfig(policy=policy, max_context=2048, num_pages=1024, drafter_pages=1024,
                                           marconi_min_tokens=256), spec)
    res = run_sessions(eng, sess, prompts)
    warm = [r.stats for r in res[1:]]
    steps = sum(s.acceptance.steps for s in warm)
    return (sum(s.acceptance.accepted for s in warm) / steps if steps else None), res


def test_carry_recovers_what_the_blind_drafter_loses(shipped):
    carry, res_c = _warm_acceptance(shipped, "carry")
    blind, res_b = _warm_acceptance(shipped, "blind")
    assert [r.output for r in res_c] == [r.output for r in res_b]
    assert carry > blind + 0.05  # the blind drafter starts every restored warm turn empty
    for r in res_c[1:]:  # the carry appended only the tail the new turn added
        s = r.stats
        assert s.path == "restore" and s.carry_outcome == "adopted" and s.drafter_prefilled == 0
        assert 0 < s.drafter_appended <= s.prompt_len - s.drafter_adopted


def test_carry_matches_a_full_rebuild_when_rows_are_refed(shipped):
    """With refeed every drafter row comes from the target's true hidden, so the carried
    context is the rebuilt one, at a fraction of the TTFT. (Without refeed the trimmed
    keys of rejected drafts are gaps that a rebuild fills; that costs a few percent.)"""
    carry, res_c = _warm_acceptance(shipped, "carry", refeed=True)
    rebuild, res_r = _warm_acceptance(shipped, "rebuild", refeed=True)
    assert [r.output for r in res_c] == [r.output for r in res_r]
    assert carry >= 0.97 * rebuild
    assert all(r.stats.drafter_prefilled == r.stats.prompt_len - 1 for r in res_r[1:])
    assert sum(r.stats.prefilled_tokens for r in res_c[1:]) < 0.5 * sum(r.stats.prefilled_tokens for r in res_r[1:])


def test_first_draft_acceptance_with_cold_prefill(shipped):
    """Issue 6's goal, on the first turn of one session (cold drafter prefill, K = 2)."""
    _, res = _warm_acceptance(shipped, "cold", turns=1)
    acc = res[0].stats.acceptance
    assert acc.steps > 20
    assert acc.draft_acceptance_rate >= 0.5
