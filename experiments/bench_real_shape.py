r"""The model family at its real shapes on one GPU, random weights, every figure a ratio of one run.

    PYTHONPATH=. python3 -m experiments.bench_real_shape --config.out_dir=$OUT
    python -m experiments.bench_real_shape --config.model=tiny      # the same on a CPU, small configs

JAX's memory pool grows on demand (`grow_memory_pool_on_demand`: the peer's torch and the 80B's
weights need the room a preallocated pool would hold); ``ml_collections`` and, for the peer's fast path, ``fla-core`` and
``flash-linear-attention`` must be importable (pure-Python wheels: `pip install flash-linear-attention`).

Models (`configs/models/`, each the published ``config.json``; `configs/models/real_shapes.md` says
where each value comes from): Qwen3.5-35B-A3B (40 layers, 256 experts, top-8 + a shared expert),
Qwen3-Next-80B-A3B (512 experts, top-10 + shared) at the depth whose bf16 weights fit on the device
(``--config.fit_memory_gib``), Qwen3.5-27B (dense, 64 layers), all in bf16 with their MTP head.
``--config.model=fp8`` runs Qwen3-Next-80B-A3B in Qwen's block-scaled FP8 (`ModelSpec`) at all 48
layers with every measurement, then its bf16 and FP8 forms at the depth bf16 fits, decode side by
side: what 8-bit weights buy at one shape.

Weights are random, made on the device one layer at a time by a jitted init (a seed fixes them; the
host never holds them), and every program takes them as arguments, never as closed-over constants.
The peer runs first, while the process's JAX memory pool is still small (JAX keeps the memory it
has grown to). Programs are compiled ahead of time, several at once in threads
(``--config.compile_workers``), in three phases: the plain decode loop's compile alone (the compile
time reported); the first model's programs, after which its goals' rows (decode at batch 1, verify
at K = ``--config.spec_k``, both loops) are timed with nothing compiling; then the other models'
programs compile while the first model's other rows and the other models run. A row timed while
compiles were in flight says so (``compiles_in_flight``; "while compiling" in the table).

What is measured, each against a floor measured in the same run:

* the ceilings: device copy bandwidth (bytes read + written per second) and a bf16 GEMM's FLOP/s;
* the plain decode step at each batch of ``--config.batches`` (every model), against its
  active-bytes floor: the bytes the step must read (dense weights, the LM head, the routed experts
  that the step's own routing selects, counted once per layer however many tokens select them, the
  KV of ``--config.context`` positions, the Gated DeltaNet states read, and written once per
  position) over the copy bandwidth. The routing is read from the timed program itself (`routing_of`);
* verify at each K of ``--config.verify_widths`` (batch 1, the first model) against decode, with the
  distinct experts each verify touches: the MoE verify-cost curve;
* the propose step (one MTP draft), against decode and its own active-bytes floor;
* a prefill chunk's tokens/s against the FLOP floor of its active weights (every dense GEMM, the
  shared expert and each token's top-k routed experts; attention's score FLOPs excluded) at the
  measured GEMM rate (every model);
* the plain greedy loop (`speculative.greedy_loop`, batch 1): its compile time and ms a token;
* the speculative loop (K = ``--config.spec_k``, batch 1) with a forced acceptance: each draft is
  accepted with probability alpha (``--config.alphas``) whatever it is
  (`speculative_loop(synthetic_acceptance=alpha)`). The acceptance is synthetic, the costs of
  propose, verify, accept, commit and trim are real: tokens/s against the plain loop, as timed and
  at the expected acceptance length (ms a verify step, which costs the same whatever it accepts,
  over ``1 + alpha + ... + alpha^(K-1)``; the timed tokens are a few tens of seeded draws). With
  ``--config.draft_vocab`` the loop runs again with the drafter's vocabulary reduced to that many
  ids (`mtp.mtp_head.draft_vocabulary`; here the first ids, which random weights make as good as
  any), so that each draft's LM head reads that many rows: its cost at the same forced acceptance
  (a real reduced vocabulary also lowers the acceptance, by the share of the target's tokens it
  cannot name);
* a peer on the same weights: transformers' ``Qwen3NextForCausalLM`` (with flash-linear-attention's
  kernels where installed) at ``--config.peer_layers`` layers of ``--config.peer_model``, ms a
  decoded token beside our plain loop's at the same shape.

A step's time is the slope between calls of two lengths (`experiments.timing`), which
drops what a call costs once. Results go to ``out_dir`` as ``results.json`` (rewritten after every
row, so a run cut short keeps what it measured) and ``results.md``; measurements that would start
past ``--config.deadline_s`` are listed as skipped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import math
import os
import pathlib
import re
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, logging
from ml_collections import config_flags

from experiments.bench_decode import (chained_propose_step, chained_verify_step,
                                      random_cache, random_drafter_cache)
from experiments.ceilings import copy_bandwidth, gemm_flops_per_s
from experiments.results_io import provenance, write_atomic, write_json
from experiments.timing import per_step_slope
from mtp.checkpoint import may_be_fp8
from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model import params as P
from mtp.model import target
from mtp.model.prepared import prepare_params
from mtp.ops import fp8
from mtp.ops.moe import triton as moe_triton
from mtp.speculative import SpecConfig, greedy_loop, speculative_loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
_CONFIG = config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "bench_real_shape.py"))

# (model entry, suite): "full" runs every measurement, "decode" the decode steps and the prefill chunk.
# An entry is a config name of configs/models, with ":fp8" for Qwen's block-scaled FP8 weights
# (`ModelSpec`) and "@bf16-depth" for the depth whose bf16 weights fit, so that FP8 and bf16 meet
# at one depth.
MODEL_SETS = {
    "real": (("qwen3_5_35b_a3b", "full"), ("qwen3_next_80b_a3b", "decode"), ("qwen3_5_27b", "decode")),
    "fp8": (("qwen3_next_80b_a3b:fp8", "full"), ("qwen3_next_80b_a3b", "decode"),
            ("qwen3_next_80b_a3b:fp8@bf16-depth", "decode")),
    "tiny": (("tiny_qwen35_moe", "full"), ("tiny_moe", "decode"), ("tiny_qwen35", "decode")),
    "tiny_fp8": (("tiny_qwen35_moe:fp8", "full"), ("tiny_qwen35_moe", "decode"),
                 ("tiny_qwen35_moe:fp8@bf16-depth", "decode")),
}
WEIGHT_FORMATS = ("bf16", "fp8")
BF16_DEPTH = "@bf16-depth"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of a run: its config name, its weights' format and how deep it runs.

    ``weights="fp8"``: every Linear weight an FP8 checkpoint holds in FP8 (`checkpoint.may_be_fp8`:
    the projections and the routed experts; norms, embeddings, the LM head, the router and the
    Gated DeltaNet's small projections stay bf16) is made as a bf16 draw and quantized to 128 x 128
    blocks on the device (`mtp.ops.fp8.quantize`), as Qwen's ``*-FP8`` releases are made.
    ``bf16_depth``: run at the depth whose bf16 weights fit, not the depth this format's fit.
    """

    name: str
    weights: str = "bf16"
    bf16_depth: bool = False

    @classmethod
    def parse(cls, entry: str) -> "ModelSpec":
        name, at_bf16 = (entry[:-len(BF16_DEPTH)], True) if entry.endswith(BF16_DEPTH) else (entry, False)
        name, _, weights = name.partition(":")
        if (weights or "bf16") not in WEIGHT_FORMATS:
            raise SystemExit(f"--config.models: {entry!r} has weights {weights!r}; choose one of {WEIGHT_FORMATS}")
        return cls(name, weights or "bf16", at_bf16)

    @property
    def label(self) -> str:
        return self.name + ("" if self.weights == "bf16" else f":{self.weights}") + (BF16_DEPTH if self.bf16_depth else "")


