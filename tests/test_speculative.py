"""Speculative decoding is lossless, and its acceptance bookkeeping is right."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp import generation
from mtp import speculative as speculative_mod
from mtp.analysis import first_divergence
from mtp.execution import ExecutionConfig
from mtp.generation import generate, prepare_decode
from mtp.mtp_head import DrafterCache, draft_step, forward_sequence, quantize_head
from mtp.model import target
from mtp.model.params import flatten, unflatten
from mtp.speculative import SpecConfig
from mtp.turn_start import append_from_hiddens, drafter_rows
from tests.conftest import agreeing_params, random_params, tiny_config

MAX_NEW = 14
MIXING = 0.01  # `agreeing_params`: drafts are accepted and rejected in one run


def _agreeing(name, seed=11, mixing=MIXING):
    """A tiny config with an untied LM head (tied, `agreeing_params`'s target repeats its
    last token) and weights whose MTP head mostly agrees with the target."""
    cfg = tiny_config(name).replace(tie_word_embeddings=False)
    return cfg, agreeing_params(cfg, seed, mixing)


def _assert_both_outcomes(stats):
    """Some drafts were accepted and some rejected: a lossless check that means something."""
    assert 0 < stats.accepted < stats.draft_tokens, stats


def _assert_varied(tokens, at_least=3):
    assert all(len(set(t)) >= at_least for t in tokens), f"degenerate outputs {tokens}"


def _prompts(cfg, seed, lengths=(5, 17, 9)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, cfg.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def greedy_reference():
    out = {}
    for name in ("tiny_dense", "tiny_moe"):
        cfg, params = _agreeing(name)
        prompts = _prompts(cfg, 0)
        base = generate(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW), speculative=False)
        _assert_varied(base.tokens)
        out[name] = (cfg, params, prompts, base.tokens)
    return out


# Each value of every axis appears at least once; a full product would cost minutes of compiles.
# TAU cuts some chains of the agreeing head (top-1 probabilities of ~0.01-0.02 over 97 tokens)
# but not all of them: drafts are still proposed, accepted and rejected.
TAU = 0.013
CASES = [
    ("tiny_dense", dict(verify_width=2), "bf16", "post_norm"),
    ("tiny_dense", dict(verify_width=3, refeed_accepted=True), "fp8", "post_norm"),
    ("tiny_dense", dict(verify_width=4, draft_conf_tau=TAU), "nvfp4", "pre_norm"),
    ("tiny_moe", dict(verify_width=5, refeed_accepted=True, draft_conf_tau=TAU), "bf16", "pre_norm"),
    ("tiny_moe", dict(verify_width=3), "nvfp4", "post_norm"),
]


@pytest.mark.parametrize("name, knobs, quant, source", CASES)
def test_greedy_speculative_is_token_identical(greedy_reference, name, knobs, quant, source):
    cfg, params, prompts, base = greedy_reference[name]
    cfg = cfg.replace(mtp_hidden_source=source)
    spec = SpecConfig(max_new_tokens=MAX_NEW, **knobs)
    res = generate(cfg, params, prompts, spec, mtp_quant=quant)
    assert res.tokens == base
    s = res.stats
    _assert_both_outcomes(s)
    assert s.steps > 0 and s.draft_tokens <= s.steps * spec.num_drafts
    if spec.draft_conf_tau > 0:  # D-Cut stopped some chains, not all
        assert 0 < s.draft_tokens < s.steps * spec.num_drafts
    per = s.per_position
    assert all(a >= b for a, b in zip(per, per[1:]))


def test_prepare_decode_hands_over_the_loop_generate_runs(greedy_reference):
    """`prepare_decode` stops where `generate` calls its loop: running that call by hand gives
    `generate`'s tokens, plain and speculative (what count_kernels compiles is what runs)."""
    cfg, params, prompts, base = greedy_reference["tiny_dense"]
    for speculative, loop in ((False, speculative_mod.greedy_loop), (True, speculative_mod.speculative_loop)):
        call = prepare_decode(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW), speculative=speculative)
        assert call.loop is loop and call.prefill_s > 0
        out = call.loop(*call.args)
        toks, n = out[-3:-1] if speculative else out[1:]
        assert [t[:k].tolist() for t, k in zip(np.asarray(toks), np.asarray(n))] == base
        if speculative:
            metrics = out[-1]
            assert 0 < int(np.sum(metrics.accepted)) < int(np.sum(metrics.draft_tokens))


