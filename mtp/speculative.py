"""Decode loops: plain greedy decoding of the target, and MTP speculative decoding.

Both run a whole turn inside one ``jax.lax.while_loop`` over a batch of slots, so
the host is reached once per turn, not per token. The speculative step is

    propose (K-1 drafts) -> verify (one target forward over K tokens)
    -> accept (longest greedy match, or rejection sampling) -> commit target state
    -> trim drafter rows (-> refeed catch-up)

with ``K`` static per compile and the accepted count dynamic per slot (masking).

Invariant shared by both loops: the target cache holds every token of a slot
except the last emitted one (``last_token``), and ``last_hidden`` is the target's
hidden at the position that produced it. So the next drafter pair key is
``p0 = lengths - 1`` = ``(embed(last_token), last_hidden)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from flax import struct

from mtp.cache.state import TargetCache
from mtp.carry import mtp_rows_to_trim
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model import target
from mtp.model.params import Params
from mtp.model.prepared import PreparedParams
from mtp.mtp_head import DrafterCache, append_rows, draft_step
from mtp.ops.gdn_step import MAX_STEPS

MAX_VERIFY_WIDTH = MAX_STEPS  # the widest verify the loops are built and tested for: the verify kernels' unroll


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static knobs of one compiled decode loop (hashable: a jit static argument)."""

    verify_width: int = 2  # K: one verify over [last token, K-1 drafts]
    max_new_tokens: int = 128  # output buffer per slot
    temperature: float = 0.0  # 0 = greedy
    refeed_accepted: bool = False
    draft_conf_tau: float = 0.0  # D-Cut: stop a chain once its min top-1 prob < tau
    eos_id: int = -1  # -1 = no EOS
    # How the loop computes (kernel paths, GEMM layout, the loop's compiler options): `mtp.execution`.
    execution: ExecutionConfig = ExecutionConfig()
    # Rows per plain decode step. 1 is the fastest. XLA's GPU GEMMs pick their
    # algorithm by shape, so a row's bf16 result can depend on how many rows share
    # the call; with ``plain_width = verify_width`` the plain loop runs the verify's
    # shapes (one real token, the rest discarded), which makes its tokens bitwise
    # comparable with speculative decoding on a GPU (results/decode/decode_h200.md).
    plain_width: int = 1
    # At the turn's end, rewrite the drafter rows of the turn's output (pair keys L-1 .. L+n-2
    # of a prompt of L tokens and n output tokens) from the target's hiddens of the committed
    # positions, kept through the loop (one drafter append inside the same call). The drafter
    # the loop returns then holds the output's keys densely, each row exactly what a
    # whole-sequence drafter prefill writes for it: without refeed, the loop's own rows of the
    # accepted drafts after a step's first come from the drafter's hiddens, and each step leaves
    # a gap at the key of its first rejected draft. Only a drafter that outlives the call (the
    # engine's carry) gains from it; the engine sets it (`EngineConfig.rebuild_output_rows`).
    rebuild_output_rows: bool = False

    def __post_init__(self):
        if not 2 <= self.verify_width <= MAX_VERIFY_WIDTH:
            raise ValueError(f"verify_width K={self.verify_width} must be in 2..{MAX_VERIFY_WIDTH} "
                             f"(drafts D = K - 1 in 1..{MAX_VERIFY_WIDTH - 1})")
        if not 1 <= self.plain_width <= self.verify_width:
            raise ValueError(f"plain_width={self.plain_width} must be in 1..verify_width={self.verify_width}")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 <= self.draft_conf_tau < 1:
            raise ValueError(f"draft_conf_tau={self.draft_conf_tau} must be in [0, 1)")

    @property
    def num_drafts(self) -> int:
        return self.verify_width - 1


