"""Shared fixtures: the tiny test configs of configs/models with random weights."""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import re

import jax
import pytest

from mtp.config import ModelConfig
from mtp.model import params as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ("tiny_dense", "tiny_moe")


def tiny_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(ROOT / "configs" / "models" / f"{name}.json")


def random_params(cfg: ModelConfig, seed: int = 0, dtype=None):
    import jax.numpy as jnp

    p = P.init_params(cfg, jax.random.key(seed), dtype or jnp.float32)
    return P.perturb_norms(p, jax.random.key(seed + 1))


def agreeing_params(cfg, seed: int, mixing: float):
    """Random weights whose MTP head agrees with the target often but not always.

    The target's token mixers and FFNs are scaled down by ``mixing``, so its next
    token is mostly a function of the last token; the head's fc passes the
    embedding through, so it predicts that same function one step ahead. The
    mixers still matter (``mixing > 0``), so drafts are accepted and rejected in
    one run and every sharded layer shapes the output.
    """
    import jax.numpy as jnp

    from mtp.model.params import flatten, unflatten

    flat = dict(flatten(random_params(cfg, seed)))
    for name, w in flat.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            flat[name] = w * mixing
    for name in ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"):
        flat[name] = jnp.zeros_like(flat[name])
    h = cfg.hidden_size
    flat["mtp.fc.weight"] = jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], axis=1)
    return unflatten(flat)


def per_expert_tensors(params) -> dict:
    """The params' tensors (host arrays) named as a per-expert checkpoint names them, as transformers
    writes a MoE model: each stacked ``...mlp.experts.gate_proj.weight`` [E, I, H] becomes
    ``...mlp.experts.{e}.gate_proj.weight`` [I, H]. Spelled out here, apart from `mtp.hf_layout`,
    so that tests can write a checkpoint the way a third party does."""
    import numpy as np

    from mtp.model.params import EXPERT_STACK, flatten

    out = {}
    for name, value in flatten(params).items():
        m = EXPERT_STACK.match(name)
        if m is None:
            out[name] = np.asarray(value)
        else:
            out.update({f"{m['stem']}{e}.{m['proj']}.weight": np.asarray(w) for e, w in enumerate(value)})
    return out


class IdPrompts:
    """Sessions whose user chunks are token ids (``Turn.user`` holds them space-separated),
    for `mtp.serving.run_sessions` without a tokenizer.

    ``retokenize = n > 0`` rewrites the ``n``-th last token of the previous full sequence:
    at 1, as a chat template re-tokenizing a turn boundary would; deeper, inside the
    previous output, so that the carry's truncation drops rows it holds.
    """

    def __init__(self, preamble, retokenize: int = 0):
        self.preamble, self.retokenize = list(preamble), retokenize

    def prompt(self, session, i, prev, history):
        user = [int(x) for x in session.turns[i].user.split()]
        if prev is None:
            return self.preamble + user
        prev = list(prev)
        if self.retokenize:
            prev[-self.retokenize] = (prev[-self.retokenize] + 1) % 97 or 1
        return prev + user

    def reply_text(self, ids):
        return " ".join(map(str, ids))


def turn_decisions(stats) -> dict:
    """What the engine decided for a turn (`mtp.serving.TurnStats`), for comparing two runs of it
    (its acceptance compares apart, by `AcceptanceStats.counts`; its timings never)."""
    return {k: getattr(stats, k) for k in ("path", "cached_tokens", "prefilled_tokens", "drafter_prefilled",
                                           "drafter_adopted", "drafter_appended", "carry_outcome", "carry_armed",
                                           "output_len", "start_calls")}


def id_sessions(n: int, turns: int, seed: int, max_new: int = 10):
    """``n`` sessions of ``turns`` turns, each a user chunk of 4-19 random ids in [1, 97) and a
    reply budget of 4..``max_new`` tokens (for `IdPrompts`)."""
    import numpy as np

    from mtp.data.sessions import Session, Turn

    rng = np.random.default_rng(seed)
    return [Session(f"s{k}", "synthetic", tuple(
        Turn(" ".join(map(str, rng.integers(1, 97, rng.integers(4, 20)))), int(rng.integers(4, max_new + 1)))
        for _ in range(turns))) for k in range(n)]


def paged_cache(cfg: ModelConfig, batch: int, blocks: int, page: int = 4, cls=None):
    """An empty f32 cache (``cls``: the target's by default) whose rows own ``blocks`` pages
    each (page 4: rows cross pages)."""
    import jax.numpy as jnp
    import numpy as np

    from mtp.cache.pages import PageAllocator, block_table_row
    from mtp.cache.state import TargetCache

    pool = PageAllocator(batch * blocks + 1, page)
    tables = np.stack([block_table_row(pool.allocate(blocks), blocks) for _ in range(batch)])
    return (cls or TargetCache).create(cfg, batch, pool.num_pages, page, blocks, jnp.float32).replace(
        block_tables=jnp.asarray(tables))


@pytest.fixture(scope="session", params=TINY)
def tiny(request):
    cfg = tiny_config(request.param)
    return cfg, random_params(cfg)


GEMM_LAYOUTS = ("plain", "padded", "merged", "padded_merged", "merged_reduced")


def gemm_layout_config(name: str):
    """The `ExecutionConfig` of a ``GEMM_LAYOUTS`` name: the GPU's decode GEMM layouts, forced on a CPU.

    "padded": ``dense``'s small-row padding, every projection of < 8 rows (and so the
    one-row residual stream) padded; "merged": ``dense_columns`` merges projections of
    one input into one GEMM; "reduced": ``linear`` writes every product of 2..16 rows as a
    reduction (a GPU stops at 4 rows; 16 takes in the tests' verifies of 3 sequences, while
    prefills stay GEMMs). A GPU pads only large weights and reduces only small ones, so a
    tiny test model takes one or the other.
    """
    from mtp.execution import ExecutionConfig

    return ExecutionConfig(pad_small_gemms=name in ("padded", "padded_merged"), merge_projections="merged" in name,
                           small_gemms_as_reduce="reduced" in name, pad_min_weight=0, pad_rows=8, reduce_max_rows=16)