@pytest.mark.parametrize("name", ["tiny_moe"])
def test_eos_stops_speculative_where_it_stops_plain(greedy_reference, name):
    """EOS set to a token in the middle of sequence 0's plain output: the speculative loop
    stops every slot where the plain loop does, even when EOS is one of a step's accepted
    drafts (tokens accepted after it in that step must not be emitted)."""
    cfg, params, prompts, base = greedy_reference[name]
    eos = base[0][5]
    spec = SpecConfig(max_new_tokens=MAX_NEW, verify_width=4, eos_id=eos)
    plain = generate(cfg, params, prompts, spec, speculative=False).tokens
    assert plain[0] == base[0][:base[0].index(eos) + 1]
    for p, b in zip(plain, base):
        assert p == (b[:b.index(eos) + 1] if eos in b else b)
    res = generate(cfg, params, prompts, spec)
    assert res.tokens == plain
    _assert_both_outcomes(res.stats)


def test_first_divergence_finds_the_flip_and_the_targets_margin(greedy_reference):
    cfg, params, prompts, base = greedy_reference["tiny_dense"]
    assert first_divergence(cfg, params, prompts, base, base) is None
    got = [list(t) for t in base]
    got[1][4] = (got[1][4] + 1) % cfg.vocab_size
    d = first_divergence(cfg, params, prompts, got, base)
    assert (d["sequence"], d["token"], d["got"], d["want"]) == (1, 4, got[1][4], base[1][4])
    # The uncached forward agrees with the cached greedy loop: its argmax is the plain token,
    # and the gap is that token's margin over the runner-up.
    logits = target.forward(cfg, params, jnp.asarray([prompts[1] + base[1][:4]], jnp.int32))[0, -1]
    top2 = np.sort(np.asarray(logits, np.float32))[-2:]
    assert int(jnp.argmax(logits)) == base[1][4]
    assert d["top2_gap"] == pytest.approx(float(top2[1] - top2[0])) and d["top2_gap"] > 0
    # A run that stops early parts where it ends.
    short = [list(t) for t in base]
    short[2] = short[2][:6]
    d = first_divergence(cfg, params, prompts, short, base)
    assert (d["sequence"], d["token"], d["got"], d["want"]) == (2, 6, None, base[2][6])


def _scaled_head(cfg, seed: int, agree: bool, mixing: float = MIXING, hidden_gain: float = 0.0):
    """`agreeing_params` (mixers scaled by ``mixing``, so the target still reads its context),
    with the head's fc passing ``+embedding`` (agree) or ``-embedding`` (the opposite
    ranking), plus ``hidden_gain`` times the target hidden. With ``hidden_gain > 0`` the
    head's own layer keeps its unscaled output projections, so the drafter rows (built from
    the hiddens) shape its drafts."""
    flat = dict(flatten(agreeing_params(cfg, seed, mixing)))
    h = cfg.hidden_size
    eye = jnp.eye(h, dtype=jnp.float32)
    flat["mtp.fc.weight"] = jnp.concatenate([eye if agree else -eye, hidden_gain * eye], axis=1)
    if hidden_gain:
        raw = flatten(random_params(cfg, seed))
        for name, w in raw.items():
            if name.startswith("mtp.layers") and name.endswith(("o_proj.weight", "down_proj.weight")):
                flat[name] = w
    return unflatten(flat)


@pytest.mark.parametrize("agree", [True, False])
def test_agreeing_and_contradicting_heads_accept_some_and_none(agree):
    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    params = _scaled_head(cfg, 11, agree)
    prompts = _prompts(cfg, 0)
    spec = SpecConfig(verify_width=3, max_new_tokens=MAX_NEW)
    base = generate(cfg, params, prompts, spec, speculative=False)
    _assert_varied(base.tokens)
    res = generate(cfg, params, prompts, spec)
    assert res.tokens == base.tokens
    if agree:
        _assert_both_outcomes(res.stats)
    else:
        assert res.stats.accepted == 0 and res.stats.draft_tokens > 0