@struct.dataclass
class DecodeMetrics:
    """Per-slot acceptance counters with the serving definitions of DESIGN §2."""

    steps: jax.Array  # [B] verify steps
    draft_tokens: jax.Array  # [B] drafts proposed
    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    accepted_at_least: jax.Array  # [B, D] steps with >= i+1 accepted

    @classmethod
    def zeros(cls, batch: int, num_drafts: int) -> "DecodeMetrics":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, jnp.zeros((batch, max(num_drafts, 1)), jnp.int32))


@struct.dataclass
class LoopState:
    cache: TargetCache
    dcache: DrafterCache | None
    last_token: jax.Array  # [B]
    last_hidden: jax.Array  # [B, H] (per mtp_hidden_source)
    out: jax.Array  # [B, max_new] emitted tokens
    num_out: jax.Array  # [B]
    budget: jax.Array  # [B] max tokens this turn
    done: jax.Array  # [B]
    rng: jax.Array
    metrics: DecodeMetrics
    # [B, max_new, H] with `SpecConfig.rebuild_output_rows`, else None: entry j is the target's
    # hidden at the position of output token j - 1 (entry 0: the prefill's last), the hidden of
    # pair key L-1+j, which pairs it with output token j.
    out_hidden: jax.Array | None = None


def _put_after(buf: jax.Array, start: jax.Array, new: jax.Array, count: jax.Array) -> jax.Array:
    """``buf[b, start[b] + i] = new[b, i]`` for ``i < count[b]`` (entries past the buffer dropped)."""
    j = jnp.arange(new.shape[1])[None, :]
    cols = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])  # out of range -> dropped
    return buf.at[jnp.arange(new.shape[0])[:, None], cols].set(new.astype(buf.dtype), mode="drop")


def _emit(state: LoopState, new: jax.Array, count: jax.Array, eos_id: int):
    """Append ``new[b, :count[b]]`` to each slot's output, stopping at EOS and the budget.

    Returns ``(out, num_out, done, taken)``; ``taken[b]`` tokens were emitted.
    """
    n = new.shape[1]
    j = jnp.arange(n)[None, :]
    room = state.budget - state.num_out
    take = jnp.minimum(count, room)
    if eos_id >= 0:
        is_eos = (new == eos_id) & (j < take[:, None])
        first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, n + 1)
        take = jnp.minimum(take, first_eos)
        hit_eos = first_eos <= take
    else:
        hit_eos = jnp.zeros_like(state.done)
    take = jnp.where(state.done, 0, take)
    out = _put_after(state.out, state.num_out, new, take)
    num_out = state.num_out + take
    done = state.done | (num_out >= state.budget) | hit_eos
    return out, num_out, done, take


def _initial_state(cfg, cache, dcache, first_token, first_hidden, budget, spec: SpecConfig, rng, batch):
    out = jnp.zeros((batch, spec.max_new_tokens), jnp.int32)
    out_hidden = None
    if dcache is not None and spec.rebuild_output_rows:
        out_hidden = jnp.zeros((batch, spec.max_new_tokens, first_hidden.shape[-1]), first_hidden.dtype)
        out_hidden = out_hidden.at[:, 0].set(first_hidden)
    state = LoopState(cache=cache, dcache=dcache, last_token=first_token.astype(jnp.int32),
                      last_hidden=first_hidden, out=out, num_out=jnp.zeros((batch,), jnp.int32),
                      budget=jnp.minimum(budget, spec.max_new_tokens).astype(jnp.int32),
                      done=budget <= 0, rng=rng, metrics=DecodeMetrics.zeros(batch, spec.num_drafts),
                      out_hidden=out_hidden)
    # The first token came from prefill; it is output like any other.
    out, num_out, done, _ = _emit(state, first_token[:, None].astype(jnp.int32), jnp.ones((batch,), jnp.int32),
                               spec.eos_id)
    return state.replace(out=out, num_out=num_out, done=done)