TINY_PEER = "tiny_moe"  # the peer's config under --config.model=tiny (a qwen3_next model, as the peer is)
PAGE = 16
DTYPE = jnp.bfloat16


def load_model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(ROOT / "configs" / "models" / f"{name}.json")


# ====================================================================== weights on the device
def weight_groups(cfg: ModelConfig) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """The tensors by the group one init call makes: a decoder layer, the MTP head, the rest."""
    groups: dict[str, list] = {}
    for name, shape in P.param_shapes(cfg).items():
        m = re.match(r"^(model\.layers\.\d+\.|mtp\.)", name)
        prefix = m.group(1) if m else ""
        groups.setdefault(prefix, []).append((name[len(prefix):], shape))
    return {prefix: tuple(items) for prefix, items in groups.items()}


@functools.partial(jax.jit, static_argnames=("shapes", "dtype", "fp8_names"))
def _init_group(key, shapes, dtype, fp8_names=()):
    # Layers of one kind have equal shapes: one compile serves them all.
    keys = jax.random.split(key, len(shapes))
    out = {name: P._init_one(name, shape, k, dtype) for (name, shape), k in zip(shapes, keys)}
    return {name: fp8.quantize(w) if name in fp8_names else w for name, w in out.items()}


def is_fp8(name: str, weights: str) -> bool:
    """Whether the tensor ``name`` of the model's tree is FP8 in this weight format."""
    return weights == "fp8" and may_be_fp8(name)


def device_params(cfg: ModelConfig, seed: int, dtype=DTYPE, weights: str = "bf16") -> P.Params:
    """Random weights made on the device group by group (a seed fixes them), as the model's tree.

    ``weights="fp8"`` quantizes the same draws (`ModelSpec`), so both formats stand for one model.
    """
    root = jax.random.key(seed)
    flat = {}
    for i, (prefix, shapes) in enumerate(weight_groups(cfg).items()):
        fp8_names = tuple(name for name, _ in shapes if is_fp8(prefix + name, weights))
        group = _init_group(jax.random.fold_in(root, i), shapes, dtype, fp8_names)
        flat.update({prefix + name: w for name, w in group.items()})
        jax.block_until_ready(group)  # one group's f32 draws at a time
    return P.unflatten(flat)


def abstract_params(cfg: ModelConfig, dtype=DTYPE, weights: str = "bf16"):
    return jax.eval_shape(lambda: device_params(cfg, 0, dtype, weights))


def tensor_bytes(name: str, shape: tuple[int, ...], weights: str) -> int:
    """A tensor's bytes on the device: bf16, or an FP8 weight's 8-bit values and f32 block scales."""
    if is_fp8(name, weights):
        return math.prod(shape) + 4 * math.prod(fp8.scale_shape(shape))
    return 2 * math.prod(shape)


def param_bytes(cfg: ModelConfig, weights: str = "bf16") -> dict[str, int]:
    """Each tensor's bytes on the device (`tensor_bytes`)."""
    return {name: tensor_bytes(name, shape, weights) for name, shape in P.param_shapes(cfg).items()}


def fitting_depth(cfg: ModelConfig, budget_gib: float, weights: str = "bf16") -> int:
    """The published depth, or the most whole periods of the layer pattern whose weights fit."""
    period = cfg.full_attention_interval or 1

    def gib(layers):
        return sum(param_bytes(at_depth(cfg, layers), weights).values()) / 2 ** 30

    depth = cfg.num_hidden_layers
    while depth > period and gib(depth) > budget_gib:
        depth -= period
    if gib(depth) > budget_gib:
        raise ValueError(f"{period} layers of this model already take {gib(depth):.1f} GiB, more than "
                         f"--config.fit_memory_gib={budget_gib}")
    return depth


def at_depth(cfg: ModelConfig, layers: int) -> ModelConfig:
    return cfg.replace(num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])


# ====================================================================== floors
def expert_bytes(cfg: ModelConfig, weights: str = "bf16") -> int:
    """One routed expert's weights (gate, up, down) as stored: bf16, or FP8 with its block scales."""
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    return sum(tensor_bytes(f"mlp.experts.{proj}.weight", shape, weights)
               for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))))


def lm_head_bytes(cfg: ModelConfig) -> int:
    """The LM head, bf16 in every format (FP8 checkpoints keep it unquantized)."""
    return cfg.vocab_size * cfg.hidden_size * 2


def target_dense_bytes(cfg: ModelConfig, weights: str = "bf16") -> int:
    """Bytes every target step reads whatever its tokens: the decoder layers but their routed
    experts, the final norm and the LM head (an embedding lookup reads a few rows: not counted)."""
    out = 0
    for name, b in param_bytes(cfg, weights).items():
        if name.startswith("model.layers.") and not P.is_expert_stack(name) or name == "model.norm.weight":
            out += b
    return out + lm_head_bytes(cfg)


def head_dense_bytes(cfg: ModelConfig, weights: str = "bf16") -> int:
    """The same for one MTP draft: the head's fc, norms and layer but its routed experts, and the
    shared LM head."""
    return sum(b for n, b in param_bytes(cfg, weights).items()
               if n.startswith("mtp.") and not P.is_expert_stack(n)) + lm_head_bytes(cfg)