def test_append_chunks_cover_every_row_once_in_few_widths():
    from mtp.mtp_head import APPEND_BUCKETS, PREFILL_CHUNK, append_chunks

    for count in (0, 1, 63, 64, 65, 511, 512, 513, 1300):
        plan = append_chunks(count)
        assert [off for off, _ in plan] == [sum(w for _, w in plan[:i]) for i in range(len(plan))]
        assert sum(w for _, w in plan) >= count and all(w in APPEND_BUCKETS for _, w in plan)
        assert all(w == PREFILL_CHUNK for _, w in plan[:-1])  # only the last chunk is narrow
        if plan:  # the last chunk is the narrowest width that holds what is left
            left = count - plan[-1][0]
            assert plan[-1][1] == min(w for w in APPEND_BUCKETS if w >= left)
    assert append_chunks(10, chunk=4) == [(0, 4), (4, 4), (8, 4)]


def test_drafter_prefill_rows_equal_step_by_step_drafts():
    """Batch-filled drafter K/V equal what one draft step per pair key writes."""
    cfg = tiny_config("tiny_moe")
    params = random_params(cfg, seed=5)
    b, length = 2, 11
    toks = jax.random.randint(jax.random.key(1), (b, length), 0, cfg.vocab_size)
    hid = target.forward_with_hiddens(cfg, params, toks).hidden_post
    make = lambda: DrafterCache.create(cfg, b, 9, 4, 4, jnp.float32).replace(
        block_tables=jnp.asarray(np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)))
    batch = make()
    for rows in drafter_rows(toks, [0, 0], [length - 1, 6], chunk=4):
        batch = append_from_hiddens(cfg, params, batch, rows, hid, execution=ExecutionConfig())
    step = make()
    for k in range(length - 1):
        active = jnp.array([True, k < 6])
        step, logits, _ = draft_step(cfg, params, step, toks[:, k + 1], hid[:, k], jnp.full((b,), k), active,
                                     ExecutionConfig.everywhere("reference"))
        if k == length - 2:  # the last draft's logits equal the whole-sequence MTP forward
            ref = forward_sequence(cfg, params, toks, hid)
            np.testing.assert_allclose(logits[0], ref[0, k], atol=3e-5)
    np.testing.assert_array_equal(batch.rows, [length - 1, 6])
    np.testing.assert_array_equal(batch.last_pair_key, step.last_pair_key)
    for a, s in ((batch.kv.k[0], step.kv.k[0]), (batch.kv.v[0], step.kv.v[0])):
        np.testing.assert_allclose(a[1:], s[1:], atol=1e-5)


def test_refeed_catch_up_does_not_cost_acceptance():
    """Refeed drops accepted rows 2.. and rebuilds them from the target's true hiddens every
    step; with a head that reads those hiddens (through its fc and its drafter rows), the
    rebuilt rows accept at least as many drafts as keeping the drafter's own rows."""
    cfg = tiny_config("tiny_dense").replace(tie_word_embeddings=False)
    params = _scaled_head(cfg, 8, agree=True, hidden_gain=0.5)
    prompts = _prompts(cfg, 4)
    plain = generate(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW), speculative=False).tokens
    assert sum(len(set(t)) >= 9 for t in plain) >= 2, f"degenerate outputs {plain}"
    stats = {}
    for refeed in (False, True):
        res = generate(cfg, params, prompts, SpecConfig(verify_width=3, max_new_tokens=MAX_NEW,
                                                        refeed_accepted=refeed))
        assert res.tokens == plain
        _assert_both_outcomes(res.stats)
        stats[refeed] = res.stats
    assert stats[True].accepted >= stats[False].accepted, stats


@pytest.mark.parametrize("temperature", [0.8])
def test_rejection_sampling_keeps_the_target_distribution(temperature):
    """The first token after a one-step speculative decode is distributed as the target's."""
    from mtp.speculative import _accept_sampled

    vocab, d, n = 6, 2, 40000
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    target_logits = jax.random.normal(k1, (1, d + 1, vocab)) * 1.5
    q = jax.nn.softmax(jax.random.normal(k2, (1, d, vocab)) * 1.5, axis=-1)
    keys = jax.random.split(k3, n)

    def one(k):
        kd, ka = jax.random.split(k)
        drafts = jax.random.categorical(kd, jnp.log(q[0]), axis=-1)[None].astype(jnp.int32)
        acc, bonus = _accept_sampled(target_logits, drafts, jnp.array([d]), q, temperature, ka, None)
        first = jnp.where(acc[0] > 0, drafts[0, 0], bonus[0])
        return first, acc[0]

    first, acc = jax.vmap(one)(keys)
    freq = np.bincount(np.asarray(first), minlength=vocab) / n
    p = np.asarray(jax.nn.softmax(target_logits[0, 0] / temperature))
    np.testing.assert_allclose(freq, p, atol=0.01)
    assert 0 < float(jnp.mean(acc > 0)) < 1  # both branches were exercised


