"""Shared fixtures: the tiny test configs of configs/models with random weights."""

from __future__ import annotations

import pathlib

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


GEMM_LAYOUTS = ("plain", "padded", "merged", "padded_merged")


@pytest.fixture
def gemm_layout(request, monkeypatch):
    """The GPU's decode GEMM layouts, forced on a CPU (each read at trace time).

    "padded": ``dense``'s small-row padding, every projection of < 8 rows (and so the
    one-row residual stream) padded; "merged": ``dense_columns`` merges projections of
    one input into one GEMM.
    """
    from mtp.model import layers

    padded, merged = request.param in ("padded", "padded_merged"), "merged" in request.param
    monkeypatch.setenv("MTP_PAD_SMALL_GEMMS", "1" if padded else "0")
    monkeypatch.setenv("MTP_MERGE_PROJECTIONS", "1" if merged else "0")
    monkeypatch.setattr(layers, "PAD_MIN_WEIGHT", 0)
    monkeypatch.setattr(layers, "PAD_ROWS", 8)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()