def cache_bytes(cfg: ModelConfig, batch: int, context: int, attention_layers: int, linear_layers: int,
                positions: int = 1) -> int:
    """KV of ``context`` positions read, and each Gated DeltaNet layer's states read once and written
    once per step position (a verify of K positions returns the state after each, `target.verify`)."""
    kv = batch * attention_layers * 2 * context * cfg.num_key_value_heads * cfg.head_dim * 2
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * 2
    return kv + (1 + positions) * batch * linear_layers * (rec + conv)


def distinct_experts(routing, rows: int | None = None) -> list[int]:
    """Per MoE layer, how many experts the step's first ``rows`` routed rows select (each counted once).

    A one-row step carries its stream padded with zero rows after the real one
    (`mtp.model.gemm_layout.stream_rows`), and the MoE layer routes those too; ``rows`` = the step's
    tokens counts the real rows alone (None: every routed row).
    """
    return [int(np.unique(np.asarray(r).reshape(-1, np.shape(r)[-1])[:rows]).size) for r in routing]


def active_flops_per_token(cfg: ModelConfig) -> int:
    """Matrix FLOPs of one token through the target's layers: every 2-D weight but the routed
    experts, plus ``num_experts_per_tok`` of those per MoE layer (the LM head is counted apart)."""
    flops = 0
    for name, shape in P.param_shapes(cfg).items():
        if name.startswith("model.layers.") and len(shape) == 2:
            flops += 2 * math.prod(shape)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return flops + moe_layers * cfg.num_experts_per_tok * 2 * 3 * cfg.moe_intermediate_size * cfg.hidden_size


# ====================================================================== routing of a traced step
_INLINED = ("jit", "pjit", "closed_call", "core_call")


def routing_of(fn: Callable, k: int) -> Callable:
    """``fn`` that also returns the expert indices of its every top-``k`` routing: ``(out, routing)``.

    ``fn`` is traced to a jaxpr and evaluated equation by equation, nested ``jit`` calls inlined,
    keeping the indices output of each ``top_k`` with that ``k`` (`mtp.ops.moe.reference.route`), or
    of each weight-streaming gate/up kernel that routes by itself (`mtp.ops.moe.triton.moe_stream`:
    its pairs' expert ids, ``[1, N k]``).
    Traced under the caller's ``jit``, the program is the step itself plus a few small outputs, so a
    timed step reports the routing its own tokens took. Each equation is bound under its own source
    information, as ``jax.core.eval_jaxpr`` binds it, so the compiled program's ops keep the model's
    source lines and name stack (a profile groups kernels by them: `experiments.profile_step`).
    """
    from jax.extend import core as jcore
    from jax.extend import source_info_util

    def evaluate(jaxpr, consts, args, found):
        env = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            sub = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
            if sub is not None:  # a ClosedJaxpr, or a Jaxpr with no consts
                outs = evaluate(getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()), invals, found)
            else:  # as jax's own eval_jaxpr binds an equation
                info = eqn.source_info
                with source_info_util.user_context(info.traceback, name_stack=info.name_stack), eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
            if eqn.primitive.name == "top_k" and eqn.params.get("k") == k:
                found.append(outs[1])
            elif (eqn.primitive.name == "pallas_call" and len(outs) == 3
                  and eqn.params.get("name", "").startswith(moe_triton.GATE_UP_KERNEL)):
                found.append(outs[1])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        found: list = []
        outs = evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), found)
        return jax.tree.unflatten(jax.tree.structure(shape), outs), tuple(found)

    return wrapped


