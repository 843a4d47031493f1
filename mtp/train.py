"""Joint training of the hybrid target and its MTP head, and export of the default model.

The loss is ``CE(target next token) + mtp_weight * CE(MTP token after next)``. The
MTP head reads the target's hidden (per ``mtp_hidden_source``) without a stop
gradient: that is how the published MTP models are trained, and it lets the target
shape its hidden for the drafter as well as for its own head.

Design choices that the code below depends on:

* **Master weights in f32, compute in bf16.** The loss casts the parameters to the
  compute dtype, so the gradient arrives in f32 for the optimizer while every matmul
  runs in bf16 (the dtype the model is exported and served in).
* **The schedule's horizon is data, not a constant.** The cosine decay ends at
  ``TrainState.horizon``, a traced scalar. A wall-clock budget can then shrink the
  horizon after the first steps have been timed, so a budgeted run still finishes
  its decay instead of being cut off at a high learning rate -- without retracing.
  For the same reason AdamW runs at unit rate and the step scales its update by the
  scheduled rate (weight decay included, as in `optax.adamw`).
* **Sampling on the device.** The token stream lives on the device and each step
  draws its own windows from a PRNG key carried in the state, so a step does no
  host transfer and a resumed run draws exactly the windows the uninterrupted one
  would have drawn.
* **One compile per (model, hyperparameters, stream length).** The jitted functions
  are cached per static configuration (`steps_for`), so trainers created in the
  same process share the compiled step, and each keeps a trace counter that shows
  whether the step ever retraced.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import io
import json
import math
import os
import pathlib
import platform
import sys
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from tqdm import tqdm

from mtp import mtp_head
from mtp.checkpoint import TOKEN_COUNTS_NAME, save_pretrained
from mtp.config import ModelConfig
from mtp.model.params import Params, count_params, init_params
from mtp.model.target import forward_with_hiddens

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class TrainError(ValueError):
    """A training config or data set that cannot be trained on, with the problem named."""


# ====================================================================== config
@dataclasses.dataclass(frozen=True)
class Hyper:
    """The numbers that shape the compiled step (hashable: a static jit argument)."""

    seq_len: int
    batch_size: int
    peak_lr: float
    warmup_steps: int
    end_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
    clip_norm: float
    mtp_weight: float
    compute_dtype: str

    @classmethod
    def from_config(cls, config) -> "Hyper":
        hp = cls(**{f.name: config[f.name] for f in dataclasses.fields(cls)})
        if hp.seq_len < 2:
            raise TrainError(f"seq_len={hp.seq_len}: the MTP loss needs at least 2 positions")
        if hp.batch_size < 1:
            raise TrainError(f"batch_size={hp.batch_size} must be positive")
        if hp.compute_dtype not in COMPUTE_DTYPES:
            raise TrainError(f"compute_dtype={hp.compute_dtype!r}; expected one of {list(COMPUTE_DTYPES)}")
        if not 0.0 <= hp.end_lr_ratio <= 1.0:
            raise TrainError(f"end_lr_ratio={hp.end_lr_ratio} must be in [0, 1]")
        if hp.mtp_weight < 0:
            raise TrainError(f"mtp_weight={hp.mtp_weight} must be non-negative")
        return hp

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def load_model_config(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The model's ``config.json`` with ``overrides`` applied (e.g. a tokenizer's vocab size)."""
    p = pathlib.Path(path)
    cfg = ModelConfig.from_hf(p if p.is_absolute() else REPO_ROOT / p)
    if overrides:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
        if unknown:
            raise TrainError(f"model_overrides: {unknown} are not ModelConfig fields")
        cfg = cfg.replace(**dict(overrides))
    if not cfg.has_mtp:
        raise TrainError(f"{path}: num_nextn_predict_layers is 0; joint training needs an MTP layer")
    return cfg


# ====================================================================== data
@dataclasses.dataclass(frozen=True)
class Streams:
    train: np.ndarray  # uint16 token ids, documents separated by <|endoftext|>
    heldout: np.ndarray
    info: dict | None  # data_info.json of experiments/build_data.py, when present