def pick_token(logits: jax.Array, temperature: float, key) -> jax.Array:
    """Greedy at temperature 0, else a sample at that temperature."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


class DecodeLoop:
    """A decode loop, jitted once for each set of XLA options a ``spec`` asks for.

    ``jax.jit`` fixes compiler options when the jitted function is built, and a loop's come from
    its ``spec.execution.loop_compiler_options()`` (the CUDA-graph mode of the ``while_loop``).
    So each distinct set gets a jitted function of its own, built on first use and then kept, and
    a call or a ``lower`` goes to the one of its ``spec``: a config's options are read when its
    loop is traced, never at import. ``cfg`` and ``spec`` are statics.
    """

    def __init__(self, fn, donate: tuple[str, ...]):
        functools.update_wrapper(self, fn)
        self._fn, self._donate, self._signature = fn, donate, inspect.signature(fn)

    def jitted(self, spec: SpecConfig):
        """The jitted loop that serves ``spec``."""
        return _jit_loop(self._fn, self._donate, tuple(sorted(spec.execution.loop_compiler_options().items())))

    def _serving(self, args, kwargs):
        return self.jitted(self._signature.bind(*args, **kwargs).arguments["spec"])

    def __call__(self, *args, **kwargs):
        return self._serving(args, kwargs)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._serving(args, kwargs).lower(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _jit_loop(fn, donate: tuple[str, ...], options: tuple[tuple[str, str], ...]):
    return jax.jit(fn, static_argnames=("cfg", "spec"), donate_argnames=donate, compiler_options=dict(options))


# ------------------------------------------------------------------ plain greedy
@functools.partial(DecodeLoop, donate=("cache",))
def greedy_loop(cfg: ModelConfig, params: Params | PreparedParams, cache: TargetCache, first_token: jax.Array,
                budget: jax.Array, spec: SpecConfig, rng: jax.Array | None = None):
    """Plain decoding of the target (greedy, or sampled at ``spec.temperature``).

    ``params``: as `mtp.model.prepared.prepare_params` made them for ``spec.execution`` (a bare
    checkpoint dict computes the same tokens, making the derived tensors in every step).
    ``first_token [B]`` is the token the prefill produced; ``budget [B]`` the
    number of tokens to emit per slot (0 = idle). Returns ``(cache, out, num_out)``.
    """
    b = first_token.shape[0]
    rng = jax.random.key(0) if rng is None else rng
    state = _initial_state(cfg, cache, None, first_token, jnp.zeros((b, cfg.hidden_size), jnp.float32),
                           budget, spec, rng, b)

    def body(s: LoopState) -> LoopState:
        rng, key = jax.random.split(s.rng)
        rows = jnp.repeat(s.last_token[:, None], spec.plain_width, axis=1)  # row 0 is the real one
        # Finished slots run as padding and keep their states, so the commit needs no select
        # against the old ones (which copied every Gated DeltaNet state each step).
        cache, vout = target.verify(cfg, params, s.cache, rows, ~s.done, execution=spec.execution)
        cache = target.commit(cache, vout, jnp.where(s.done, 0, 1), masked_verify=True)
        nxt = pick_token(vout.logits[:, 0], spec.temperature, key)
        out, num_out, done, _ = _emit(s, nxt[:, None], jnp.ones_like(nxt), spec.eos_id)
        return s.replace(cache=cache, last_token=nxt, out=out, num_out=num_out, done=done, rng=rng)

    state = jax.lax.while_loop(lambda s: jnp.any(~s.done), body, state)
    return state.cache, state.out, state.num_out


# ------------------------------------------------------------------ speculative
def _propose(cfg, params, spec: SpecConfig, s: LoopState, active, draft_vocab, key):
    """K-1 chained drafts per slot. Returns drafts, their count after D-Cut, and q."""
    d = spec.num_drafts
    p0 = s.cache.lengths - 1
    dcache, tok, hidden = s.dcache, s.last_token, s.last_hidden
    drafts, qs, confs = [], [], []
    keys = jax.random.split(key, d)
    for i in range(d):
        dcache, logits, hidden = draft_step(cfg, params, dcache, tok, hidden.astype(s.last_hidden.dtype),
                                            p0 + i, active, spec.execution, draft_vocab)
        probs = jax.nn.softmax(logits / (spec.temperature or 1.0), axis=-1)
        local = pick_token(logits, spec.temperature, keys[i])
        tok = local if draft_vocab is None else draft_vocab[local]
        drafts.append(tok)
        qs.append(probs)
        confs.append(jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1))
    drafts = jnp.stack(drafts, axis=1)
    if spec.draft_conf_tau > 0:
        chain_min = jax.lax.cummin(jnp.stack(confs, axis=1), axis=1)
        num_drafted = jnp.sum(chain_min >= spec.draft_conf_tau, axis=1).astype(jnp.int32)
    else:
        num_drafted = jnp.full(drafts.shape[:1], d, jnp.int32)
    return dcache, drafts, num_drafted, jnp.stack(qs, axis=1)


def _accept_greedy(target_logits, drafts, num_drafted):
    tgt = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K]
    d = drafts.shape[1]
    ok = (drafts == tgt[:, :d]) & (jnp.arange(d)[None, :] < num_drafted[:, None])
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(tgt, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def _accept_synthetic(target_tokens, num_drafted, rate, key):
    """Forced acceptance, a benchmark option: each draft is accepted with probability ``rate``.

    The drafts' values are ignored: draft ``i`` passes an independent Bernoulli(``rate``) draw
    from the loop's PRNG, and the accepted run stops at the first failure (or at
    ``num_drafted``). Every other cost of a step stays real. The tokens emitted are the
    verify's own (``target_tokens``), the bonus included, so the turn still decodes the
    target, though not the target's greedy continuation once an accepted draft differs
    from it. Returns ``(accepted, bonus)`` as the real acceptance rules do.
    """
    b, d = target_tokens.shape[0], target_tokens.shape[1] - 1
    ok = (jax.random.uniform(key, (b, d)) < rate) & (jnp.arange(d)[None, :] < num_drafted[:, None])
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def _full_vocab(q, draft_vocab, vocab_size):
    if draft_vocab is None:
        return q
    return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., draft_vocab].set(q)


def _accept_sampled(target_logits, drafts, num_drafted, q, temperature, key, draft_vocab):
    """Rejection sampling (Leviathan et al. / Chen et al.): output ~ the target's distribution.

    Draft ``i`` is accepted with probability ``min(1, p_i(x) / q_i(x))``; at the first
    rejection the token is resampled from ``norm(max(p_i - q_i, 0))``; after ``n``
    acceptances the bonus is drawn from ``p_n``.
    """
    b, k, vocab = target_logits.shape
    d = drafts.shape[1]
    p = jax.nn.softmax(target_logits / temperature, axis=-1)
    q = _full_vocab(q, draft_vocab, vocab)
    ku, kr = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :d], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(ku, (b, d))
    ok = (u * q_d < p_d) & (jnp.arange(d)[None, :] < num_drafted[:, None])
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    # Residual at the stop position: after a rejection, max(p - q, 0); past the drafts, p itself.
    q_pad = jnp.concatenate([q, jnp.zeros((b, 1, vocab), q.dtype)], axis=1)
    q_stop = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    q_stop = jnp.where((accepted < num_drafted)[:, None], q_stop, 0.0)
    p_stop = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_stop - q_stop, 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_stop)
    bonus = jax.random.categorical(kr, jnp.log(resid), axis=-1).astype(jnp.int32)
    return accepted, bonus


def _accept(spec: SpecConfig, target_logits, drafts, num_drafted, q, draft_vocab, synthetic_acceptance,
            active, key):
    """Each slot's accepted drafts, bonus token and emitted row ``[B, D + 1]`` (``accepted + 1`` of it count).

    Greedy, sampled (``spec.temperature > 0``) or, for benchmarks, synthetic: then the verify's
    own tokens are emitted at a chosen acceptance rate (`speculative_loop`). An inactive slot
    accepts nothing.
    """
    b = drafts.shape[0]
    if synthetic_acceptance is not None:
        key, kt = jax.random.split(key)
        emitted = pick_token(target_logits, spec.temperature, kt)  # [B, K]: the verify's own tokens
        accepted, bonus = _accept_synthetic(emitted, num_drafted, synthetic_acceptance, key)
    elif spec.temperature == 0:
        accepted, bonus = _accept_greedy(target_logits, drafts, num_drafted)
    else:
        accepted, bonus = _accept_sampled(target_logits, drafts, num_drafted, q, spec.temperature, key,
                                          draft_vocab)
    accepted = jnp.where(active, accepted, 0)
    if synthetic_acceptance is None:
        emitted = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
        emitted = emitted.at[jnp.arange(b), accepted].set(bonus)
    return accepted, bonus, emitted


def _keep_drafter_rows(cfg, params, spec: SpecConfig, dcache: DrafterCache, s: LoopState, verify_tokens, hiddens,
                       active, num_drafted, accepted, p0):
    """The drafter after one verify: the rows the trim rule keeps, then (with refeed) the verified keys.

    This step's propose wrote keys ``p0 .. p0+D-1`` (rows for undrafted D-Cut positions
    included); ``s`` is the loop state before the step.
    """
    d = spec.num_drafts
    written = jnp.where(active, d, 0)
    trim = (d - num_drafted) + mtp_rows_to_trim(num_drafted, accepted, spec.refeed_accepted)
    trim = jnp.where(active, trim, 0)
    kept = written - trim
    dcache = dcache.trim(trim, jnp.where(kept > 0, p0 + kept - 1, s.dcache.last_pair_key))
    if not spec.refeed_accepted:
        return dcache
    # Catch-up: rebuild keys p0+kept .. p0+accepted from the target's true hiddens, i.e.
    # every key whose pair this verify made known (key p0+j reads verified token
    # t[p0+j+1] and the hidden at p0+j). That includes key p0+accepted, whose drafted
    # row went with the first rejected draft, if any (without refeed it stays a gap, one
    # per step), so with refeed the rows are dense: the keys a drafter prefill writes.
    seq_tokens = verify_tokens  # key p0+j reads t[p0+j+1] = verify_tokens[j]
    seq_hidden = jnp.concatenate([s.last_hidden[:, None].astype(hiddens.dtype), hiddens[:, :d]], axis=1)
    idx = jnp.clip(kept[:, None] + jnp.arange(d + 1)[None, :], 0, d)
    count = jnp.where(active, accepted - kept + 1, 0)
    return append_rows(cfg, params, dcache, jnp.take_along_axis(seq_tokens, idx, axis=1),
                       jnp.take_along_axis(seq_hidden, idx[..., None], axis=1), p0 + kept, count, execution=spec.execution)


def _count_step(m: DecodeMetrics, active, num_drafted, accepted, d: int) -> DecodeMetrics:
    """The metrics after one step of the active slots."""
    steps = active.astype(jnp.int32)
    return DecodeMetrics(
        steps=m.steps + steps,
        draft_tokens=m.draft_tokens + steps * num_drafted,
        accepted=m.accepted + accepted,
        accepted_at_least=m.accepted_at_least
        + (steps[:, None] * (accepted[:, None] > jnp.arange(max(d, 1))[None, :])).astype(jnp.int32),
    )


@functools.partial(DecodeLoop, donate=("cache", "dcache"))
def speculative_loop(cfg: ModelConfig, params: Params | PreparedParams, cache: TargetCache, dcache: DrafterCache,
                     first_token: jax.Array, first_hidden: jax.Array, budget: jax.Array,
                     spec: SpecConfig, rng: jax.Array | None = None,
                     draft_vocab: jax.Array | None = None,
                     synthetic_acceptance: jax.Array | float | None = None):
    """MTP speculative decoding of one turn for every slot of the batch.

    ``params`` as in `greedy_loop`, the MTP head's included (`mtp.mtp_head.quantize_head`).
    ``first_token [B]``/``first_hidden [B, H]``: the prefill's output token and the
    target hidden that produced it (per ``cfg.mtp_hidden_source``). The drafter
    cache must already hold whatever context the policy gave it (prefill, carry,
    or nothing); with ``spec.rebuild_output_rows`` the one returned holds the output's
    keys as a drafter prefill writes them. Returns ``(cache, dcache, out, num_out, metrics)``.

    ``synthetic_acceptance`` (benchmarks and tests only; None in real decoding): accept
    each draft with this probability whatever its value (`_accept_synthetic`), emitting
    the verify's own tokens, so the loop's speed can be measured at a chosen acceptance
    rate on a model whose drafter agrees with nothing (random weights). Propose, verify,
    commit and trim cost what they always do. A traced value: one compile serves every rate.
    """
    b = first_token.shape[0]
    d = spec.num_drafts
    rng = jax.random.key(0) if rng is None else rng
    dcache_rows, dcache_last_key, first_output_key = dcache.rows, dcache.last_pair_key, cache.lengths - 1
    state = _initial_state(cfg, cache, dcache, first_token, first_hidden, budget, spec, rng, b)

    def body(s: LoopState) -> LoopState:
        rng, kp, ka = jax.random.split(s.rng, 3)
        active = ~s.done
        p0 = s.cache.lengths - 1
        dcache, drafts, num_drafted, q = _propose(cfg, params, spec, s, active, draft_vocab, kp)
        verify_tokens = jnp.concatenate([s.last_token[:, None], drafts], axis=1)
        cache, vout = target.verify(cfg, params, s.cache, verify_tokens, active, execution=spec.execution)
        accepted, bonus, emitted = _accept(spec, vout.logits, drafts, num_drafted, q, draft_vocab,
                                           synthetic_acceptance, active, ka)
        out, num_out, done, taken = _emit(s, emitted, accepted + 1, spec.eos_id)
        # The cache keeps exactly the verified tokens that were emitted (the last one
        # excepted, as always): a turn cut short by its budget or EOS leaves no
        # accepted-but-unemitted token behind for a snapshot or the prefix cache. An active
        # slot emits at least one token, so the slots that keep none are the inactive ones.
        cache = target.commit(cache, vout, taken, masked_verify=True)
        hiddens = vout.mtp_hidden(cfg.mtp_hidden_source)
        dcache = _keep_drafter_rows(cfg, params, spec, dcache, s, verify_tokens, hiddens, active, num_drafted,
                                    accepted, p0)
        out_hidden = s.out_hidden
        if spec.rebuild_output_rows:  # the committed positions' hiddens: those of output keys num_out ..
            out_hidden = _put_after(out_hidden, s.num_out, hiddens, taken)
        new_hidden = jnp.take_along_axis(hiddens, accepted[:, None, None], axis=1)[:, 0]
        return s.replace(cache=cache, dcache=dcache,
                         last_token=jnp.where(active, bonus, s.last_token),
                         last_hidden=jnp.where(active[:, None], new_hidden.astype(s.last_hidden.dtype),
                                               s.last_hidden),
                         out=out, num_out=num_out, done=done, rng=rng, out_hidden=out_hidden,
                         metrics=_count_step(s.metrics, active, num_drafted, accepted, d))

    state = jax.lax.while_loop(lambda s: jnp.any(~s.done), body, state)
    dcache = state.dcache
    if spec.rebuild_output_rows:
        # Back to the rows the turn started with, then the output's keys L-1 .. L+n-2 in one
        # append: key L-1+j pairs output token j with the hidden before it.
        dcache = dcache.trim(dcache.rows - dcache_rows, dcache_last_key)
        dcache = append_rows(cfg, params, dcache, state.out, state.out_hidden, first_output_key, state.num_out,
                             execution=spec.execution)
    return state.cache, dcache, state.out, state.num_out, state.metrics
