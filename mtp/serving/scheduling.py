"""Sessions of turns through an engine: how each turn's prompt is formed, and the waves that serve them."""

from __future__ import annotations

import collections

from mtp.serving.config import TurnRequest, TurnResult
from mtp.serving.engine import Engine


class TextPrompts:
    """Forms each turn's prompt from a session's text, by token append or by re-rendering.

    ``append``: the previous full sequence's ids plus the encoded user suffix (the
    serving engine's view; prompts strictly extend the previous sequence).
    ``rerender``: the whole conversation rendered as text and tokenized afresh, as a
    chat client does, so turn boundaries may re-tokenize.
    """

    MODES = ("append", "rerender")

    def __init__(self, tokenizer, preamble: str, mode: str = "append"):
        if mode not in self.MODES:
            raise ValueError(f"unknown prompt mode {mode!r}; choose one of {', '.join(self.MODES)}")
        self.tokenizer, self.preamble, self.mode = tokenizer, preamble, mode

    def prompt(self, session, turn_index: int, prev_full: list[int] | None, history) -> list[int]:
        from mtp.data import sessions as S

        user = session.turns[turn_index].user
        if prev_full is None:
            return S.first_prompt_ids(self.preamble, user, self.tokenizer)
        if self.mode == "append":
            return S.next_prompt_ids_append(prev_full, user, self.tokenizer)
        return S.next_prompt_ids_rerender(self.preamble, history, user, self.tokenizer)

    def reply_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def session_waves(engine: Engine, sessions, prompts):
    """Serve every turn of every session, one wave of up to ``batch_slots`` distinct sessions
    per step of this generator, which yields each wave's results.

    Turn ``i`` of a session is served only after its turn ``i - 1`` (its prompt
    extends that turn's full sequence). Sessions take slots in order, so with one
    slot each session runs to its end before the next begins. A caller that advances
    several engines' generators in turn serves them side by side, each on exactly the
    schedule it would follow alone.
    """
    state = {s.session_id: (0, None, []) for s in sessions}  # next turn, prev full ids, history
    pending = collections.deque(sessions)
    while pending:
        wave = []
        for s in list(pending):
            if len(wave) == engine.ecfg.batch_slots:
                break
            wave.append(s)
        reqs = []
        for s in wave:
            i, prev, history = state[s.session_id]
            ids = prompts.prompt(s, i, prev, history)
            reqs.append(TurnRequest(s.session_id, tuple(ids), s.turns[i].max_new_tokens))
        results = engine.run_wave(reqs)
        for s, res in zip(wave, results):
            i, prev, history = state[s.session_id]
            history = history + [(s.turns[i].user, prompts.reply_text(res.output))]
            state[s.session_id] = (i + 1, list(res.request.prompt) + res.output, history)
            if i + 1 == len(s.turns):
                pending.remove(s)
        yield results


def run_sessions(engine: Engine, sessions, prompts, on_turn=None) -> list[TurnResult]:
    """Every turn of every session (`session_waves`), in the order served."""
    results = []
    for wave in session_waves(engine, sessions, prompts):
        for res in wave:
            results.append(res)
            if on_turn is not None:
                on_turn(res)
    return results


__all__ = ["TextPrompts", "run_sessions", "session_waves"]