def load_streams(data_dir: str | os.PathLike, vocab_size: int, min_len: int) -> Streams:
    root = pathlib.Path(data_dir)
    root = root if root.is_absolute() else REPO_ROOT / root
    arrays = {}
    for split in ("train", "heldout"):
        file = root / f"{split}.npy"
        if not file.is_file():
            raise TrainError(f"{file}: missing; build it with `python -m experiments.build_data`")
        a = np.load(file, mmap_mode="r")
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise TrainError(f"{file}: expected a 1-D integer token array, got {a.dtype} {a.shape}")
        if a.shape[0] < min_len:
            raise TrainError(f"{file}: {a.shape[0]} tokens, fewer than one window of {min_len}")
        a = np.asarray(a, np.uint16) if a.dtype != np.uint16 else np.asarray(a)
        top = int(a.max())
        if top >= vocab_size:
            raise TrainError(f"{file}: token id {top} is outside the model's vocab_size={vocab_size}")
        arrays[split] = a
    info_file = root / "data_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else None
    return Streams(arrays["train"], arrays["heldout"], info)


def eval_windows(stream: np.ndarray, window: int, count: int) -> np.ndarray:
    """``count`` windows of ``window`` tokens spread evenly over the stream (fixed, reproducible).

    Spreading them rather than taking the first ones samples every held-out file,
    and they do not overlap while the stream is long enough.
    """
    last = stream.shape[0] - window
    count = max(1, min(count, last // window + 1))
    starts = np.linspace(0, last, count).astype(np.int64)
    return np.stack([stream[s : s + window] for s in starts]).astype(np.int32)


# ====================================================================== state
@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Params  # f32 master weights
    opt_state: Any
    data_key: jax.Array  # uint32[2]: draws the next step's windows
    horizon: jax.Array  # int32 scalar: the step at which the cosine decay ends

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _decay_mask(params: Params):
    """Decay matrices and embeddings; never norm scales, A_log or dt_bias."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(hp: Hyper) -> optax.GradientTransformation:
    """Clipped AdamW at unit rate; `train_step` multiplies by the scheduled rate."""
    return optax.chain(
        optax.clip_by_global_norm(hp.clip_norm),
        optax.adamw(learning_rate=1.0, b1=hp.b1, b2=hp.b2, eps=hp.eps,
                    weight_decay=hp.weight_decay, mask=_decay_mask),
    )


def learning_rate(step: jax.Array, horizon: jax.Array, hp: Hyper) -> jax.Array:
    """Linear warmup to ``peak_lr`` over ``warmup_steps``, cosine to ``end_lr_ratio * peak`` at ``horizon``."""
    s = step.astype(jnp.float32)
    warm = float(max(hp.warmup_steps, 1))
    warmup = hp.peak_lr * jnp.minimum(1.0, (s + 1.0) / warm)
    span = jnp.maximum(horizon.astype(jnp.float32) - hp.warmup_steps, 1.0)
    progress = jnp.clip((s - hp.warmup_steps) / span, 0.0, 1.0)
    cosine = hp.peak_lr * (hp.end_lr_ratio + (1.0 - hp.end_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))
    return jnp.where(s < hp.warmup_steps, warmup, cosine)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def init_state(model_cfg: ModelConfig, hp: Hyper, seed: int, horizon: int) -> TrainState:
    """The state before step 0; one compiled program (eager init dispatches an op per tensor)."""
    model_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(model_cfg, model_key, jnp.float32)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=make_optimizer(hp).init(params),
        data_key=data_key,
        horizon=jnp.asarray(horizon, jnp.int32),
    )


# ====================================================================== loss
def _cast(params: Params, dtype) -> Params:
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def forward_both(model_cfg: ModelConfig, params: Params, windows: jax.Array):
    """Target logits ``[B, T, V]`` and MTP logits ``[B, T-1, V]`` for windows of ``T + 1`` tokens.

    Target entry ``i`` predicts ``windows[:, i+1]``; MTP entry ``k`` reads the pair
    ``(windows[:, k+1], hidden[k])`` and predicts ``windows[:, k+2]``.
    """
    inputs = windows[:, :-1]
    out = forward_with_hiddens(model_cfg, params, inputs)
    mtp_logits = mtp_head.forward_sequence(model_cfg, params, inputs,
                                           out.mtp_hidden(model_cfg.mtp_hidden_source))
    return out.logits, mtp_logits


def loss_fn(params: Params, windows: jax.Array, model_cfg: ModelConfig, hp: Hyper):
    logits, mtp_logits = forward_both(model_cfg, _cast(params, COMPUTE_DTYPES[hp.compute_dtype]), windows)
    target = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()
    mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, windows[:, 2:]).mean()
    return target + hp.mtp_weight * mtp, {"target_loss": target, "mtp_loss": mtp}


def sample_windows(key: jax.Array, stream: jax.Array, batch: int, window: int) -> jax.Array:
    """``batch`` random contiguous windows of ``window`` tokens, as int32."""
    starts = jax.random.randint(key, (batch,), 0, stream.shape[0] - window + 1)
    return stream[starts[:, None] + jnp.arange(window)[None, :]].astype(jnp.int32)


class Steps:
    """The jitted train and eval functions of one static configuration, with trace counts."""

    def __init__(self, model_cfg: ModelConfig, hp: Hyper):
        self.model_cfg, self.hp = model_cfg, hp
        self.traces = {"train": 0, "eval": 0}
        self.train = jax.jit(self._train, donate_argnums=0)
        self.eval = jax.jit(self._eval)

    def _train(self, state: TrainState, stream: jax.Array):
        self.traces["train"] += 1
        hp = self.hp
        data_key, sub = jax.random.split(state.data_key)
        windows = sample_windows(sub, stream, hp.batch_size, hp.seq_len + 1)
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, windows, self.model_cfg, hp)
        updates, opt_state = make_optimizer(hp).update(grads, state.opt_state, state.params)
        lr = learning_rate(state.step, state.horizon, hp)
        params = jax.tree.map(lambda p, u: p + lr * u, state.params, updates)
        metrics = {"loss": loss, **parts, "grad_norm": optax.tree.norm(grads), "lr": lr}
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, data_key=data_key)
        return new, metrics

    def _eval(self, params: Params, windows: jax.Array):
        """Sums over a batch of held-out windows (the caller divides by the counts)."""
        self.traces["eval"] += 1
        logits, mtp_logits = forward_both(self.model_cfg, _cast(params, COMPUTE_DTYPES[self.hp.compute_dtype]),
                                          windows)
        next_tok, after_next = windows[:, 1:], windows[:, 2:]
        target_top1 = jnp.argmax(logits, -1)
        mtp_top1 = jnp.argmax(mtp_logits, -1)
        return {
            "target_nll": optax.softmax_cross_entropy_with_integer_labels(logits, next_tok).sum(),
            "target_correct": (target_top1 == next_tok).sum(),
            "mtp_nll": optax.softmax_cross_entropy_with_integer_labels(mtp_logits, after_next).sum(),
            "mtp_correct": (mtp_top1 == after_next).sum(),
            # The target's own greedy choice for the same token: what a greedy verify accepts.
            "mtp_agree": (mtp_top1 == target_top1[:, 1:]).sum(),
        }


@functools.lru_cache(maxsize=None)
def steps_for(model_cfg: ModelConfig, hp: Hyper) -> Steps:
    return Steps(model_cfg, hp)


def evaluate(steps: Steps, params: Params, windows: np.ndarray, batch: int) -> dict[str, float]:
    """Held-out target loss/accuracy, MTP loss, MTP top-1 accuracy and target agreement.

    ``mtp_acc`` scores the MTP head's top-1 against the true token after next;
    ``mtp_agree`` against the target's own greedy prediction of that token, which is
    the teacher-forced acceptance rate of a first draft under greedy verification.
    The window set is fixed, so a short last batch costs one extra compile, once.
    """
    totals: dict[str, float] = {}
    for lo in range(0, windows.shape[0], batch):
        sums = jax.device_get(steps.eval(params, jnp.asarray(windows[lo : lo + batch])))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    n, t = windows.shape[0], windows.shape[1] - 1
    n_target, n_mtp = n * t, n * (t - 1)
    return {
        "target_loss": totals["target_nll"] / n_target,
        "target_acc": totals["target_correct"] / n_target,
        "mtp_loss": totals["mtp_nll"] / n_mtp,
        "mtp_acc": totals["mtp_correct"] / n_mtp,
        "mtp_agree": totals["mtp_agree"] / n_mtp,
        "windows": n,
        "tokens": n * windows.shape[1],
    }


# ====================================================================== checkpoints
def _manager(workdir: pathlib.Path, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        workdir / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )


def save_checkpoint(mngr: ocp.CheckpointManager, state: TrainState, meta: Mapping[str, Any]) -> None:
    """Save a host copy: the next step donates the device buffers the writer would read."""
    host = jax.device_get(state.as_dict())
    mngr.save(int(host["step"]), force=True,
              args=ocp.args.Composite(state=ocp.args.StandardSave(host), meta=ocp.args.JsonSave(dict(meta))))


def restore_checkpoint(mngr: ocp.CheckpointManager, step: int, like: TrainState) -> tuple[TrainState, dict]:
    """Restore ``step`` into the structure, shapes and device placement of ``like``."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            like.as_dict())
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    # Orbax hands back arrays committed to a device; a fresh state's are uncommitted,
    # and jit keys its executables on that, so the resumed step would compile again.
    # One trip through host memory makes them alike.
    state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), out["state"])
    return TrainState(**state), dict(out["meta"])