@pytest.fixture
def gemm_layout(request):
    """`gemm_layout_config` of the parametrized name: what a test hands the model as its ``execution``."""
    return gemm_layout_config(request.param)


def decode_through_kernel(monkeypatch, module, kernel: str, op: str, decode_steps: int = 3, verify: int = 0,
                          model: str = "tiny_dense", page: int = 4, layout=None):
    """Prefill, ``decode_steps`` decode steps and a verify of ``verify`` tokens (0: none) on
    ``model`` (random weights, KV pages of ``page`` tokens), once with ``op`` on its reference and
    once through ``module.<kernel>`` in interpret mode, every other op on its reference, in the
    GEMM ``layout`` (an `ExecutionConfig`, the default's when None). Returns
    ``{choice: (logits, cache)}``, the logits of every step flattened, after checking that the
    kernel ran."""
    import jax.numpy as jnp
    import numpy as np

    from mtp.execution import ExecutionConfig
    from mtp.model import target

    cfg = tiny_config(model)
    params = random_params(cfg, seed=4)
    b, blocks = 2, -(-24 // page)
    toks = jax.random.randint(jax.random.key(2), (b, 16), 0, cfg.vocab_size)
    lens = jnp.asarray([7, 4], jnp.int32)
    calls = []
    run = getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda *a, **k: calls.append(1) or run(*a, **k))
    results = {}
    for choice in ("reference", "interpret"):
        execution = dataclasses.replace(layout or ExecutionConfig(), kernels=(("", "reference"), (op, choice)))
        cache = paged_cache(cfg, b, blocks, page)
        cache, _ = target.prefill(cfg, params, cache, toks[:, :8], jnp.zeros(b, jnp.int32), lens, execution=execution)
        out = []
        for step in range(decode_steps):
            cache, o = target.decode(cfg, params, cache, toks[np.arange(b), lens + step][:, None], execution=execution)
            out.append(o.logits)
        if verify:
            at = lens[:, None] + decode_steps + jnp.arange(verify)[None, :]
            cache, o = target.verify(cfg, params, cache, jnp.take_along_axis(toks, at, axis=1), execution=execution)
            out.append(o.logits)
        results[choice] = (np.concatenate([np.asarray(x).reshape(-1) for x in out]), cache)
    assert calls, "the kernel never ran"
    return results


# ------------------------------------------------------------------ a worker's address space
def _mapped_regions() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no per-process map limit to keep under
        return None


def _map_limit() -> int:
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True)
def _under_the_map_limit():
    """Drops JAX's compiled programs after a test once the worker holds half the kernel's
    ``vm.max_map_count`` memory mappings. Every CPU executable XLA loads maps a few regions, and
    tests that run reference paths op by op load thousands (one test file: ~18,000 mappings); a
    worker that has run a few hundred tests then reaches the limit (65,530 by default), an mmap
    inside XLA fails, and the worker dies of a segfault. Recompiling afterwards is cheap: the
    persistent compile cache serves what took long to build."""
    yield
    regions = _mapped_regions()
    if regions is not None and regions > _map_limit() // 2:
        jax.clear_caches()
        gc.collect()


# ------------------------------------------------------------------ the fast test loop
SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


def _slow_tests() -> dict[str, str]:
    """``tests/slow_tests.txt``: test id -> the note beside it (its measured time)."""
    out = {}
    for line in SLOW_LIST.read_text().splitlines():
        test_id, _, note = line.partition("#")
        if test_id.strip():
            out[test_id.strip()] = note.strip()
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the default loop (`bash scripts/test.sh`); "
                                       "`bash scripts/test.sh --full` and CI run it")


def pytest_collection_modifyitems(config, items):
    """Marks the tests ``slow_tests.txt`` lists as ``slow``: a list of ids with their measured times
    rather than markers spread over the files, so the split is one reviewable table. An id may name
    a test (``file::name``, every parametrisation) or one case (``file::name[param]``). An entry
    that matches no collected test fails the run when whole files were collected, so the list
    cannot rot into naming tests that no longer exist."""
    listed = _slow_tests()
    used = set()
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        for key in (item.nodeid, base):
            if key in listed:
                item.add_marker(pytest.mark.slow)
                used.add(key)
    files = {item.nodeid.split("::", 1)[0] for item in items}
    whole_files = not config.option.keyword and all("::" not in arg for arg in config.args)
    stale = [k for k in listed if k not in used and k.split("::", 1)[0] in files]
    if stale and whole_files:
        raise pytest.UsageError(f"{SLOW_LIST.name} names tests that do not exist: {', '.join(stale)}")
    _costliest_files_first(items, listed)


def _costliest_files_first(items, listed: dict[str, str]) -> None:
    """Orders the files by the longest test ``slow_tests.txt`` lists for each, longest first, each
    file's tests kept together and in order (a module's fixtures are made once). Under
    pytest-xdist's worksteal the longest tests then start at once while the other worker takes the
    rest, instead of one long test (the sharding worker's minutes) starting last and running alone."""
    cost: dict[str, float] = {}
    for test_id, note in listed.items():
        m = re.match(r"([0-9.]+) s", note)
        file = test_id.split("::", 1)[0]
        cost[file] = max(cost.get(file, 0.0), float(m.group(1)) if m else 0.0)
    position = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-cost.get(item.nodeid.split("::", 1)[0], 0.0), position[item]))
