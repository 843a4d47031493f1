"""The session experiments' shared pieces (`experiments/harness.py`)."""

from types import SimpleNamespace

import pytest
from absl import app

from experiments.harness import eos_id, lossless, session_subset


def test_session_subset_takes_a_prefix_or_all_and_names_a_bad_count():
    sessions = list("abcde")
    assert session_subset(sessions, 2, "num_sessions") == ["a", "b"]
    assert session_subset(sessions, -1, "num_sessions") == sessions
    assert session_subset(sessions, 9, "num_sessions") == sessions
    for bad in (0, -3):
        with pytest.raises(app.UsageError, match=rf"--config.num_preamble_only={bad}: .* -1 for all 5"):
            session_subset(sessions, bad, "num_preamble_only")


def _turns(outputs):
    return {key: SimpleNamespace(output=out) for key, out in outputs.items()}


def test_lossless_compares_the_turns_before_their_tokens():
    """A run that lost a turn used to raise KeyError in carry_ablation, discarding every run before it."""
    ref = _turns({("a", 0): [1, 2], ("a", 1): [3]})
    assert lossless(_turns({("a", 0): [1, 2], ("a", 1): [3]}), ref)
    assert not lossless(_turns({("a", 0): [1, 2]}), ref)  # a lost turn
    assert not lossless(_turns({("a", 0): [1, 2], ("a", 1): [3], ("b", 0): [4]}), ref)  # an extra one
    assert not lossless(_turns({("a", 0): [1, 2], ("a", 1): [4]}), ref)  # a different token


def test_eos_id_is_minus_one_where_the_checkpoint_names_none():
    assert eos_id(SimpleNamespace(eos_token_id=None)) == -1
    assert eos_id(SimpleNamespace(eos_token_id=0)) == 0  # id 0 is an id, not "none"


def test_interleaved_policies_serve_the_turns_each_serves_alone(monkeypatch):
    """Each config's timed engine serves the same waves (batch-mates included: sessions of
    uneven length make a batch-2 engine refill a freed slot) and the same turns (tokens,
    path, carry decisions, acceptance) as when it runs alone, and the engine that opens a
    round rotates."""
    import dataclasses

    import numpy as np

    from experiments import harness
    from mtp.serving import EngineConfig
    from mtp.speculative import SpecConfig
    from tests.conftest import IdPrompts, agreeing_params, id_sessions, tiny_config, turn_decisions

    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, 3, 0.01)
    prompts = IdPrompts(np.random.default_rng(1).integers(1, 97, 70).tolist())
    sessions = [dataclasses.replace(s, turns=s.turns[:n]) for s, n in zip(id_sessions(5, 3, seed=4), (3, 1, 2, 3, 2))]
    spec = SpecConfig(verify_width=3, max_new_tokens=10)
    base = dict(max_context=256, num_pages=200, drafter_pages=200, marconi_min_tokens=64)
    ecfgs = {"blind": EngineConfig(policy="blind", **base), "carry": EngineConfig(policy="carry", **base),
             "multi_B2": EngineConfig(policy="carry", batch_slots=2, carry_slots=4, **base)}
    name_of = {(e.policy, e.batch_slots): n for n, e in ecfgs.items()}
    waves = []  # (config name, session ids) of every wave a timed engine serves
    real_wave, real_precompile = harness.Engine.run_wave, harness.Engine.precompile

    def recording(self, requests):
        if getattr(self, "timed", False):
            waves.append((name_of[self.ecfg.policy, self.ecfg.batch_slots], tuple(r.session_id for r in requests)))
        return real_wave(self, requests)

    def marking(self):
        self.timed = True  # `_timed_engine` precompiles the engine it times, not the warm-up one
        return real_precompile(self)

    monkeypatch.setattr(harness.Engine, "run_wave", recording)
    monkeypatch.setattr(harness.Engine, "precompile", marking)
    alone = {n: harness.index_turns(harness.run_policy(cfg, params, sessions, prompts, spec, e, n, 11))
             for n, e in ecfgs.items()}
    alone_waves = {n: [w for c, w in waves if c == n] for n in ecfgs}
    assert ("s0", "s2") in alone_waves["multi_B2"]  # s1 ended after one turn and s2 took its slot
    # One wave per engine in turn, or each engine until one of its sessions ends: s0's three
    # turns, then s1's one (multi_B2's first wave holds both, and s1 ends there; its second
    # round takes two waves, until s0 and s2 end in the same wave).
    first_waves = {"wave": ["blind", "carry", "multi_B2", "carry", "multi_B2", "blind"],
                   "session": ["blind"] * 3 + ["carry"] * 3 + ["multi_B2", "carry", "multi_B2", "multi_B2", "blind"]}
    for stint, order in first_waves.items():
        waves.clear()
        together = harness.run_policies_interleaved(cfg, params, sessions, prompts, spec, ecfgs, 11, stint=stint)
        assert {n: [w for c, w in waves if c == n] for n in ecfgs} == alone_waves
        assert [c for c, _ in waves[:len(order)]] == order, stint
        for name, res in together.items():
            turns = harness.index_turns(res)
            assert turns.keys() == alone[name].keys()
            for k, r in turns.items():
                a = alone[name][k]
                assert r.output == a.output and r.stats.acceptance.counts() == a.stats.acceptance.counts()
                assert turn_decisions(r.stats) == turn_decisions(a.stats)
    with pytest.raises(ValueError, match="stint='turn'"):
        harness.run_policies_interleaved(cfg, params, sessions, prompts, spec, ecfgs, 11, stint="turn")