# ====================================================================== the loop
@dataclasses.dataclass
class TrainResult:
    state: TrainState
    model_cfg: ModelConfig
    hp: Hyper
    summary: dict
    history: list[dict]
    data_info: dict | None
    # int64[vocab_size]: each id's count in the training stream; exported for a reduced draft vocabulary.
    token_counts: np.ndarray


def _device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def fitted_horizon(step: int, horizon: int, timed_steps: int, timed_seconds: float, remaining: float) -> int:
    """The horizon a time budget affords: the steps that fit in ``remaining`` seconds at the rate so far.

    ``timed_steps`` steps took ``timed_seconds`` (overheads included). Never past ``horizon``
    and never before the next step, so a run over its budget still ends on a finished step.
    """
    fit = step + int(timed_steps / timed_seconds * max(remaining, 0.0))
    return max(step + 1, min(horizon, fit))


@dataclasses.dataclass
class _Clock:
    """This process's wall clock, split into compile, training and overhead time.

    The first step compiles, so the rate of the steps after it (``timed``) is what a time
    budget plans with; time spent in eval and checkpointing after it is ``overhead``.
    """

    start: float = dataclasses.field(default_factory=time.perf_counter)
    first: float | None = None  # when the first (compiling) step of this process finished
    overhead: float = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def training(self) -> float:
        return time.perf_counter() - self.first - self.overhead if self.first is not None else 0.0


