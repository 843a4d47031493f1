"""Multi-turn evaluation sessions and the chat template they share with training.

A session is what the drafter carry is measured on: a fixed preamble (a chat
template's system part), then turns, each a user chunk of real lines from a held-out
stdlib file followed by a reply the model generates at run time. Every turn's prompt
strictly extends the previous turn's full sequence (prompt + reply), which is the
property the carry relies on.

Template (a turn's prompt ends with ``<|assistant|>\\n``)::

    <|system|>\\n{preamble}\\n<|user|>\\n{chunk}\\n<|assistant|>\\n{reply}\\n<|user|>\\n...<|assistant|>\\n

The training stream renders part of its documents with this same template, built by
the same walk over a file (``conversations_from_file``), so the model learns the
markers and that after ``<|assistant|>\\n`` the file simply continues. A real Qwen
checkpoint's tokenizer (one with ``<|im_start|>`` and ``<|im_end|>``) gets its own
ChatML layout instead (``template_for``), so the sessions reach it as its chat format.

Sessions are built deterministically: every random draw comes from a ``random.Random``
seeded by sha256 of (seed, purpose, file path), so one file's sessions do not depend on
which other files exist or on the order they are visited.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import re
from typing import Callable, Iterable, Sequence

from mtp.data.tokenizer import ASSISTANT_TOKEN, SYSTEM_TOKEN, USER_TOKEN, Tokenizer

PREAMBLE = """\
You are a Python coding assistant working inside a code editor. The user shares a \
Python source file a few lines at a time. After each part, continue the file from the \
point where the user stopped: write the next lines of code as they would most \
plausibly appear in the real file, in the same style, with the same indentation and \
the same names. Reply with code only: no explanations, no markdown fences, and no \
repetition of the lines the user already sent. If the user's lines stop in the middle \
of a function, finish that function; if they stop between definitions, begin the next \
one. Prefer the standard library to third-party packages, keep behaviour compatible \
with the code already shown, and do not add imports the file does not need.