def test_bad_verify_width_is_a_clear_error():
    with pytest.raises(ValueError, match="verify_width K=9"):
        SpecConfig(verify_width=9)
    with pytest.raises(ValueError, match="plain_width=4"):
        SpecConfig(verify_width=3, plain_width=4)


def test_plain_loop_at_verify_width_decodes_the_same_tokens(greedy_reference):
    """The padded rows of a wide plain step are discarded: same tokens as one row per step."""
    cfg, params, prompts, base = greedy_reference["tiny_moe"]
    wide = generate(cfg, params, prompts, SpecConfig(max_new_tokens=MAX_NEW, verify_width=4, plain_width=4),
                    speculative=False)
    assert wide.tokens == base


@pytest.mark.parametrize("loop", ["plain", "plain_wide", "speculative"])
def test_a_finished_slot_keeps_its_state(greedy_reference, loop):
    """The loops run finished slots as padding and commit without a select against the old
    state: a slot that stops early ends with the cache of a run that stopped with it."""
    from mtp.turn_start import first_from_prefill
    from mtp.speculative import greedy_loop, speculative_loop
    from tests.conftest import paged_cache

    cfg, params = greedy_reference["tiny_dense"][:2]
    prompts = jnp.asarray(_prompts(cfg, 3, lengths=(6, 6)))
    accepted = []
    spec = SpecConfig(max_new_tokens=8, verify_width=3, plain_width=3 if loop == "plain_wide" else 1)
    ends = {}
    for budget in ([7, 2], [2, 2]):
        cache = paged_cache(cfg, 2, 8)
        cache, out = target.prefill(cfg, params, cache, prompts, jnp.zeros(2, jnp.int32), jnp.full(2, 6, jnp.int32),
                                    all_logits=False)
        first, hidden = first_from_prefill(out, jnp.full(2, 6, jnp.int32), cfg.mtp_hidden_source, 0.0,
                                           jax.random.key(0))
        budget = jnp.asarray(budget, jnp.int32)
        if loop == "speculative":
            dcache = paged_cache(cfg, 2, 8, cls=DrafterCache)
            cache, _, toks, n, metrics = speculative_loop(cfg, params, cache, dcache, first, hidden, budget, spec)
            accepted.append(int(np.sum(metrics.accepted)))
        else:
            cache, toks, n = greedy_loop(cfg, params, cache, first, budget, spec)
        ends[int(budget[0])] = (cache, np.asarray(toks), np.asarray(n))
    (long, toks_l, n_l), (short, toks_s, n_s) = ends[7], ends[2]
    assert list(n_l) == [7, 2] and list(n_s) == [2, 2]
    if loop == "speculative":
        assert accepted[0] > 0  # the long run's steps accepted drafts
    np.testing.assert_array_equal(toks_l[1, :2], toks_s[1, :2])
    assert int(long.lengths[1]) == int(short.lengths[1])
    for a, b in zip(jax.tree.leaves(long.linear), jax.tree.leaves(short.linear)):
        np.testing.assert_array_equal(a[1], b[1])  # slot 1 sat idle for the rest of the long run


def test_an_inactive_slot_keeps_its_state_at_every_verified_position():
    """`commit(masked_verify=True)` may take any position of an inactive slot: each is its old state."""
    cfg = tiny_config("tiny_dense")
    params = random_params(cfg, seed=2)
    from tests.conftest import paged_cache

    tokens = jnp.asarray(_prompts(cfg, 4, lengths=(5, 5)))
    cache, _ = target.prefill(cfg, params, paged_cache(cfg, 2, 4), tokens, jnp.zeros(2, jnp.int32),
                              jnp.full(2, 5, jnp.int32), all_logits=False)
    old = jax.tree.map(np.asarray, cache.linear)  # verify donates the cache
    _, vout = target.verify(cfg, params, cache, tokens[:, :3], jnp.array([True, False]))
    for steps, before in zip(vout.conv_steps + vout.rec_steps, old.conv + old.recurrent):
        for i in range(3):
            np.testing.assert_array_equal(steps[1, i], before[1])
            assert not np.allclose(steps[0, i], before[0])  # the active slot moved on