@dataclasses.dataclass
class _Run:
    """The mutable state of one `train` call's loop, beside its fixed inputs."""

    config: Any
    model_cfg: ModelConfig
    hp: Hyper
    streams: Streams
    heldout: np.ndarray
    steps: Steps
    budget: float | None  # seconds, or None: no budget
    mngr: ocp.CheckpointManager
    state: TrainState
    meta: dict  # timings of the runs this one resumes
    resumed_from: int | None
    clock: _Clock
    log: io.TextIOBase
    pbar: tqdm | None = None  # made when the loop starts
    history: list[dict] = dataclasses.field(default_factory=list)
    metrics: dict | None = None  # the last step's, on the device
    stop_reason: str = "schedule complete"
    step: int = dataclasses.field(init=False)
    start_step: int = dataclasses.field(init=False)  # where this process began
    horizon: int = dataclasses.field(init=False)  # the schedule's end, shrunk by `replan`
    last_saved: int | None = dataclasses.field(init=False)

    def __post_init__(self):
        self.step = self.start_step = int(self.state.step)
        self.horizon = int(self.state.horizon)
        self.last_saved = self.resumed_from

    def record(self, entry: dict) -> None:
        self.history.append(entry)
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()

    def replan(self) -> None:
        """Shrink the horizon to the steps the remaining budget affords at the rate so far."""
        done = self.step - self.start_step - 1
        if self.budget is None or self.clock.first is None or done <= 0:
            return
        new = fitted_horizon(self.step, self.horizon, done, time.perf_counter() - self.clock.first,
                             self.budget - self.config.reserve_seconds - self.clock.elapsed())
        if new < self.horizon:
            self.horizon = new
            self.state = self.state.replace(horizon=jnp.asarray(new, jnp.int32))
            self.pbar.total = new
            self.pbar.refresh()

    def stop_before_step(self, stop_at_step: int | None) -> str | None:
        """Why the loop ends before its next step (an early stop or the time budget), or None."""
        if stop_at_step is not None and self.step >= stop_at_step:
            return f"stop_at_step={stop_at_step}"
        if self.budget is not None and self.clock.elapsed() >= self.budget - self.config.reserve_seconds:
            return f"time budget {self.budget:.0f}s"
        return None

    def train_step(self, stream: jax.Array) -> None:
        """One step; the first one's end marks the compile time, every ``log_every``-th is logged."""
        self.state, self.metrics = self.steps.train(self.state, stream)
        self.step += 1
        self.pbar.update(1)
        if self.clock.first is None:
            jax.block_until_ready(self.metrics)
            self.clock.first = time.perf_counter()
        if self.step % self.config.log_every == 0:
            m = {k: float(v) for k, v in jax.device_get(self.metrics).items()}
            train_s = self.clock.training()
            tok_s = ((self.step - self.start_step - 1) * self.hp.tokens_per_step / train_s
                     if train_s > 0 else float("nan"))
            self.pbar.set_postfix(loss=f"{m['loss']:.3f}", tgt=f"{m['target_loss']:.3f}",
                                  mtp=f"{m['mtp_loss']:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.record({"kind": "train", "step": self.step, **m, "tokens_per_s": tok_s,
                         "elapsed_s": self.clock.elapsed()})
        if self.step - self.start_step == self.config.calibrate_steps:
            jax.block_until_ready(self.metrics)
            self.replan()

    def periodic_work(self) -> None:
        """The held-out eval and checkpoint their intervals call for after this step, timed as overhead."""
        config = self.config
        periodic_eval = config.eval_every and self.step % config.eval_every == 0 and self.step < self.horizon
        periodic_ckpt = config.checkpoint_every and self.step % config.checkpoint_every == 0
        if not (periodic_eval or periodic_ckpt):
            return
        jax.block_until_ready(self.state)
        t0 = time.perf_counter()
        if periodic_eval:
            ev = evaluate(self.steps, self.state.params, self.heldout, config.eval_batch_size)
            self.record({"kind": "eval", "step": self.step, **ev, "elapsed_s": self.clock.elapsed()})
            tqdm.write(f"step {self.step}: held-out " + _fmt_eval(ev), file=sys.stderr)
        if periodic_ckpt:
            self.save(_meta(self.meta, self.clock.training(), self.clock.elapsed()))
        self.clock.overhead += time.perf_counter() - t0
        if periodic_eval:
            self.replan()

    def save(self, meta: dict) -> None:
        save_checkpoint(self.mngr, self.state, meta)
        self.last_saved = self.step

    def summary(self, train_seconds: float, final: dict) -> dict:
        """What `train` writes to ``summary.json``: the run's size, timings and final metrics."""
        hp, params, train_tokens = self.hp, self.state.params, int(self.streams.train.shape[0])
        timed_steps = self.step - self.start_step - 1
        return {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": _device_name(),
            "jax_version": jax.__version__,
            "python_version": platform.python_version(),
            "steps": self.step,
            "steps_this_run": self.step - self.start_step,
            "resumed_from": self.resumed_from,
            "horizon": self.horizon,
            "stop_reason": self.stop_reason,
            "batch_size": hp.batch_size,
            "seq_len": hp.seq_len,
            "tokens_per_step": hp.tokens_per_step,
            "tokens_seen": self.step * hp.tokens_per_step,
            "train_tokens": train_tokens,
            "epochs": self.step * hp.tokens_per_step / train_tokens,
            "params_total": count_params(params),
            "params_mtp": count_params(params) - count_params(params, include_mtp=False),
            "compile_seconds": self.clock.first - self.clock.start if self.clock.first is not None else None,
            "train_seconds": train_seconds,
            "overhead_seconds": self.clock.overhead,
            "wall_seconds": self.clock.elapsed(),
            "budget_seconds": self.budget,
            "train_tokens_per_s": timed_steps * hp.tokens_per_step / train_seconds if timed_steps > 0 else None,
            "traces": dict(self.steps.traces),
            "final_train": ({k: float(v) for k, v in jax.device_get(self.metrics).items()}
                            if self.metrics else None),
            "heldout": final,
            "hyper": dataclasses.asdict(hp),
            "model_config": str(self.config.model),
        }