# ====================================================================== programs
class Programs:
    """Ahead-of-time compiles in a thread pool; ``get(name)`` waits for one: ``(compiled, seconds)``."""

    def __init__(self, workers: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(workers)
        self.futures: dict[str, concurrent.futures.Future] = {}

    def submit(self, name: str, jitted, *args, **kwargs):
        def build():
            t = time.perf_counter()
            compiled = jitted.lower(*args, **kwargs).compile()
            return compiled, time.perf_counter() - t
        self.futures[name] = self.pool.submit(build)

    def get(self, name: str, deadline: "Deadline | None" = None):
        """The compiled program, waiting for its compile at most until ``deadline``."""
        future = self.futures.pop(name)
        try:
            return future.result(timeout=None if deadline is None else deadline.remaining())
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{name} was still compiling at the deadline") from None

    def wait_all(self, timeout: float | None = None):
        concurrent.futures.wait(list(self.futures.values()), timeout=timeout)

    def in_flight(self) -> int:
        return sum(not f.done() for f in self.futures.values())

    def cancel_all(self):
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


def steps_program(step, compiler_options: dict[str, str] | None = None):
    """``(state, params, n) -> state`` after ``n`` steps, ``n`` traced: one compile times both lengths.

    ``compiler_options``: XLA's, e.g. the decode loops' CUDA-graph options
    (`mtp.execution.ExecutionConfig.loop_compiler_options`); None keeps XLA's defaults.
    """
    return jax.jit(lambda state, params, n: jax.lax.fori_loop(0, n, lambda _, s: step(s, params), state),
                   donate_argnums=0, compiler_options=compiler_options)


def with_routing(step, k, state_abs, params_abs):
    """``(step, its abstract state)`` for a step whose state also carries the routing of its last
    run, ``(state, routing)``: the experts each of its MoE layers' top-``k`` picked, which the
    routed experts' floor counts."""
    routed = routing_of(step, k)

    def run(state, params):
        return routed(state[0], params)

    _, routing = jax.eval_shape(lambda s, p: run((s, None), p), state_abs, params_abs)
    return run, (state_abs, routing)


class ModelBench:
    """One model's programs (declared, then compiled in the pool) and its measurements."""

    def __init__(self, name: str, cfg: ModelConfig, suite: str, conf, programs: Programs, report: "Report",
                 deadline: "Deadline", weights: str = "bf16", execution: ExecutionConfig = ExecutionConfig()):
        self.name, self.cfg, self.suite, self.conf, self.weights = name, cfg, suite, conf, weights
        self.execution = execution  # every program's (the MTP_* switches `main` read)
        self.programs, self.report, self.deadline = programs, report, deadline
        self.k_route = cfg.num_experts_per_tok if cfg.num_experts else None
        self.params_abs = abstract_params(cfg, weights=weights)
        self.prepared_abs = jax.eval_shape(lambda p: prepare_params(p, execution), self.params_abs)
        self.loop_room = 2 * conf.loop_tokens + conf.spec_k + PAGE
        self.step_states: dict[str, tuple[Callable, Any]] = {}  # what -> (its state's maker, routing shapes)
        self.loop_compile = None  # (compiled, seconds) of the plain loop, once `declare_loop`'s compile is done

    # ------------------------------------------------------------------ states
    def _decode_state(self, batch, width, context=None):
        ctx = self.conf.context if context is None else context
        cache = random_cache(self.cfg, batch, ctx, PAGE, DTYPE, jax.random.key(2))
        return cache, jnp.ones((batch, width), jnp.int32)

    def _propose_state(self):
        dc = random_drafter_cache(self.cfg, 1, self.conf.context, PAGE, DTYPE, jax.random.key(3))
        return dc, jnp.ones((1,), jnp.int32), jax.random.normal(jax.random.key(4), (1, self.cfg.hidden_size), DTYPE)

    def _loop_cache(self, batch):
        ctx = self.conf.context
        cache = random_cache(self.cfg, batch, ctx + self.loop_room, PAGE, DTYPE, jax.random.key(5))
        return cache.replace(lengths=jnp.full((batch,), ctx, jnp.int32))

    def _loop_drafter(self, batch):
        ctx = self.conf.context
        dc = random_drafter_cache(self.cfg, batch, ctx + self.loop_room, PAGE, DTYPE, jax.random.key(6))
        return dc.replace(rows=jnp.full((batch,), ctx, jnp.int32), last_pair_key=jnp.full((batch,), ctx, jnp.int32))

    def _state_abs(self, make):
        return jax.eval_shape(make)

    # ------------------------------------------------------------------ declarations
    @property
    def draft_vocab(self) -> int:
        """The reduced draft vocabulary's size for this model (``--config.draft_vocab``), 0 where it
        is not run: none asked for, or not fewer ids than the model's vocabulary."""
        return self.conf.draft_vocab if self.conf.draft_vocab < self.cfg.vocab_size else 0

    @property
    def plain_spec(self):
        """Both loops' static config: the plain loop reads only its budget, the speculative one K too."""
        return SpecConfig(verify_width=self.conf.spec_k, max_new_tokens=2 * self.conf.loop_tokens,
                          execution=self.execution)

    def declare_loop(self):
        """The plain loop of batch 1: its compile is the one timed alone."""
        b = 1
        args = (self.cfg, self.prepared_abs, self._state_abs(lambda: self._loop_cache(b)),
                jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32), self.plain_spec,
                jax.eval_shape(lambda: jax.random.key(0)))
        self.programs.submit(f"{self.name}/greedy_loop", greedy_loop, *args)

    def declare(self):
        """Submit this model's programs, in the order `measure` times them: the goals' first."""
        c, conf = self.cfg, self.conf
        steps = {f"decode b={b}": (lambda b=b: self._decode_state(b, 1)) for b in conf.batches}
        if self.suite == "full":
            steps.update({f"verify K={k}": (lambda k=k: self._decode_state(1, k)) for k in conf.verify_widths})
        goals = [w for w in ("decode b=1", f"verify K={conf.spec_k}") if w in steps]
        for what in goals:
            self._declare_step(what, chained_verify_step(c, self.execution), self.params_abs, steps.pop(what))
        if self.suite == "full":
            b = 1
            args = (c, self.prepared_abs, self._state_abs(lambda: self._loop_cache(b)),
                    self._state_abs(lambda: self._loop_drafter(b)), jax.ShapeDtypeStruct((b,), jnp.int32),
                    jax.ShapeDtypeStruct((b, c.hidden_size), DTYPE), jax.ShapeDtypeStruct((b,), jnp.int32),
                    self.plain_spec, jax.eval_shape(lambda: jax.random.key(0)), None,
                    jax.ShapeDtypeStruct((), jnp.float32))
            self.programs.submit(f"{self.name}/spec_loop", speculative_loop, *args)
            if self.draft_vocab:
                vocab = jax.ShapeDtypeStruct((self.draft_vocab,), jnp.int32)
                self.programs.submit(f"{self.name}/spec_loop_draft_vocab", speculative_loop,
                                     *args[:-2], vocab, args[-1])
        for what, make_state in steps.items():
            self._declare_step(what, chained_verify_step(c, self.execution), self.params_abs, make_state)
        if self.suite == "full":
            self._declare_step("propose", chained_propose_step(c, self.execution), self.prepared_abs,
                               self._propose_state)
        self._declare_prefill()

    def _declare_step(self, what, step, params_abs, make_state):
        state_abs = self._state_abs(make_state)
        if self.k_route is not None:
            step, state_abs = with_routing(step, self.k_route, state_abs, params_abs)
        self.programs.submit(f"{self.name}/{what}", steps_program(step), state_abs, params_abs,
                             jax.ShapeDtypeStruct((), jnp.int32))
        routing_abs = state_abs[1] if self.k_route is not None else None
        self.step_states[what] = (make_state, routing_abs)

    def _prefill_program(self):
        c, t = self.cfg, self.conf.prefill_chunk

        def run(cache, params, tokens):
            zeros = jnp.zeros((1,), jnp.int32)
            return target.prefill(c, params, cache, tokens, zeros, jnp.full((1,), t, jnp.int32),
                                  execution=self.execution, all_logits=False)[0]

        return jax.jit(run, donate_argnums=0)

    def _declare_prefill(self):
        t = self.conf.prefill_chunk
        cache_abs = self._state_abs(lambda: random_cache(self.cfg, 1, t, PAGE, DTYPE, jax.random.key(7)))
        self.programs.submit(f"{self.name}/prefill", self._prefill_program(), cache_abs, self.params_abs,
                             jax.ShapeDtypeStruct((1, t), jnp.int32))

    # ------------------------------------------------------------------ measurements
    def add(self, what, **row):
        self.report.add(model=self.name, layers=self.cfg.num_hidden_layers, weights=self.weights, what=what,
                        compiles_in_flight=self.programs.in_flight(), **row)

    def time_step(self, what, params, floor_bytes: Callable[[list[int] | None], float], tokens: int):
        """ms a step (the slope), its floor from the experts its ``tokens`` real rows selected, and those."""
        compiled, compile_s = self.programs.get(f"{self.name}/{what}", self.deadline)
        make_state, routing_abs = self.step_states.pop(what)
        box = [jax.block_until_ready(make_state())]
        if routing_abs is not None:
            box = [(box[0], tuple(jnp.zeros(r.shape, r.dtype) for r in routing_abs))]
        n = self.conf.steps_per_call

        def call_of(steps):
            def call():
                t = time.perf_counter()
                box[0] = jax.block_until_ready(compiled(box[0], params, jnp.int32(steps)))
                return time.perf_counter() - t
            return call

        ms, ms_call = per_step_slope({n: call_of(n), 4 * n: call_of(4 * n)}, self.conf.reps)
        experts = distinct_experts(box[0][1], tokens) if self.k_route is not None else None
        floor_ms = 1e3 * floor_bytes(experts) / self.report.copy_bw
        row = dict(ms=ms, ms_whole_call=ms_call, floor_ms=floor_ms, ratio_to_floor=ms / floor_ms,
                   compile_s=compile_s)
        if experts is not None:
            row.update(distinct_experts_mean=float(np.mean(experts)), distinct_experts=experts)
            padded = distinct_experts(box[0][1])
            if padded != experts:  # the padding rows' routing reads experts too: say how many
                row.update(routed_rows=int(np.size(box[0][1][0]) // self.k_route),
                           distinct_experts_with_padding_mean=float(np.mean(padded)))
        return row

    def guarded(self, what: str, deadline: "Deadline", fn: Callable[[], Any]):
        """Run one measurement unless past the deadline; a failure is recorded and the run goes on."""
        if deadline.passed(f"{self.name} {what}", self.report):
            self.programs.futures.pop(f"{self.name}/{what}", None)
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one measurement's failure leaves the others' rows
            self.report.error(f"{self.name} {what}", e)
            return None

    def measure(self, params, deadline, after_goals: Callable[[], None] = lambda: None):
        """Every measurement of this model's suite, the goals' rows first; ``after_goals`` runs between."""
        c, conf = self.cfg, self.conf
        n_attn, n_lin = len(c.attention_layers), len(c.linear_layers)
        rows = {}

        def floor_of(dense, batch, attention_layers, linear_layers, positions=1):
            def floor(experts):
                routed = sum(experts) * expert_bytes(c, self.weights) if experts else 0
                return dense + routed + cache_bytes(c, batch, conf.context, attention_layers, linear_layers, positions)
            return floor

        def step_row(what):
            b, k = (int(what.split("=")[1]), 1) if what.startswith("decode") else (1, int(what.split("=")[1]))
            row = self.time_step(what, params, floor_of(target_dense_bytes(c, self.weights), b, n_attn, n_lin, k),
                                 b * k)
            if k > 1 and "decode b=1" in rows:
                row["ratio_to_decode"] = row["ms"] / rows["decode b=1"]["ms"]
            self.add(what, batch=b, **({"K": k} if k > 1 else {}), **row)
            rows[what] = row

        order = [f"verify K={k}" for k in conf.verify_widths] if self.suite == "full" else []
        order += [f"decode b={b}" for b in conf.batches]
        goals = [w for w in ("decode b=1", f"verify K={conf.spec_k}") if w in order]
        for what in goals:
            self.guarded(what, deadline, lambda what=what: step_row(what))
        # The loops and the propose step take the derived tensors, made once for both.
        prepared = prepare_params(params, self.execution) if self.suite == "full" else None
        if self.suite == "full":
            self.measure_loops(prepared, rows, deadline, speculative=True)
        after_goals()
        for what in order:
            if what not in goals:
                self.guarded(what, deadline, lambda what=what: step_row(what))
        if self.suite == "full":
            def propose():
                row = self.time_step("propose", prepared,
                                     floor_of(head_dense_bytes(c, self.weights), 1, 1, 0), 1)
                if "decode b=1" in rows:
                    row["ratio_to_decode"] = row["ms"] / rows["decode b=1"]["ms"]
                self.add("propose (1 draft)", batch=1, **row)

            self.guarded("propose", deadline, propose)
        self.guarded("prefill", deadline, lambda: self.measure_prefill(params))
        return rows

    def measure_prefill(self, params):
        c, t = self.cfg, self.conf.prefill_chunk
        compiled, compile_s = self.programs.get(f"{self.name}/prefill", self.deadline)
        cache = random_cache(c, 1, t, PAGE, DTYPE, jax.random.key(7))
        tokens = jax.random.randint(jax.random.key(8), (1, t), 0, c.vocab_size, jnp.int32)
        for _ in range(2):
            cache = jax.block_until_ready(compiled(cache, params, tokens))
        ts = []
        for _ in range(self.conf.reps):
            s = time.perf_counter()
            cache = jax.block_until_ready(compiled(cache, params, tokens))
            ts.append(time.perf_counter() - s)
        seconds = float(np.median(ts))
        flops = t * active_flops_per_token(c) + 2 * lm_head_bytes(c) // 2  # the LM head reads the last row only
        floor_s = flops / self.report.gemm_flops
        self.add("prefill chunk", batch=1, tokens=t, ms=1e3 * seconds, tokens_per_s=t / seconds,
                 floor_ms=1e3 * floor_s, ratio_to_floor=seconds / floor_s, active_tflop=flops / 1e12,
                 compile_s=compile_s)

    def _time_loop(self, run, budgets):
        """ms a token from loop calls of two budgets; ``run(budget)`` returns (seconds, extras)."""
        extras = {}

        def call_of(n):
            def call():
                seconds, extras[n] = run(n)
                return seconds
            return call

        ms, ms_call = per_step_slope({n: call_of(n) for n in budgets}, self.conf.reps)
        return ms, ms_call, extras

    def measure_loops(self, prepared, rows, deadline, speculative: bool):
        """The plain loop at batch 1 and, with ``speculative``, the speculative loop at each alpha;
        ``prepared``: the params with their derived tensors (`prepare_params`)."""
        plain_ms = self.guarded("greedy loop", deadline, lambda: self._measure_plain_loop(prepared, rows))
        if speculative and plain_ms is not None:
            self.guarded("spec_loop", deadline, lambda: self._measure_spec_loop(prepared, plain_ms))

    def _measure_plain_loop(self, params, rows):
        conf, b = self.conf, 1
        budgets = (conf.loop_tokens, 2 * conf.loop_tokens)
        if self.loop_compile is None:
            raise RuntimeError("the plain loop has no compiled program (its compile failed; see the errors)")
        compiled, compile_s = self.loop_compile
        first = jnp.ones((b,), jnp.int32)
        rng = jax.random.key(conf.seed)
        state = {"cache": self._loop_cache(b)}

        def plain(n):
            cache = state["cache"].replace(lengths=jnp.full((b,), conf.context, jnp.int32))
            t = time.perf_counter()
            cache, out, num = jax.block_until_ready(compiled(params, cache, first, jnp.full((b,), n, jnp.int32), rng))
            state["cache"] = cache
            if int(num[0]) != n:
                raise RuntimeError(f"the plain loop made {int(num[0])} tokens for a budget of {n}")
            return time.perf_counter() - t, {}

        plain_ms, plain_call, _ = self._time_loop(plain, budgets)
        del state["cache"]
        self.add("plain greedy loop", batch=b, ms_per_token=plain_ms, ms_per_token_whole_call=plain_call,
                 tokens_per_s=1e3 / plain_ms, compile_s=compile_s,
                 ratio_to_decode_step=plain_ms / rows["decode b=1"]["ms"] if "decode b=1" in rows else None)
        return plain_ms

    def _measure_spec_loop(self, head, plain_ms):
        """The speculative loop at each alpha: with the full draft vocabulary, then the reduced one."""
        state = {"cache": self._loop_cache(1), "dcache": self._loop_drafter(1)}
        self._measure_spec_loop_at(head, state, plain_ms, "spec_loop", None, "")
        if self.draft_vocab:
            vocab = jnp.arange(self.draft_vocab, dtype=jnp.int32)
            self._measure_spec_loop_at(head, state, plain_ms, "spec_loop_draft_vocab", vocab,
                                       f", draft vocab {self.draft_vocab}")

    def _measure_spec_loop_at(self, head, state, plain_ms, program, draft_vocab, suffix):
        conf, c, b = self.conf, self.cfg, 1
        budgets = (conf.loop_tokens, 2 * conf.loop_tokens)
        first = jnp.ones((b,), jnp.int32)
        rng = jax.random.key(conf.seed)
        compiled, spec_compile_s = self.programs.get(f"{self.name}/{program}", self.deadline)
        hidden = jax.random.normal(jax.random.key(9), (b, c.hidden_size), DTYPE)
        for alpha in conf.alphas:
            def spec(n, alpha=alpha):
                cache = state["cache"].replace(lengths=jnp.full((b,), conf.context, jnp.int32))
                dcache = state["dcache"].replace(rows=jnp.full((b,), conf.context, jnp.int32),
                                                 last_pair_key=jnp.full((b,), conf.context, jnp.int32))
                t = time.perf_counter()
                cache, dcache, out, num, metrics = jax.block_until_ready(
                    compiled(head, cache, dcache, first, hidden, jnp.full((b,), n, jnp.int32), rng, draft_vocab,
                             jnp.float32(alpha)))
                state.update(cache=cache, dcache=dcache)
                if int(num[0]) != n:
                    raise RuntimeError(f"the speculative loop made {int(num[0])} tokens for a budget of {n}")
                steps, accepted = int(metrics.steps.sum()), int(metrics.accepted.sum())
                return time.perf_counter() - t, dict(steps=steps, accepted=accepted)

            spec_ms, spec_call, extras = self._time_loop(spec, budgets)
            m = extras[budgets[1]]
            d = conf.spec_k - 1
            expected = 1 + sum(alpha ** i for i in range(1, d + 1))
            # The slope's tokens (those between the two budgets) took this many verify steps: a
            # sample of tens of draws of the forced acceptance, which the seed fixes. A step costs
            # the same whatever it accepts, so ms a step over the expected acceptance length is
            # the loop's ms a token at alpha without that sampling error.
            window_steps = extras[budgets[1]]["steps"] - extras[budgets[0]]["steps"]
            ms_per_step = spec_ms * (budgets[1] - budgets[0]) / window_steps
            self.add(f"speculative loop K={conf.spec_k} alpha={alpha}{suffix}", batch=b, K=conf.spec_k, alpha=alpha,
                     draft_vocab=c.vocab_size if draft_vocab is None else len(draft_vocab),
                     synthetic_acceptance=True, ms_per_token=spec_ms, ms_per_token_whole_call=spec_call,
                     tokens_per_s=1e3 / spec_ms, speedup_vs_plain=plain_ms / spec_ms,
                     mean_acceptance_length=1 + m["accepted"] / m["steps"], expected_acceptance_length=expected,
                     window_acceptance_length=(budgets[1] - budgets[0]) / window_steps, ms_per_step=ms_per_step,
                     speedup_at_expected_acceptance=plain_ms * expected / ms_per_step,
                     verify_steps=m["steps"], compile_s=spec_compile_s)


# ====================================================================== run
class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def passed(self, what: str, report: "Report") -> bool:
        if time.monotonic() < self.end:
            return False
        report.data["skipped"].append(what)
        logging.warning("past the deadline: %s skipped", what)
        return True


class Report:
    def __init__(self, out: pathlib.Path, conf):
        self.out = out
        self.data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                     "config": conf.to_dict(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                     "provenance": provenance(conf), "rows": [], "skipped": [], "errors": []}
        out.mkdir(parents=True, exist_ok=True)
        self.copy_bw = self.gemm_flops = float("nan")

    def add(self, **row):
        self.data["rows"].append(row)
        logging.info("%s", row)
        print({k: v for k, v in row.items() if k != "distinct_experts"}, flush=True)
        write_json(self.out / "results.json", self.data)

    def error(self, what: str, e: Exception):
        logging.exception("%s failed", what)
        self.data["errors"].append(f"{what}: {type(e).__name__}: {e}"[:2000])
        write_json(self.out / "results.json", self.data)


def _fmt(v, spec=".3f"):
    return "" if v is None else format(v, spec)


def markdown(data) -> str:
    rows = data["rows"]
    commit = data.get("config", {}).get("tree_commit") or (data.get("provenance", {}).get("git") or {}).get("commit")
    lines = [f"# Real-shape benchmark\n\n{data['device']} ({data['backend']}), {data['date']}; tree "
             f"{commit or 'unknown'}; random weights (bf16, or block-scaled FP8 where a model is named `:fp8`); "
             "every ratio is of this run.\n"]
    for r in rows:
        if r["what"] == "ceilings":
            lines.append(f"Copy bandwidth {r['copy_bandwidth_TBps']:.2f} TB/s (read + written); bf16 GEMM "
                         f"{r['gemm_TFLOPps']:.0f} TFLOP/s ({r['gemm_n']}^3).\n")
    for r in rows:
        if r["what"] == "model":
            lines.append(f"- {r['model']}: {r['layers']} of its {r['published_layers']} layers, "
                         f"{r['params'] / 1e9:.2f}B parameters with the MTP head, {r.get('weights', 'bf16')} "
                         f"({r.get('weight_gib', 2 * r['params'] / 2 ** 30):.1f} GiB)")
    lines += ["", "| model | layers | what | time | floor | ratio | distinct experts / layer | compile s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["what"] in ("ceilings", "model", "peer"):
            continue
        if "ms_per_token" in r:
            time_s = f"{r['ms_per_token']:.3f} ms/token ({r['tokens_per_s']:.1f} tok/s)"
            if "speedup_vs_plain" in r:
                ratio = (f"{r['speedup_vs_plain']:.2f}x plain at the timed tokens' acceptance length "
                         f"{r['window_acceptance_length']:.2f}; **{r['speedup_at_expected_acceptance']:.2f}x** at the "
                         f"expected {r['expected_acceptance_length']:.2f} ({r['ms_per_step']:.2f} ms a step; synthetic)")
            else:
                step = r.get("ratio_to_decode_step")
                ratio = "" if step is None else f"{step:.2f}x the decode step"
            floor = ""
        elif "tokens_per_s" in r:
            time_s = f"{r['ms']:.2f} ms ({r['tokens_per_s']:.0f} tok/s)"
            floor, ratio = f"{r['floor_ms']:.2f} ms (FLOPs)", f"{r['ratio_to_floor']:.2f}x floor"
        else:
            time_s, floor = f"{r['ms']:.3f} ms", f"{r['floor_ms']:.3f} ms (bytes)"
            ratio = f"{r['ratio_to_floor']:.2f}x floor"
            if "ratio_to_decode" in r:
                ratio += f"; {r['ratio_to_decode']:.2f}x decode"
        experts = _fmt(r.get("distinct_experts_mean"), ".1f")
        if "distinct_experts_with_padding_mean" in r:
            experts += f" ({r['distinct_experts_with_padding_mean']:.1f} with the padding rows)"
        busy = " (while compiling)" if r.get("compiles_in_flight") else ""
        lines.append(f"| {r['model']} | {r['layers']} | {r['what']}{busy} | {time_s} | {floor} | {ratio} | {experts} | "
                     f"{_fmt(r.get('compile_s'), '.1f')} |")
    for r in rows:
        if r["what"] == "peer":
            lines.append(f"\nPeer ({r['model']} at {r['layers']} layers, batch 1, greedy, prompt {r['prompt']}): "
                         f"transformers {r['transformers']} {r['ms_per_token']:.2f} ms/token (gated delta rule: "
                         f"{', '.join(f'{k} {v}' for k, v in r['gated_delta_rule'].items())}; "
                         f"flash-linear-attention {r['flash_linear_attention']}), ours "
                         f"{r['ours_ms_per_token']:.3f} ms/token: {r['ms_per_token'] / r['ours_ms_per_token']:.1f}x.")
    if data.get("verdicts"):
        lines.append("\n## Goals\n")
        lines += [f"- {v['goal']}: **{v['verdict']}** ({v['measured']})" for v in data["verdicts"]]
    lines += [f"\nSkipped (deadline): {', '.join(data['skipped'])}"] if data["skipped"] else []
    lines += [f"\nError: {e}" for e in data["errors"]]
    return "\n".join(lines) + "\n"


def verdicts(data, first: str, conf) -> list[dict]:
    rows = {r["what"]: r for r in data["rows"] if r.get("model") == first}
    out = []

    def goal(text, ok, measured):
        out.append(dict(goal=text, verdict="n/a (not measured)" if ok is None else ("met" if ok else "missed"),
                        measured=measured))

    d = rows.get("decode b=1")
    goal(f"{first}: decode at batch 1 within 1.6x of its floor", d and d["ratio_to_floor"] <= 1.6,
         d and f"{d['ratio_to_floor']:.2f}x ({d['ms']:.2f} ms vs {d['floor_ms']:.2f} ms)")
    g = rows.get("plain greedy loop")
    goal(f"{first}: decode loop compile <= 3 min", g and g["compile_s"] <= 180,
         g and f"{g['compile_s']:.0f} s, compiled alone")
    v = rows.get(f"verify K={conf.spec_k}")
    goal(f"{first}: verify K = {conf.spec_k} <= 2x decode", v and v.get("ratio_to_decode", 9) <= 2.0,
         v and f"{v.get('ratio_to_decode', float('nan')):.2f}x")
    def spec_goal(what, s):
        goal(what, s and s["speedup_at_expected_acceptance"] >= 2.0,
             s and (f"{s['speedup_at_expected_acceptance']:.2f}x at the expected acceptance length; "
                    f"{s['speedup_vs_plain']:.2f}x at the timed tokens' {s['window_acceptance_length']:.2f} "
                    f"(synthetic acceptance)"))

    spec_goal(f"{first}: speculative loop at alpha = 0.8, K = {conf.spec_k} >= 2x plain at batch 1",
              rows.get(f"speculative loop K={conf.spec_k} alpha=0.8"))
    if conf.draft_vocab:
        spec_goal(f"{first}: the same with a {conf.draft_vocab}-id draft vocabulary",
                  rows.get(f"speculative loop K={conf.spec_k} alpha=0.8, draft vocab {conf.draft_vocab}"))
    for v in out:  # None-valued conditions came from rows that were not measured
        if v["measured"] is None:
            v["verdict"], v["measured"] = "n/a (not measured)", "-"
    return out


def format_verdicts(data, specs) -> list[dict]:
    """FP8 against bf16 at one shape and depth: each ``X:fp8@bf16-depth`` decode step over ``X``'s."""
    out = []
    rows = {(r.get("model"), r["what"]): r for r in data["rows"]}
    for spec, _ in specs:
        if spec.weights != "fp8" or not spec.bf16_depth:
            continue
        base = ModelSpec(spec.name).label
        for b in data["config"]["batches"]:
            q, ref = rows.get((spec.label, f"decode b={b}")), rows.get((base, f"decode b={b}"))
            if b == 1 or (q and ref):
                ok = None if not (q and ref) else q["ms"] / ref["ms"] <= 0.6
                measured = "-" if ok is None else (f"{q['ms'] / ref['ms']:.2f}x ({q['ms']:.3f} vs {ref['ms']:.3f} ms, "
                                                   f"{q['layers']} layers)")
                out.append(dict(goal=f"{spec.name}: FP8 decode step at batch {b} <= 0.6x the bf16 one at the same depth",
                                verdict="n/a (not measured)" if ok is None else ("met" if ok else "missed"),
                                measured=measured))
    return out


def run(conf, execution: ExecutionConfig = ExecutionConfig()) -> dict:
    if conf.model not in MODEL_SETS:
        raise SystemExit(f"--config.model={conf.model!r}: expected one of {sorted(MODEL_SETS)}")
    bad = [k for k in conf.verify_widths if not 2 <= k <= 8] + ([conf.spec_k] if not 2 <= conf.spec_k <= 8 else [])
    if bad:
        raise SystemExit(f"--config.verify_widths / --config.spec_k: K={bad[0]} outside 2..8")
    if any(not 0 <= a <= 1 for a in conf.alphas):
        raise SystemExit(f"--config.alphas={conf.alphas}: each must be a probability in [0, 1]")
    if conf.draft_vocab < 0:
        raise SystemExit(f"--config.draft_vocab={conf.draft_vocab}: a count of ids (0: the full vocabulary only)")
    chosen = MODEL_SETS[conf.model]
    if conf.models:
        names = conf.models.split(",")
        if unknown := [n for n in names if n not in dict(chosen)]:
            raise SystemExit(f"--config.models: {unknown} not in the {conf.model!r} set {[n for n, _ in chosen]}")
        chosen = tuple((n, suite) for n, suite in chosen if n in names)
    specs = [(ModelSpec.parse(entry), suite) for entry, suite in chosen]
    deadline = Deadline(conf.deadline_s)
    report = Report(pathlib.Path(conf.out_dir), conf)
    tiny = conf.model.startswith("tiny")
    report.copy_bw, _ = copy_bandwidth((1 << 22) if tiny else (1 << 30))
    gemm_n = 256 if tiny else 8192
    report.gemm_flops = gemm_flops_per_s(gemm_n, conf.reps)
    report.add(what="ceilings", copy_bandwidth_TBps=report.copy_bw / 1e12, gemm_TFLOPps=report.gemm_flops / 1e12,
               gemm_n=gemm_n)
    programs = Programs(conf.compile_workers)
    benches = []
    for spec, suite in specs:
        cfg = load_model_config(spec.name)
        depth = fitting_depth(cfg, conf.fit_memory_gib, "bf16" if spec.bf16_depth else spec.weights)
        run_cfg = at_depth(cfg, depth)
        benches.append(ModelBench(spec.label, run_cfg, suite, conf, programs, report, deadline, spec.weights,
                                  execution))
        report.add(what="model", model=spec.label, layers=depth, published_layers=cfg.num_hidden_layers,
                   weights=spec.weights, params=sum(math.prod(s) for s in P.param_shapes(run_cfg).values()),
                   weight_gib=sum(param_bytes(run_cfg, spec.weights).values()) / 2 ** 30)
    peer_name = (TINY_PEER if tiny and conf.peer_model else conf.peer_model) or None
    peer = None
    if peer_name:
        pcfg = at_depth(load_model_config(peer_name), conf.peer_layers)
        pconf = conf.copy_and_resolve_references()
        pconf.context = conf.peer_prompt
        peer = ModelBench(f"{peer_name} (peer shape)", pcfg, "loop", pconf, programs, report, deadline,
                          execution=execution)
    first = benches[0]
    try:
        # 0. The peer first, while this process's JAX memory pool is small: JAX keeps what it has
        # grown to, and beside a large model's pool torch's copy of the weights finds no room.
        if peer:
            peer.declare_loop()
            run_peer(peer, conf, report, deadline)
        # 1. The plain loop's compile alone (the compile-time goal); the first model's weights meanwhile.
        first.declare_loop()
        params = device_params(first.cfg, conf.seed, weights=first.weights)
        try:
            first.loop_compile = programs.get(f"{first.name}/greedy_loop", deadline)
        except Exception as e:  # noqa: BLE001 - the loop's rows say it failed; the steps still run
            report.error(f"{first.name} greedy loop compile", e)
        # 2. The first model's programs, compiled together; then its goals' rows are timed with no
        # compile in flight.
        first.declare()
        # Waiting stops early enough to leave the first model's timings their share of the budget.
        programs.wait_all(timeout=max(0.0, deadline.remaining() - conf.first_model_timing_s))
        # 3. After the goals' rows the other models' programs compile while the first model's other
        # rows run; each model is timed once its own are done.
        first.measure(params, deadline, after_goals=lambda: [bench.declare() for bench in benches[1:]])
        del params
        gc.collect()
        for bench in benches[1:]:
            if deadline.passed(f"{bench.name} (all)", report):
                continue
            try:
                params = device_params(bench.cfg, conf.seed, weights=bench.weights)
                bench.measure(params, deadline)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next model still runs
                report.error(bench.name, e)
            params = None
            gc.collect()
    finally:
        programs.cancel_all()
    report.data["verdicts"] = verdicts(report.data, first.name, conf) + format_verdicts(report.data, specs)
    write_json(report.out / "results.json", report.data)
    md = markdown(report.data)
    write_atomic(report.out / "results.md", md)
    print(md, flush=True)
    return report.data


def run_peer(peer: ModelBench, conf, report: Report, deadline: Deadline):
    """Our plain loop and transformers' decode (`experiments.hf_peer`) at the peer's shape, same weights."""
    if deadline.passed(f"{peer.name}", report):
        return
    try:
        params = device_params(peer.cfg, conf.seed)
        peer.loop_compile = peer.programs.get(f"{peer.name}/greedy_loop", deadline)
        rows_before = len(report.data["rows"])
        peer.measure_loops(prepare_params(params, peer.execution), {}, deadline, speculative=False)
        ours = next(r for r in report.data["rows"][rows_before:] if r["what"] == "plain greedy loop")
        from experiments import hf_peer

        device = "cuda" if jax.default_backend() == "gpu" else "cpu"
        model = hf_peer.build_model(peer.cfg.to_hf(), P.flatten(params), device, "bfloat16")
        result = hf_peer.decode_ms_per_token(model, peer.cfg.vocab_size, conf.peer_prompt, conf.loop_tokens,
                                             max(2, conf.reps // 2), conf.seed)
        del model
        report.add(what="peer", model=peer.name, layers=peer.cfg.num_hidden_layers, prompt=conf.peer_prompt,
                   ours_ms_per_token=ours["ms_per_token"], ratio_to_ours=result["ms_per_token"] / ours["ms_per_token"],
                   **result)
    except Exception as e:  # noqa: BLE001 - the peer's failure is recorded, the run goes on
        report.error("peer", e)
    finally:
        gc.collect()
        if jax.default_backend() == "gpu" and "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()  # hand the peer's memory back for the next model


def grow_memory_pool_on_demand(environ=os.environ) -> None:
    """Let JAX's GPU memory pool grow as needed up to 94% of the device, unless the caller chose.

    The peer's torch and the 80B's FP8 weights need the room a preallocated pool (75% of the
    device, taken at start) would hold. JAX reads these when its backend starts, so this runs
    first in `main`; a value the caller set is kept.
    """
    environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")


def main(argv):
    del argv
    grow_memory_pool_on_demand()  # before anything starts JAX's backend
    data = run(_CONFIG.value, ExecutionConfig.from_environ(os.environ))
    failed = len(data["errors"])
    if failed:
        logging.error("%d measurement(s) failed; see %s/results.json", failed, _CONFIG.value.out_dir)
    # The files are written: exit without waiting for compiles that a deadline left running in the
    # pool's threads (an interpreter exit would join them).
    logging.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