Code style guide:
- Follow PEP 8: four spaces per indentation level, lines shorter than 80 characters, \
two blank lines between top-level definitions.
- Name functions and variables in lower_case_with_underscores, classes in CapWords, \
and module constants in UPPER_CASE.
- Give every public function and class a docstring that says what it is for; keep \
comments short and about why, not what.
- Raise specific exceptions with a message that names the bad value; never hide \
errors behind a bare except clause.
- Use context managers for files and locks, f-strings for formatting, and `is` or \
`is not` when comparing with None.
- Keep functions small, return early instead of nesting deeply, and avoid global \
mutable state."""

# The shipped session files (built by experiments/build_data.py).
DEFAULT_SESSIONS_DIR = pathlib.Path(__file__).resolve().parents[2] / "assets" / "sessions"
EVAL_SESSIONS_FILE = "eval_sessions.jsonl"
PREAMBLE_ONLY_FILE = "preamble_only.jsonl"
PREAMBLE_FILE = "preamble.txt"

# A session starts at a definition (a method counts: test modules keep everything inside
# classes), so it begins at a natural boundary rather than mid-expression and rarely
# inside a license header.
_DEFINITION_START = re.compile(r"^[ \t]*(?:@|def |class |async def )")


# ---------------------------------------------------------------------------------
# Template


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """How a session is laid out as text: ``head`` (the system part), then per turn ``ask``
    (the user's chunk and the opening of the reply), the reply, and ``close`` before the
    next ``ask``. ``close`` may start with a special token the model itself emits to end
    its reply (ChatML's ``<|im_end|>``, its EOS): the append path then adds only the rest.
    """

    name: str
    head: str  # ``{preamble}``
    ask: str  # ``{user}``
    close: str = ""
    close_token: str = ""  # the special token ``close`` starts with, if any

    def transcript(self, preamble: str, history: Sequence[tuple[str, str]]) -> str:
        """The full sequence after the turns in ``history`` (through the last reply's ``close``).

        A reply text may end with ``close_token`` (the model stopped on it): it is not
        written twice.
        """
        return self.head.format(preamble=preamble) + "".join(
            self.ask.format(user=u) + (r.removesuffix(self.close_token) if self.close_token else r) + self.close
            for u, r in history)

    def continuation(self, prev_full_ids: Sequence[int], user_chunk: str, tok: Tokenizer) -> list[int]:
        """The ids that turn a full sequence into the next turn's prompt (the append path)."""
        close = self.close
        if self.close_token and prev_full_ids and prev_full_ids[-1] == tok.hf.token_to_id(self.close_token):
            close = close.removeprefix(self.close_token)
        return tok.encode(close + self.ask.format(user=user_chunk))


PROJECT_TEMPLATE = ChatTemplate("project", head=f"{SYSTEM_TOKEN}\n{{preamble}}",
                                ask=f"\n{USER_TOKEN}\n{{user}}\n{ASSISTANT_TOKEN}\n")
CHATML_TEMPLATE = ChatTemplate("chatml", head="<|im_start|>system\n{preamble}<|im_end|>\n",
                               ask="<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n",
                               close="<|im_end|>\n", close_token="<|im_end|>")


def template_for(tok: Tokenizer) -> ChatTemplate:
    """ChatML for a tokenizer that has its markers (Qwen's), else the shipped model's template."""
    chatml = all(tok.hf.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>"))
    return CHATML_TEMPLATE if chatml else PROJECT_TEMPLATE


def user_suffix(user_chunk: str) -> str:
    """The text that turns a full sequence into the next turn's prompt (the shipped template)."""
    return PROJECT_TEMPLATE.ask.format(user=user_chunk)


def render_transcript(preamble: str, history: Sequence[tuple[str, str]],
                      template: ChatTemplate = PROJECT_TEMPLATE) -> str:
    """The full sequence after the turns in ``history`` (ends with the last reply)."""
    return template.transcript(preamble, history)


def render_conversation(preamble: str, turns: Sequence[tuple[str, str]], next_user: str,
                        template: ChatTemplate = PROJECT_TEMPLATE) -> str:
    """The prompt for the turn whose user chunk is ``next_user``; ends where the reply begins
    (``<|assistant|>\\n`` in the shipped template).

    ``turns`` are the earlier (user_text, reply_text) pairs.
    """
    return template.transcript(preamble, turns) + template.ask.format(user=next_user)


def first_prompt_ids(preamble: str, user_chunk: str, tok: Tokenizer) -> list[int]:
    return tok.encode(render_conversation(preamble, [], user_chunk, template_for(tok)))


def next_prompt_ids_append(prev_full_ids: Sequence[int], user_chunk: str, tok: Tokenizer) -> list[int]:
    """Next prompt by appending tokens: the previous ids are kept exactly.

    This is the serving engine's view of a multi-turn session and what makes the
    prompt a strict token extension of the previous full sequence.
    """
    return list(prev_full_ids) + template_for(tok).continuation(prev_full_ids, user_chunk, tok)


def next_prompt_ids_rerender(
    preamble: str, history: Sequence[tuple[str, str]], user_chunk: str, tok: Tokenizer
) -> list[int]:
    """Next prompt by re-rendering the whole conversation text and tokenizing afresh.

    This is what a chat API client does. The text equals the append path's, but the
    ids may differ where a reply's tokens are not the canonical encoding of its text
    or where a merge crosses a turn boundary; the carry must then see a prefix
    mismatch rather than adopt rows for different tokens.
    """
    return tok.encode(render_conversation(preamble, history, user_chunk, template_for(tok)))


# ---------------------------------------------------------------------------------
# Session records and files


@dataclasses.dataclass(frozen=True)
class Turn:
    user: str
    max_new_tokens: int
    # The file's own lines after the user chunk (what a perfect assistant would write):
    # the training stream uses it as the reply; at evaluation the model's output replaces it.
    reference: str = ""


@dataclasses.dataclass(frozen=True)
class Session:
    session_id: str
    source: str
    turns: tuple[Turn, ...]

    def to_json(self) -> str:
        obj = {
            "session_id": self.session_id,
            "source": self.source,
            "turns": [
                {"user": t.user, "max_new_tokens": t.max_new_tokens, "reference": t.reference}
                for t in self.turns
            ],
        }
        # ASCII-only so no U+2028-style character can split a line for a naive reader.
        return json.dumps(obj, ensure_ascii=True)


def write_sessions(path: str | os.PathLike, sessions: Iterable[Session]) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(s.to_json() + "\n" for s in sessions).encode("ascii"))


def _parse_session(obj: object, where: str) -> Session:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key, typ in (("session_id", str), ("source", str), ("turns", list)):
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r}")
        if not isinstance(obj[key], typ):
            raise ValueError(f"{where}: {key!r} must be a {typ.__name__}, got {type(obj[key]).__name__}")
    if not obj["session_id"]:
        raise ValueError(f"{where}: 'session_id' is empty")
    if not obj["turns"]:
        raise ValueError(f"{where}: 'turns' is empty")
    turns = []
    for k, t in enumerate(obj["turns"]):
        at = f"{where}: turn {k}"
        if not isinstance(t, dict):
            raise ValueError(f"{at}: expected an object, got {type(t).__name__}")
        user, mnt, ref = t.get("user"), t.get("max_new_tokens"), t.get("reference", "")
        if not isinstance(user, str) or not user:
            raise ValueError(f"{at}: 'user' must be a non-empty string, got {user!r}")
        if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt <= 0:
            raise ValueError(f"{at}: 'max_new_tokens' must be a positive integer, got {mnt!r}")
        if not isinstance(ref, str):
            raise ValueError(f"{at}: 'reference' must be a string, got {type(ref).__name__}")
        turns.append(Turn(user, mnt, ref))
    return Session(obj["session_id"], obj["source"], tuple(turns))


def load_sessions(path: str | os.PathLike) -> list[Session]:
    """Read a sessions JSONL file; errors name the file and the 1-based line number."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no sessions file at {path}")
    sessions, seen = [], {}
    text = path.read_text(encoding="utf-8")
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        session = _parse_session(obj, where)
        if session.session_id in seen:
            raise ValueError(f"{where}: duplicate session_id {session.session_id!r} (first on line {seen[session.session_id]})")
        seen[session.session_id] = lineno
        sessions.append(session)
    if not sessions:
        raise ValueError(f"{path}: no sessions")
    return sessions


def load_preamble(path: str | os.PathLike) -> str:
    """Read preamble.txt; the file ends with one newline that is not part of the preamble."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    if not text.endswith("\n") or not text.strip():
        raise ValueError(f"{path}: expected a non-empty preamble ending in a newline")
    return text[:-1]


def write_preamble(path: str | os.PathLike, preamble: str) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((preamble + "\n").encode("utf-8"))


# ---------------------------------------------------------------------------------
# Building sessions from files


@dataclasses.dataclass(frozen=True)
class SessionSpec:
    """The knobs of the walk over a file; bounds count tokens of a chunk encoded alone."""

    min_turns: int = 4
    max_turns: int = 8
    user_min_tokens: int = 40
    user_max_tokens: int = 120
    reply_min_tokens: int = 64
    reply_max_tokens: int = 128

    def __post_init__(self):
        for lo, hi, name in (
            (self.min_turns, self.max_turns, "turns"),
            (self.user_min_tokens, self.user_max_tokens, "user tokens"),
            (self.reply_min_tokens, self.reply_max_tokens, "reply tokens"),
        ):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got [{lo}, {hi}]")


def file_rng(seed: int, purpose: str, relpath: str) -> random.Random:
    """An RNG that depends only on (seed, purpose, relpath)."""
    digest = hashlib.sha256(f"{seed}\0{purpose}\0{relpath}".encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _take_chunk(
    lines: Sequence[str],
    start: int,
    target: int,
    lo: int,
    hi: int,
    count: Callable[[str], int],
    strict: bool,
) -> tuple[str, int] | None:
    """Whole lines from ``start`` (leading blank lines skipped) until ``target`` tokens.

    Never splits a line and never exceeds ``hi`` tokens. ``strict`` (sessions) gives
    None when that cannot reach ``lo`` tokens; otherwise (training) a short tail or a
    single over-long line is taken as it is. Returns (text, next line index).
    """
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines):
        return None
    text, n, j = "", 0, i
    while j < len(lines):
        candidate = "".join(lines[i : j + 1]).rstrip()
        m = count(candidate)
        if m > hi:
            break
        text, n, j = candidate, m, j + 1
        if n >= target:
            break
    if strict and n < lo:
        return None
    if not text:  # the first line alone is over the bound
        return lines[i].rstrip(), i + 1
    return text, j


def _walk_turns(
    lines: Sequence[str],
    start: int,
    rng: random.Random,
    spec: SessionSpec,
    count: Callable[[str], int],
    strict: bool,
) -> tuple[list[Turn], int]:
    """One conversation's turns from ``start``: user chunk, then the file's reply span."""
    n_turns = rng.randint(spec.min_turns, spec.max_turns)
    turns, cursor = [], start
    for _ in range(n_turns):
        target = rng.randint(spec.user_min_tokens, spec.user_max_tokens)
        max_new = rng.randint(spec.reply_min_tokens, spec.reply_max_tokens)
        user = _take_chunk(lines, cursor, target, spec.user_min_tokens, spec.user_max_tokens, count, strict)
        if user is None:
            break
        user_text, cursor = user
        reply = _take_chunk(lines, cursor, max_new, 1, max_new, count, strict=False)
        reply_text = ""
        if reply is not None:
            reply_text, cursor = reply
        turns.append(Turn(user_text, max_new, reply_text))
    return turns, cursor


def conversations_from_file(
    relpath: str, text: str, tok: Tokenizer, spec: SessionSpec, seed: int
) -> list[list[Turn]]:
    """Cover a whole (training) file with consecutive conversations of 4-8 turns.

    The same walk as the evaluation sessions, without their bounds, so every line of
    the file is used once: as a user chunk or as a reply.
    """
    lines = text.splitlines(keepends=True)
    rng = file_rng(seed, "train-chat", relpath)
    count = lambda s: len(tok.encode(s))
    conversations, cursor = [], 0
    while cursor < len(lines):
        turns, new_cursor = _walk_turns(lines, cursor, rng, spec, count, strict=False)
        if not turns:
            break
        conversations.append(turns)
        cursor = new_cursor
    return conversations


def _start_candidates(lines: Sequence[str], begin: int, end: int) -> list[int]:
    return [i for i in range(begin, min(end, len(lines))) if _DEFINITION_START.match(lines[i])]


def sessions_from_file(
    relpath: str,
    text: str,
    tok: Tokenizer,
    spec: SessionSpec,
    seed: int,
    max_sessions: int,
) -> list[Session]:
    """Up to ``max_sessions`` non-overlapping evaluation sessions from one held-out file.

    The first starts at a random definition in the first half of the file; each later
    one at the first definition after the previous session's end.
    A session that cannot reach ``min_turns`` turns within the bounds is dropped.
    """
    lines = text.splitlines(keepends=True)
    rng = file_rng(seed, "eval", relpath)
    count = lambda s: len(tok.encode(s))
    candidates = _start_candidates(lines, 0, len(lines) // 2 + 1)
    start = rng.choice(candidates) if candidates else 0
    sessions = []
    while len(sessions) < max_sessions:
        turns, end = _walk_turns(lines, start, rng, spec, count, strict=True)
        if len(turns) < spec.min_turns:
            break
        sessions.append(Session(f"{relpath}#{len(sessions)}", relpath, tuple(turns)))
        later = _start_candidates(lines, end, len(lines))
        if not later:
            break
        start = later[0]
    return sessions


def _ranked(files: Iterable, seed: int, purpose: str) -> list:
    key = lambda f: hashlib.sha256(f"{seed}\0{purpose}\0{f.relpath}".encode("utf-8")).digest()
    return sorted(files, key=key)


def build_eval_sessions(
    files: Sequence, tok: Tokenizer, spec: SessionSpec, seed: int, num_sessions: int, sessions_per_file: int
) -> list[Session]:
    """``num_sessions`` sessions from held-out files (objects with .relpath and .text).

    When more candidates exist than needed, a hash of the session id picks which, so
    the choice does not depend on iteration order; the result is in path order.
    """
    candidates = []
    for f in sorted(files, key=lambda f: f.relpath):
        candidates.extend(sessions_from_file(f.relpath, f.text, tok, spec, seed, sessions_per_file))
    if len(candidates) < num_sessions:
        raise ValueError(
            f"only {len(candidates)} sessions could be built from {len(files)} held-out files, "
            f"{num_sessions} requested (raise sessions_per_file or the held-out share)"
        )
    rank = lambda s: hashlib.sha256(f"{seed}\0pick\0{s.session_id}".encode("utf-8")).digest()
    chosen = set(s.session_id for s in sorted(candidates, key=rank)[:num_sessions])
    return [s for s in candidates if s.session_id in chosen]


def build_preamble_only_sessions(
    files: Sequence, tok: Tokenizer, spec: SessionSpec, seed: int, num_sessions: int
) -> list[Session]:
    """Single-turn sessions, one per file, with pairwise different first lines.

    Their prompts share the preamble and at most the first few tokens of the first
    line after it, which is what the Marconi-threshold experiment needs: a fresh
    request whose only cached match is the preamble.
    """
    one_turn = dataclasses.replace(spec, min_turns=1, max_turns=1)
    out, first_lines = [], set()
    for f in _ranked(files, seed, "preamble-only"):
        if len(out) == num_sessions:
            break
        lines = f.text.splitlines(keepends=True)
        rng = file_rng(seed, "preamble-only", f.relpath)
        candidates = _start_candidates(lines, 0, len(lines))
        start = rng.choice(candidates) if candidates else 0
        turns, _ = _walk_turns(lines, start, rng, one_turn, lambda s: len(tok.encode(s)), strict=True)
        if not turns:
            continue
        first = turns[0].user.split("\n", 1)[0]
        if first in first_lines:
            continue
        first_lines.add(first)
        out.append(Session(f"preamble-only/{f.relpath}", f.relpath, tuple(turns)))
    if len(out) < num_sessions:
        raise ValueError(f"only {len(out)} preamble-only sessions could be built, {num_sessions} requested")
    return sorted(out, key=lambda s: s.session_id)