def _start(config, workdir: pathlib.Path, max_train_seconds: float | None, log: io.TextIOBase) -> _Run:
    """The loop's inputs and its state: fresh, or restored from the newest checkpoint in ``workdir``."""
    clock = _Clock()
    model_cfg = load_model_config(config.model, config.get("model_overrides"))
    hp = Hyper.from_config(config)
    window = hp.seq_len + 1
    streams = load_streams(config.data_dir, model_cfg.vocab_size, window)
    heldout = eval_windows(streams.heldout, window, config.eval_windows)
    steps = steps_for(model_cfg, hp)
    budget = float(config.max_train_seconds if max_train_seconds is None else max_train_seconds) or None
    mngr = _manager(workdir, config.keep_checkpoints)
    state = init_state(model_cfg, hp, config.seed, config.num_train_steps)
    meta = {"train_seconds": 0.0, "wall_seconds": 0.0}
    resumed_from = mngr.latest_step()
    if resumed_from is not None:
        state, meta = restore_checkpoint(mngr, resumed_from, state)
    return _Run(config, model_cfg, hp, streams, heldout, steps, budget, mngr, state, meta, resumed_from,
                clock, log)


def train(config, workdir: str | os.PathLike, *, max_train_seconds: float | None = None,
          stop_at_step: int | None = None, progress: bool = True) -> TrainResult:
    """Train (or resume training) per ``config`` in ``workdir``; returns the final state and metrics.

    Resumes from the newest orbax checkpoint in ``workdir/checkpoints`` when there is
    one: step, parameters, optimizer state, data PRNG key and schedule horizon all
    come back, so an interrupted run continues exactly as if it had not stopped.
    ``max_train_seconds`` (default ``config.max_train_seconds``; 0 = none) bounds
    this process's wall time including compilation; the schedule horizon is shrunk
    to the steps that fit, and training stops at the budget regardless.
    ``stop_at_step`` ends this process early, as an interruption would (the state
    at that step is checkpointed).
    """
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "a") as log:
        run = _start(config, workdir, max_train_seconds, log)
        stream = jnp.asarray(run.streams.train)
        run.pbar = tqdm(total=run.horizon, initial=run.step, disable=not progress, desc="train",
                        dynamic_ncols=True, mininterval=config.progress_seconds, file=sys.stderr)
        while run.step < run.horizon:
            reason = run.stop_before_step(stop_at_step)
            if reason is not None:
                run.stop_reason = reason
                break
            run.train_step(stream)
            run.periodic_work()
        run.pbar.close()
        jax.block_until_ready(run.state)
        train_seconds = run.clock.training()
        new_meta = _meta(run.meta, train_seconds, run.clock.elapsed())
        if run.step != run.last_saved:
            run.save(new_meta)
        run.mngr.wait_until_finished()
        run.mngr.close()
        final = evaluate(run.steps, run.state.params, run.heldout, config.eval_batch_size)
        run.record({"kind": "eval", "step": run.step, **final, "elapsed_s": run.clock.elapsed(), "final": True})
    summary = run.summary(train_seconds, final)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    token_counts = np.bincount(run.streams.train, minlength=run.model_cfg.vocab_size).astype(np.int64)
    return TrainResult(run.state, run.model_cfg, run.hp, summary, run.history, run.streams.info, token_counts)


