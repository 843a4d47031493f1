"""`target.lm_head`'s one-row padding (``MTP_PAD_LM_HEAD``): the same logits, the pad only where switched on."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from mtp.model import layers, target


def _head(key, vocab=33_000, hidden=256):
    assert vocab * hidden > layers.PAD_MIN_WEIGHT  # a weight `dense` would pad
    w = (0.05 * jax.random.normal(key, (vocab, hidden), jnp.float32)).astype(jnp.bfloat16)
    return types.SimpleNamespace(tie_word_embeddings=False), {"lm_head": {"weight": w}}


def test_a_padded_row_gives_the_same_logits(monkeypatch):
    cfg, params = _head(jax.random.key(0))
    for lead in ((1,), (1, 1), (3,)):
        h = jax.random.normal(jax.random.fold_in(jax.random.key(1), len(lead)), (*lead, 256)).astype(jnp.bfloat16)
        monkeypatch.delenv("MTP_PAD_LM_HEAD", raising=False)
        plain = target.lm_head(cfg, params, h)
        monkeypatch.setenv("MTP_PAD_SMALL_GEMMS", "1")  # what a GPU does by default
        monkeypatch.setenv("MTP_PAD_LM_HEAD", "1")
        padded = target.lm_head(cfg, params, h)
        text = str(jax.make_jaxpr(lambda h: target.lm_head(cfg, params, h))(h))
        assert ("pad" in text) == (np.prod(lead) == 1)  # one row padded; more rows as they are
        assert padded.shape == plain.shape == (*lead, 33_000) and padded.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=1e-6, atol=1e-6)
        monkeypatch.setenv("MTP_PAD_SMALL_GEMMS", "0")  # the GEMM-padding switch still decides
        assert "pad" not in str(jax.make_jaxpr(lambda h: target.lm_head(cfg, params, h))(h))
        monkeypatch.delenv("MTP_PAD_SMALL_GEMMS")
