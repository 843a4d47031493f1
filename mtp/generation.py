"""One-shot batched generation: prompts in, tokens and acceptance metrics out.

This is the host side of a single turn with no prefix reuse: allocate pages,
prefill the target (capturing every position's hidden), start the turn from that
prefill (`mtp.turn_start.start_turn`: the first token and the drafter rows from those
hiddens, as the multi-turn session engine `mtp.serving` starts each of its turns), then
run one jitted decode loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp import quant, sharding
from mtp.cache.pages import PageAllocator, block_table_row
from mtp.cache.state import TargetCache
from mtp.config import ModelConfig
from mtp.metrics import AcceptanceStats
from mtp.model import target
from mtp.model.params import Params
from mtp.model.prepared import prepare_params
from mtp.mtp_head import DrafterCache, quantize_head
from mtp.speculative import SpecConfig, greedy_loop, speculative_loop
from mtp.turn_start import drafter_rows, start_turn

PREFILL_BUCKET = 64  # prompt lengths are padded to a multiple of this: few compiles


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]
    stats: AcceptanceStats | None  # the whole batch; None for plain decoding
    per_sequence: list[AcceptanceStats] | None = None
    prefill_s: float = 0.0  # wall time to the first token (target + drafter prefill)
    decode_s: float = 0.0  # wall time of the decode loop


def bucket(n: int, multiple: int = PREFILL_BUCKET) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def positions_reached(prompt_len: int, max_new: int, width: int) -> int:
    """How many positions a sequence runs the model at, ``width`` rows per decode step.

    The last emitted token is never fed back, and the last step starts with at most
    ``max_new - 1`` tokens out, so ``prompt_len + max_new - 2`` positions are cached, and
    that step's ``width`` rows (last token, drafts or padding) go on top. With
    ``max_new <= 1`` the prefill's token is all the output: no step runs.
    """
    return prompt_len + (max_new + width - 2 if max_new > 1 else 0)


def pad_batch(seqs: Sequence[Sequence[int]], length: int) -> np.ndarray:
    out = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


@dataclasses.dataclass
class DecodeCall:
    """A batch after its prefill, its decode loop not yet run: ``loop(*args)`` is the call
    `generate` makes next. Tools that compile or profile the loop alone
    (`experiments/count_kernels.py`, `experiments/bench_decode.py --loop_profile`) start from here.
    """
    loop: Callable  # `speculative.greedy_loop` or `speculative.speculative_loop`, jitted
    args: tuple
    prefill_s: float  # wall time to the first token (target + drafter prefill)


def prepare_decode(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], spec: SpecConfig,
                   *, speculative: bool = True, drafter_prefill: bool = True, mtp_quant: str = "bf16",
                   page_size: int = 16, seed: int = 0, draft_vocab=None, mesh: Mesh | None = None) -> DecodeCall:
    """Everything `generate` does before its decode loop: pages, caches, the target's prefill
    and (speculative) the drafter's; the arguments as `generate` documents them."""
    with sharding.on_mesh(mesh):
        if not prompts:
            raise ValueError("no prompts: generate needs at least one")
        if empty := [i for i, p in enumerate(prompts) if len(p) == 0]:
            raise ValueError(f"every prompt needs at least one token; prompts {empty} are empty")
        if speculative and not cfg.has_mtp:
            raise ValueError("speculative decoding needs a checkpoint with an MTP head (num_nextn_predict_layers=1)")
        for i, p in enumerate(prompts):
            if bad := [tok for tok in p if not 0 <= tok < cfg.vocab_size]:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        b = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        longest = int(np.argmax(lengths))
        width = spec.verify_width if speculative else spec.plain_width
        reach = positions_reached(int(lengths[longest]), spec.max_new_tokens, width)
        if reach > cfg.max_position_embeddings:
            raise ValueError(f"prompt {longest} ({lengths[longest]} tokens) with max_new_tokens={spec.max_new_tokens} "
                             f"runs the model at {reach} positions ({width}-row decode steps), more than "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        t = bucket(int(lengths.max()))
        blocks = math.ceil((t + spec.max_new_tokens + spec.verify_width + 1) / page_size)
        dtype = params["model"]["embed_tokens"]["weight"].dtype
        pool = PageAllocator(b * blocks + 1, page_size, "target")
        tables = np.stack([block_table_row(pool.allocate(blocks), blocks) for _ in range(b)])

        def new_cache(cls):
            args = (b, pool.num_pages, page_size, blocks, dtype)
            cache = sharding.create_cache(cls, cfg, mesh, *args)
            return cache.replace(block_tables=jnp.asarray(tables))

        cache = new_cache(TargetCache)
        # Load-time work (quantization, the derived tensors, and their compiles), kept out of prefill_s.
        head_params = jax.block_until_ready(prepare_params(quantize_head(params, mtp_quant) if speculative else params,
                                                           spec.execution, drafting=speculative))
        rng = jax.random.key(seed)
        rng, k0 = jax.random.split(rng)
        t0 = time.perf_counter()
        tokens = jnp.asarray(pad_batch(prompts, t))
        zeros = jnp.zeros((b,), jnp.int32)
        cache, out = target.prefill(cfg, params, cache, tokens, zeros, jnp.asarray(lengths), execution=spec.execution,
                                    all_logits=False)
        dcache = new_cache(DrafterCache) if speculative else None
        # Every prompt starts at key 0 and fills keys 0 .. L-2: the engine's cold turn, batched.
        appends = (drafter_rows(tokens, np.zeros_like(lengths), np.maximum(lengths - 1, 0))
                   if speculative and drafter_prefill and quant.supports_drafter_prefill(mtp_quant) else [])
        first, hidden, dcache = start_turn(cfg, head_params, out, jnp.asarray(lengths),
                                           out.mtp_hidden(cfg.mtp_hidden_source), dcache, appends,
                                           temperature=spec.temperature, key=k0, execution=spec.execution)
        budget = jnp.full((b,), spec.max_new_tokens, jnp.int32)
        if not speculative:
            return DecodeCall(greedy_loop, (cfg, head_params, cache, first, budget, spec, rng), _ready_at(first) - t0)
        return DecodeCall(speculative_loop, (cfg, head_params, cache, dcache, first, hidden, budget, spec, rng,
                                             draft_vocab), _ready_at((first, dcache.rows)) - t0)


def generate(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], spec: SpecConfig,
             *, speculative: bool = True, drafter_prefill: bool = True, mtp_quant: str = "bf16",
             page_size: int = 16, seed: int = 0, draft_vocab=None, mesh: Mesh | None = None) -> GenerationResult:
    """Generate for a batch of prompts; ``speculative=False`` is plain decoding of the target.

    With ``mesh`` (params already laid out by `mtp.sharding`), the caches are created in
    their shards on it (`sharding.create_cache`) and the loops run partitioned, traced
    under ``jax.set_mesh`` so that the Pallas kernels run per shard.
    """
    call = prepare_decode(cfg, params, prompts, spec, speculative=speculative, drafter_prefill=drafter_prefill,
                          mtp_quant=mtp_quant, page_size=page_size, seed=seed, draft_vocab=draft_vocab, mesh=mesh)
    with sharding.on_mesh(mesh):
        t1 = time.perf_counter()
        if speculative:
            _cache, _dcache, toks, n, metrics = call.loop(*call.args)
        else:
            _cache, toks, n = call.loop(*call.args)
        toks, n = jax.block_until_ready((toks, n))
        decode_s = time.perf_counter() - t1
    if not speculative:
        return GenerationResult(_to_lists(toks, n), None, prefill_s=call.prefill_s, decode_s=decode_s)
    per_sequence = [AcceptanceStats.from_metrics(metrics, [i]) for i in range(len(prompts))]
    return GenerationResult(_to_lists(toks, n), AcceptanceStats.from_metrics(metrics), per_sequence,
                            prefill_s=call.prefill_s, decode_s=decode_s)


def _ready_at(tree) -> float:
    """The host clock once ``tree``'s device work has finished."""
    jax.block_until_ready(tree)
    return time.perf_counter()


def _to_lists(toks, n) -> list[list[int]]:
    toks, n = np.asarray(toks), np.asarray(n)
    return [toks[i, : n[i]].tolist() for i in range(len(n))]