def _meta(prev: Mapping[str, Any], train_seconds: float, wall_seconds: float) -> dict:
    """Cumulative timings across resumed runs, saved beside the state."""
    return {"train_seconds": float(prev["train_seconds"]) + train_seconds,
            "wall_seconds": float(prev["wall_seconds"]) + wall_seconds}


def _fmt_eval(ev: Mapping[str, float]) -> str:
    return (f"target loss {ev['target_loss']:.4f} acc {ev['target_acc']:.4f} | "
            f"mtp loss {ev['mtp_loss']:.4f} acc {ev['mtp_acc']:.4f} agree {ev['mtp_agree']:.4f}")


# ====================================================================== export
def export_default(export_dir: str | os.PathLike, result: TrainResult, *, command: str,
                   tokenizer_path: str | os.PathLike | None = None,
                   max_shard_bytes: int | None = None) -> pathlib.Path:
    """Write the trained model as a Hugging Face checkpoint in bf16, with its model card.

    The directory holds ``config.json``, the safetensors (sharded when larger than
    ``max_shard_bytes``; ``mtp.*`` included), ``tokenizer.json`` when given, a
    ``README.md`` whose every number comes from ``result``, and ``token_counts.npy``,
    which ``experiments/generate.py --mtp_vocab_size`` needs and which only the
    training stream can give.
    """
    cfg = result.model_cfg
    extra: dict[str, Any] = {}
    if tokenizer_path is not None:
        tok = pathlib.Path(tokenizer_path)
        tok = tok if tok.is_absolute() else REPO_ROOT / tok
        import tokenizers

        size = tokenizers.Tokenizer.from_file(str(tok)).get_vocab_size()
        if size > cfg.vocab_size:
            raise TrainError(f"{tok}: {size} tokens do not fit the model's vocab_size={cfg.vocab_size}")
        extra["tokenizer.json"] = tok
    extra["README.md"] = model_card(result, command)
    counts = io.BytesIO()
    np.save(counts, result.token_counts, allow_pickle=False)
    extra[TOKEN_COUNTS_NAME] = counts.getvalue()
    params = _cast(jax.device_get(result.state.params), jnp.bfloat16)
    return save_pretrained(export_dir, cfg, params, max_shard_bytes=max_shard_bytes,
                           metadata={"producer": "mtp.train"}, extra_files=extra)