def test_reduced_draft_vocabulary_is_lossless_and_maps_back(greedy_reference):
    from mtp.mtp_head import draft_vocabulary

    cfg, params, prompts, base = greedy_reference["tiny_dense"]
    counts = np.random.default_rng(0).integers(0, 1000, cfg.vocab_size)
    vocab = draft_vocabulary(counts, 40)
    assert vocab.shape == (40,) and set(np.asarray(vocab)) == set(np.argsort(-counts, kind="stable")[:40])
    spec = SpecConfig(verify_width=3, max_new_tokens=MAX_NEW)
    res = generate(cfg, params, prompts, spec, draft_vocab=vocab)
    assert res.tokens == base
    assert res.stats.accepted > 0  # the drafts' local ids were mapped back to token ids
    # A reduced vocabulary that holds every token the target emits: a draft the full head gets
    # right (the target's argmax) stays its argmax over the subset, and some wrong ones are
    # ruled out, so acceptance does not drop.
    emitted = sorted({t for seq in base for t in seq})
    assert len(emitted) <= 40
    covering = draft_vocabulary(counts + 10_000 * np.isin(np.arange(cfg.vocab_size), emitted), 40)
    full = generate(cfg, params, prompts, spec)
    res = generate(cfg, params, prompts, spec, draft_vocab=covering)
    assert res.tokens == base
    _assert_both_outcomes(res.stats)
    assert res.stats.draft_acceptance_rate >= full.stats.draft_acceptance_rate > 0
    with pytest.raises(ValueError, match="mtp_vocab_size=200 must be in 1..97"):
        draft_vocabulary(counts, 200)


def test_the_draft_vocabularys_head_rows_are_gathered_once_per_call(greedy_reference):
    """A reduced draft vocabulary costs each draft ``V'`` rows of the LM head: XLA hoists the rows'
    gather out of the decode loop (and merges the drafts' gathers), so the compiled loop gathers
    them once, in its entry computation, for three drafts a step."""
    cfg, params, prompts, _ = greedy_reference["tiny_dense"]
    vocab = jnp.arange(0, 80, 2, dtype=jnp.int32)
    call = prepare_decode(cfg, params, prompts, SpecConfig(verify_width=4, max_new_tokens=8), draft_vocab=vocab)
    hlo = speculative_mod.speculative_loop.lower(*call.args).compile().as_text()
    computation, owners = None, []
    for line in hlo.splitlines():
        if line.strip() and not line.startswith(" "):
            computation = line.split("(")[0].split()[-1]
        if "gather(" in line and f"[40,1,{cfg.hidden_size}]" in line:
            owners.append(computation)
    assert len(owners) == 1, owners
    fusion = owners[0].lstrip("%")
    callers = [c for c, line in _computations_calling(hlo, fusion)]
    assert callers and all(c.startswith("ENTRY") for c in callers), callers


def _computations_calling(hlo: str, callee: str):
    """``(computation header, line)`` of each instruction of ``hlo`` that calls ``callee``."""
    header = None
    for line in hlo.splitlines():
        if line.strip() and not line.startswith(" "):
            header = line
        elif re.search(r"calls=%" + re.escape(callee) + r"\b", line):
            yield header, line


@pytest.mark.parametrize("gemm_layout", ["padded_merged", "merged_reduced"], indirect=True)
def test_gpu_gemm_layout_keeps_speculative_equal_to_plain(greedy_reference, gemm_layout):
    """``dense``'s row padding, merged projections and few-row products as reductions (each
    on by default on a GPU), forced on; the loops, on the weights merged at load
    (`mtp.model.prepared.prepare_params`), compile once."""
    from mtp import speculative

    cfg, params, prompts, base = greedy_reference["tiny_dense"]
    plain_spec = SpecConfig(max_new_tokens=MAX_NEW, execution=gemm_layout)
    plain = generate(cfg, params, prompts, plain_spec, speculative=False)
    assert plain.tokens == base
    spec = SpecConfig(max_new_tokens=MAX_NEW, verify_width=3, execution=gemm_layout)
    res = generate(cfg, params, prompts, spec)
    assert res.tokens == plain.tokens
    _assert_both_outcomes(res.stats)
    compiled = speculative.speculative_loop.jitted(spec)._cache_size()
    assert generate(cfg, params, prompts, spec).tokens == res.tokens
    assert speculative.speculative_loop.jitted(spec)._cache_size() == compiled  # the second call did not retrace
    compiled = speculative.greedy_loop.jitted(plain_spec)._cache_size()
    assert generate(cfg, params, prompts, plain_spec, speculative=False).tokens == base
    assert speculative.greedy_loop.jitted(plain_spec)._cache_size() == compiled


