"""experiments/harness.py: policies served side by side give what each gives alone."""

import numpy as np

from experiments import harness
from mtp.engine import EngineConfig
from mtp.speculative import SpecConfig
from tests.conftest import IdPrompts, agreeing_params, id_sessions, tiny_config


def test_interleaved_policies_serve_the_turns_each_serves_alone(monkeypatch):
    """Every config's turns (tokens, path, carry decisions, acceptance) equal its own
    sequential run's, and the groups reach the configs in a rotating order."""
    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, 3, 0.01)
    prompts = IdPrompts(np.random.default_rng(1).integers(1, 97, 70).tolist())
    sessions = id_sessions(5, 3, seed=4)
    spec = SpecConfig(verify_width=3, max_new_tokens=10)
    base = dict(max_context=256, num_pages=200, drafter_pages=200, marconi_min_tokens=64)
    ecfgs = {"blind": EngineConfig(policy="blind", **base), "carry": EngineConfig(policy="carry", **base),
             "multi_B2": EngineConfig(policy="carry", batch_slots=2, carry_slots=4, **base)}
    alone = {n: harness.index_turns(harness.run_policy(cfg, params, sessions, prompts, spec, e, n, 15))
             for n, e in ecfgs.items()}
    order = []
    real = harness.run_sessions
    monkeypatch.setattr(harness, "run_sessions", lambda eng, group, *a, **k: (
        order.append((eng.ecfg.policy, eng.ecfg.batch_slots, len(group))) or real(eng, group, *a, **k)))
    together = harness.run_policies_interleaved(cfg, params, sessions, prompts, spec, ecfgs, 15)
    keys = ("path", "cached_tokens", "drafter_prefilled", "drafter_adopted", "drafter_appended", "carry_outcome")
    for name, res in together.items():
        turns = harness.index_turns(res)
        assert turns.keys() == alone[name].keys()
        for k, r in turns.items():
            a = alone[name][k]
            assert r.output == a.output and r.stats.acceptance.counts() == a.stats.acceptance.counts()
            assert [getattr(r.stats, x) for x in keys] == [getattr(a.stats, x) for x in keys]
    timed = order[-9:]  # 3 groups of 2, 2 and 1 sessions, each served by all three configs
    assert [len_ for _, _, len_ in timed] == [2, 2, 2, 2, 2, 2, 1, 1, 1]
    firsts = [timed[i][:2] for i in (0, 3, 6)]
    assert firsts == [("blind", 1), ("carry", 1), ("carry", 2)]  # the first config rotates