def model_card(result: TrainResult, command: str) -> str:
    s, cfg, hp = result.summary, result.model_cfg, result.hp
    ev = s["heldout"]
    layers = ", ".join("A" if t == "full_attention" else "L" for t in cfg.layer_types)
    lines = [
        "# Default MTP model (Qwen3-Next-shaped hybrid, trained by this repository)",
        "",
        "A small hybrid language model with one MTP (multi-token prediction) layer, trained",
        "jointly from scratch by `mtp/train.py` so that the speculative-decoding experiments",
        "of this repository have a real target and drafter to run without any download.",
        "It is a research artefact: small, trained for minutes, on Python source only.",
        "",
        "## Architecture",
        "",
        f"* {cfg.num_hidden_layers} layers, pattern `{layers}` (L = Gated DeltaNet, A = gated attention,"
        f" full_attention_interval {cfg.full_attention_interval})",
        f"* hidden {cfg.hidden_size}, attention {cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads"
        f" of {cfg.head_dim}, partial RoPE {cfg.partial_rotary_factor}",
        f"* Gated DeltaNet {cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value heads of"
        f" {cfg.linear_key_head_dim} / {cfg.linear_value_head_dim}, conv kernel {cfg.linear_conv_kernel_dim}",
        f"* dense SiLU FFN, intermediate {cfg.intermediate_size}; vocab {cfg.vocab_size};"
        f" tied embeddings: {cfg.tie_word_embeddings}",
        f"* one MTP layer (`mtp.*`), fed the target's `{cfg.mtp_hidden_source}` hidden",
        f"* parameters: {s['params_total']:,} total, of which MTP {s['params_mtp']:,}; stored in bfloat16",
        "",
        "## Training",
        "",
        "```",
        command,
        "```",
        "",
        f"* loss: target next-token CE + {hp.mtp_weight} x MTP token-after-next CE (gradients reach the"
        " target through the hidden)",
        f"* AdamW (b1 {hp.b1}, b2 {hp.b2}, weight decay {hp.weight_decay}), peak LR {hp.peak_lr},"
        f" {hp.warmup_steps} warmup steps, cosine to {hp.end_lr_ratio} x peak at step {s['horizon']},"
        f" global-norm clip {hp.clip_norm}; {hp.compute_dtype} compute, float32 master weights",
        f"* batch {hp.batch_size} x {hp.seq_len} tokens (random contiguous windows of the token stream)",
        f"* steps: {s['steps']} ({s['stop_reason']}); tokens seen {s['tokens_seen']:,}"
        f" ({s['epochs']:.2f} passes over {s['train_tokens']:,} training tokens)",
        f"* device: {s['device']}, JAX {s['jax_version']}; date {s['date']}",
        f"* wall time {s['wall_seconds']:.0f} s (compile {s['compile_seconds']:.0f} s,"
        f" eval + checkpoints {s['overhead_seconds']:.0f} s);"
        f" throughput {s['train_tokens_per_s']:,.0f} tokens/s",
        "",
        "## Data",
        "",
    ]
    info = result.data_info
    if info:
        c, tk = info["corpus"], info["tokens"]
        lines += [
            f"The CPython {c['python_version']} standard library source ({c['python_implementation']}),"
            f" built by `{info.get('command', 'python -m experiments.build_data')}`; part of the files"
            " rendered as chat transcripts.",
            "",
            f"* split: {c['split_rule']}",
            f"* training: {c['train_files']} files, {tk['train']['documents']} documents,"
            f" {tk['train']['tokens']:,} tokens",
            f"* held-out: {c['heldout_files']} files, {tk['heldout']['documents']} documents,"
            f" {tk['heldout']['tokens']:,} tokens",
            f"* corpus fingerprint `{c['fingerprint']}`",
        ]
    else:
        lines.append("No data_info.json accompanied the token arrays.")
    lines += [
        "",
        f"## Held-out metrics (final, {ev['windows']} windows of {hp.seq_len + 1} tokens)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| target loss (nats/token) | {ev['target_loss']:.4f} |",
        f"| target top-1 accuracy | {ev['target_acc']:.4f} |",
        f"| MTP loss, token after next | {ev['mtp_loss']:.4f} |",
        f"| MTP top-1 accuracy, token after next | {ev['mtp_acc']:.4f} |",
        f"| MTP top-1 = target's greedy token (teacher-forced first-draft acceptance) | {ev['mtp_agree']:.4f} |",
        "",
        "## Use",
        "",
        "Load with `mtp.checkpoint.load_pretrained(dir)`; the tokenizer is `tokenizer.json`",
        "(byte-level BPE with `<|endoftext|>`, `<|system|>`, `<|user|>`, `<|assistant|>`).",
        "Good only for Python-like text; it is a small model for measuring speculative decoding.",
        f"`{TOKEN_COUNTS_NAME}` counts each token id in the training split; `experiments/generate.py"
        " --mtp_vocab_size N` drafts over the N most frequent.",
        "",
    ]
    return "\n".join(lines)