@pytest.mark.parametrize("gemm_layout", ["padded_merged"], indirect=True)
def test_the_loop_on_prepared_params_returns_what_it_returns_on_the_bare_dict(greedy_reference, gemm_layout):
    """The speculative loop on the weights merged at load (`prepare_decode`'s) returns, bit for bit,
    what it returns on the bare checkpoint dict, which merges in its steps; only the latter's
    program concatenates weights."""
    cfg, params, prompts, base = greedy_reference["tiny_dense"]
    spec = SpecConfig(max_new_tokens=MAX_NEW, verify_width=3, execution=gemm_layout)
    runs, concatenations = [], []
    for bare in (False, True):
        call = prepare_decode(cfg, params, prompts, spec)
        prepared = call.args[1]
        assert prepared.params is params and any(m.linear_attn is not None for m in prepared.merged)
        args = (cfg, params if bare else prepared, *call.args[2:])
        concatenations.append(call.loop.lower(*args).as_text().count("concatenate"))
        runs.append(jax.device_get(call.loop(*args)))
    assert runs[0][2].tolist() == runs[1][2].tolist()  # the tokens
    jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])
    assert concatenations[0] < concatenations[1]


def test_decode_loop_graph_options_are_valid_xla_options():
    options = lambda mode: ExecutionConfig(loop_graph=mode).loop_compiler_options()
    opts = options("1")
    assert "WHILE" in opts["xla_gpu_enable_command_buffer"].split(",")
    # XLA rejects an unknown field or value when it compiles, on every backend.
    assert float(jax.jit(lambda x: x + 1, compiler_options=opts)(1.0)) == 2.0
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_no_such_option": "1"})(1.0)
    graphs_only = options("while")  # the graphs, XLA's own scheduling
    assert graphs_only == {k: v for k, v in opts.items() if k != "xla_gpu_command_buffer_scheduling_mode"}
    assert float(jax.jit(lambda x: x + 1, compiler_options=graphs_only)(1.0)) == 2.0
    assert options("0") == {}
    assert ExecutionConfig.from_environ({}).loop_compiler_options() == opts  # the default: the graphs
    with pytest.raises(ValueError, match="MTP_DECODE_LOOP_GRAPH='on'"):
        ExecutionConfig.from_environ({"MTP_DECODE_LOOP_GRAPH": "on"})


def test_each_loop_graph_mode_jits_its_own_loop(greedy_reference):
    """The loops' compiler options come from the spec's config when the loop is built, not at
    import: two modes are two jitted loops, each built once, and both decode the same tokens."""
    from mtp import speculative

    cfg, params, prompts, base = greedy_reference["tiny_dense"]
    specs = [SpecConfig(max_new_tokens=MAX_NEW, execution=ExecutionConfig(loop_graph=m)) for m in ("1", "0")]
    assert speculative.greedy_loop.jitted(specs[0]) is not speculative.greedy_loop.jitted(specs[1])
    assert speculative.greedy_loop.jitted(specs[1]) is speculative.greedy_loop.jitted(
        SpecConfig(max_new_tokens=1, execution=ExecutionConfig(loop_graph="0")))  # options alike: one loop
    for spec in specs:
        assert generate(cfg, params, prompts, spec, speculative=False).tokens == base


def test_generate_names_missing_and_empty_prompts():
    cfg = tiny_config("tiny_dense")
    params = random_params(cfg, seed=0)
    with pytest.raises(ValueError, match="no prompts"):
        generate(cfg, params, [], SpecConfig())
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        generate(cfg, params, [[1, 2], []], SpecConfig())


def test_generate_names_prompt_ids_outside_the_vocabulary():
    cfg = tiny_config("tiny_dense")
    params = random_params(cfg, seed=0)
    for bad in (-1, cfg.vocab_size):
        with pytest.raises(ValueError, match=rf"prompt 1 has token id {bad} outside the vocabulary \[0, 97\)"):
            generate(cfg, params, [[1, 2], [3, bad, 4]], SpecConfig())


