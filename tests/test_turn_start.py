"""One-shot generation and the serving engine start a turn the same way (`mtp.turn_start`)."""

import numpy as np

from mtp.generation import prepare_decode
from mtp.serving import Engine, EngineConfig, TurnRequest
from mtp.serving import state as serving_state
from mtp.speculative import SpecConfig
from tests.conftest import agreeing_params, tiny_config

SPEC = SpecConfig(verify_width=3, max_new_tokens=4)


def _rows(dcache, slot: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot ``slot``'s resident drafter rows, K and V in row order, read through its block table."""
    table, n = np.asarray(dcache.block_tables[slot]), int(dcache.rows[slot])
    k, v = np.asarray(dcache.kv.k[0]), np.asarray(dcache.kv.v[0])
    at = [(table[r // page_size], r % page_size) for r in range(n)]
    return np.stack([k[p, i] for p, i in at]), np.stack([v[p, i] for p, i in at])


def test_generation_starts_each_prompt_as_the_engine_starts_its_turn(monkeypatch):
    """For the same prompts, the decode loops of `prepare_decode` (a padded batch prefilled in
    one call) and of the engine (one slot per prompt, prefilled in aligned chunks, the last
    carrying the drafter prefill) start from the same first token, the same hidden and the same
    drafter rows (keys 0 .. L-2). The 70-token prompt spans two engine chunks."""
    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    params = agreeing_params(cfg, 3, 0.01)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 40, 70)]
    page_size = 16

    call = prepare_decode(cfg, params, prompts, SPEC, page_size=page_size)
    _, _, _, dcache, first, hidden = call.args[:6]
    generated = [(int(first[i]), np.asarray(hidden[i]), int(dcache.last_pair_key[i]), _rows(dcache, i, page_size))
                 for i in range(len(prompts))]

    served = {}
    loop = serving_state.speculative_loop

    def spy(cfg, params, cache, dcache, first, hidden, *rest):
        for slot in range(len(prompts)):
            served[slot] = (int(first[slot]), np.asarray(hidden[slot]), int(dcache.last_pair_key[slot]),
                            _rows(dcache, slot, page_size))
        return loop(cfg, params, cache, dcache, first, hidden, *rest)

    monkeypatch.setattr(serving_state, "speculative_loop", spy)
    eng = Engine(cfg, params, EngineConfig(policy="cold", batch_slots=len(prompts), page_size=page_size,
                                           max_context=128, num_pages=64, drafter_pages=64), SPEC)
    eng.run_wave([TurnRequest(f"s{i}", tuple(p), SPEC.max_new_tokens) for i, p in enumerate(prompts)])

    for slot, prompt in enumerate(prompts):
        (g_tok, g_hid, g_key, (g_k, g_v)), (s_tok, s_hid, s_key, (s_k, s_v)) = generated[slot], served[slot]
        assert g_tok == s_tok
        np.testing.assert_allclose(g_hid, s_hid, rtol=1e-5, atol=1e-5)
        assert g_key == s_key == len(prompt) - 2
        assert g_k.shape[0] == s_k.shape[0] == len(prompt) - 1
        np.testing.assert_allclose(g_k, s_k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g_v, s_v, rtol=1e-5, atol=1e-5)
    assert len({tok for tok, *_ in generated}) > 1  # the prompts start differently: the check can tell them apart
