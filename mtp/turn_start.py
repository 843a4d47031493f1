"""A turn's start once its target prefill has run: the first token, the hidden it came from, and
the drafter rows read from the prefill's captured hiddens.

One-shot generation (`mtp.generation.prepare_decode`) and the serving engine
(`mtp.serving.steps.prefill_slot`) both start their turns with `start_turn`, so a prompt's
first token and its drafter's rows are the same whichever client serves it. What differs stays
with the clients: generation prefills a padded batch in one call and reads the hiddens straight
from that call's output; the engine prefills one batch slot per aligned chunk, keeps the hiddens
in a per-slot store, and runs `start_turn` inside its jitted chunk step.

Everything here traces under `jax.jit` (the engine's steps) and runs eagerly too (generation,
whose `append_rows` calls are jitted on their own).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp.config import ModelConfig
from mtp.execution import ExecutionConfig
from mtp.model.params import Params
from mtp.model.target import StepOutput
from mtp.mtp_head import PREFILL_CHUNK, DrafterCache, append_chunks, append_rows
from mtp.speculative import pick_token


@struct.dataclass
class DrafterRows:
    """One `mtp_head.append_rows` call: rows for pair keys ``first_key[b] + i`` (``i < count[b]``),
    key ``k`` pairing ``tokens[b, k - first_key[b]] = t[k + 1]`` with the captured hidden at ``k``."""

    tokens: jax.Array  # [B, W] int32, W an `APPEND_BUCKETS` width; anything past ``count``
    first_key: jax.Array  # [B] int32
    count: jax.Array  # [B] int32


def drafter_rows(tokens: jax.Array, first_key, count, *, chunk: int = PREFILL_CHUNK) -> list[DrafterRows]:
    """The `append_rows` calls (`append_chunks`) that write keys ``first_key[b] .. first_key[b] +
    count[b] - 1`` of a batch whose ``tokens [B, L]`` are in sequence space.

    ``first_key`` and ``count`` are host integers: how many calls run, and how wide, is
    decided on the host, so each width compiles once.
    """
    first_key = np.asarray(first_key, np.int32)
    count = np.asarray(count, np.int32)
    length = tokens.shape[1]
    out = []
    for off, width in append_chunks(int(count.max(initial=0)), chunk):
        keys = first_key[:, None] + off + np.arange(width)[None, :]
        next_tokens = jnp.take_along_axis(tokens, jnp.asarray(np.clip(keys + 1, 0, length - 1)), axis=1)
        out.append(DrafterRows(tokens=next_tokens, first_key=jnp.asarray(first_key + off),
                               count=jnp.asarray(np.clip(count - off, 0, width).astype(np.int32))))
    return out


def append_from_hiddens(cfg: ModelConfig, params: Params, dcache: DrafterCache, rows: DrafterRows,
                        hiddens: jax.Array, *, execution: ExecutionConfig) -> DrafterCache:
    """Append ``rows`` after the resident rows, key ``k`` reading ``hiddens[b, k]``.

    ``hiddens [B, S, H]`` are the target's captured hiddens in sequence space (a prefill's output,
    or the engine's hidden store): a whole-prompt drafter prefill and a carry's tail append are
    this call over different keys.
    """
    keys = jnp.clip(rows.first_key[:, None] + jnp.arange(rows.tokens.shape[1])[None, :], 0, hiddens.shape[1] - 1)
    h = jnp.take_along_axis(hiddens, keys[..., None], axis=1)
    return append_rows(cfg, params, dcache, rows.tokens, h, rows.first_key, rows.count, execution=execution)


def first_from_prefill(out: StepOutput, count: jax.Array, source: str, temperature: float, key):
    """The prefill's output token and the hidden that produced it, per row: position
    ``count[b] - 1`` of the call (its last real token), or the only position when the prefill
    returned each row's last logits alone."""
    last = jnp.maximum(count - 1, 0)
    logits = out.logits[:, -1] if out.logits.shape[1] == 1 else jnp.take_along_axis(
        out.logits, last[:, None, None], axis=1)[:, 0]
    hidden = jnp.take_along_axis(out.mtp_hidden(source), last[:, None, None], axis=1)[:, 0]
    return pick_token(logits, temperature, key), hidden


def start_turn(cfg: ModelConfig, params: Params, out: StepOutput, count: jax.Array, hiddens: jax.Array,
               dcache: DrafterCache | None, appends: Sequence[DrafterRows], *, temperature: float, key,
               execution: ExecutionConfig):
    """The first token and its hidden (`first_from_prefill`, ``count[b]`` tokens prefilled in
    ``out``), and ``appends`` written into ``dcache`` from ``hiddens`` (`append_from_hiddens`).

    Sampled (``temperature > 0``), the token is drawn with ``key``. Returns ``(token [B], hidden
    [B, H], dcache)``; a run without a drafter passes ``dcache=None`` and no ``appends``.
    """
    token, hidden = first_from_prefill(out, count, cfg.mtp_hidden_source, temperature, key)
    for rows in appends:
        dcache = append_from_hiddens(cfg, params, dcache, rows, hiddens, execution=execution)
    return token, hidden, dcache


__all__ = ["DrafterRows", "append_from_hiddens", "drafter_rows", "first_from_prefill", "start_turn"]