def test_position_limit_counts_the_prompt_not_its_bucket():
    """A 449-token prompt is prefilled as 512 padded rows, yet its positions are 0..448: with
    N new tokens the last step starts on 449 + N - 2 cached positions and adds its rows."""
    cfg = tiny_config("tiny_dense")
    assert cfg.max_position_embeddings == 512
    params = random_params(cfg, seed=0)
    prompt = [[1] * 449]
    with pytest.raises(ValueError, match=r"prompt 0 \(449 tokens\) with max_new_tokens=63 runs the model at 513 "
                                         r"positions \(3-row decode steps\), more than max_position_embeddings=512"):
        prepare_decode(cfg, params, prompt, SpecConfig(max_new_tokens=63, verify_width=3))
    with pytest.raises(ValueError, match=r"max_new_tokens=65 runs the model at 513 positions \(1-row"):
        prepare_decode(cfg, params, prompt, SpecConfig(max_new_tokens=65, verify_width=3), speculative=False)
    assert prepare_decode(cfg, params, prompt, SpecConfig(max_new_tokens=32), speculative=False).prefill_s > 0


def test_prefill_s_leaves_out_the_heads_load_time_work(greedy_reference, monkeypatch):
    cfg, params, prompts, _ = greedy_reference["tiny_dense"]
    spec = SpecConfig(max_new_tokens=MAX_NEW)
    prepare_decode(cfg, params, prompts, spec)  # compiled: what is timed below is the prefills' run
    load_s = 1.0

    def slow_quantize_head(*args, **kwargs):
        time.sleep(load_s)
        return quantize_head(*args, **kwargs)

    monkeypatch.setattr(generation, "quantize_head", slow_quantize_head)
    assert prepare_decode(cfg, params, prompts, spec).prefill_s < load_s


def test_sampled_decoding_is_distributed_as_the_target_token_by_token():
    """The whole loop at a temperature: each of the first three output tokens of plain and of
    speculative decoding (K = 3, with and without refeed) follows the target's exact marginal,
    computed from every two-token continuation (chi-square over 4,096 sequences; fixed seeds,
    so the check is deterministic). The drafts are both accepted and rejected."""
    cfg = tiny_config("tiny_dense")
    params = agreeing_params(cfg, 11, 0.01)
    temperature, batch, seeds, v = 0.04, 256, 16, cfg.vocab_size
    prompt = np.random.default_rng(0).integers(1, v, 7).tolist()
    pairs = jnp.asarray([prompt + [a, b] for a in range(v) for b in range(v)], jnp.int32)
    probs = np.asarray(jax.nn.softmax(target.forward(cfg, params, pairs)[:, -3:] / temperature, axis=-1), np.float64)
    p0 = probs[0, 0]  # [v]: after the prompt
    p1 = probs[::v, 1]  # [a, v]: after prompt + a
    p2 = probs[:, 2].reshape(v, v, v)  # [a, b, v]: after prompt + a + b
    marginals = [p0, p0 @ p1, np.einsum("a,ab,abc->c", p0, p1, p2)]

    def chi_square(samples, p):
        """Cells expected fewer than 5 times pooled into one, so mass leaking into them still counts."""
        expected, observed = p * samples.size, np.bincount(samples, minlength=v)
        rare = expected < 5
        e, o = expected[~rare], observed[~rare]
        if rare.any():
            e, o = np.append(e, expected[rare].sum()), np.append(o, observed[rare].sum())
        stat = ((o - e) ** 2 / e).sum()
        return stat, e.size - 1

    for name, spec, speculative in [
            ("plain", SpecConfig(max_new_tokens=3, temperature=temperature), False),
            ("K=3", SpecConfig(max_new_tokens=3, temperature=temperature, verify_width=3), True),
            ("K=3 refeed", SpecConfig(max_new_tokens=3, temperature=temperature, verify_width=3,
                                      refeed_accepted=True), True)]:
        runs = [generate(cfg, params, [prompt] * batch, spec, speculative=speculative, seed=s) for s in range(seeds)]
        tokens = np.array([t for r in runs for t in r.tokens])  # [seeds * batch, 3]
        for i, p in enumerate(marginals):
            stat, df = chi_square(tokens[:, i], p)
            assert stat < df + 5 * np.sqrt(2 * df), f"{name}, token {i}: chi-square {stat:.1f} on {df} dof"
        if speculative:
            acc = sum((r.stats for r in runs), runs[0].stats.__class__())
            assert 0 < acc.accepted < acc.draft_tokens, (acc.accepted, acc.draft_tokens)
