"""Tests for the corpus split, tokenizer, chat template, sessions and token stream."""

import json
import pathlib
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp.data import corpus as corpus_lib
from mtp.data import sessions as S
from mtp.data.tokenizer import DEFAULT_TOKENIZER_PATH, SPECIAL_TOKENS, Tokenizer, train_tokenizer

# Modules present in every CPython 3.12 stdlib, long enough for several sessions.
SAMPLE_MODULES = ("textwrap.py", "fnmatch.py", "shlex.py", "heapq.py", "bisect.py", "colorsys.py", "glob.py")
SPEC = S.SessionSpec()


def _sample_files():
    root = corpus_lib.stdlib_root()
    return [corpus_lib.SourceFile(m, (root / m).read_text(encoding="utf-8")) for m in SAMPLE_MODULES]


@pytest.fixture(scope="module")
def files():
    return _sample_files()


@pytest.fixture(scope="module")
def tok(files):
    return train_tokenizer([f.text for f in files], vocab_size=300)


def _random_code_text(rng: random.Random, files) -> str:
    f = rng.choice(files)
    a = rng.randrange(len(f.text))
    piece = f.text[a : a + rng.randrange(1, 400)]
    noise = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD7FF), rng.randrange(0x1F300, 0x1FAFF)]))
                    for _ in range(rng.randrange(0, 30)))
    return piece[: len(piece) // 2] + noise + piece[len(piece) // 2 :]


# --------------------------------------------------------------------------- corpus


def test_split_rule_is_stable_and_roughly_five_percent():
    # Pinned values: a change here silently moves files between train and held-out.
    assert {p: corpus_lib.path_bucket(p) for p in PINNED_BUCKETS} == PINNED_BUCKETS
    assert corpus_lib.is_heldout("test/test_re.py") and not corpus_lib.is_heldout("os.py")
    rng = random.Random()
    paths = {f"pkg{rng.randrange(10**6)}/mod{rng.randrange(10**6)}.py" for _ in range(20000)}
    share = sum(corpus_lib.is_heldout(p) for p in paths) / len(paths)
    assert 0.04 < share < 0.06
    with pytest.raises(ValueError, match="relative"):
        corpus_lib.path_bucket("/abs/path.py")
    with pytest.raises(ValueError, match="heldout_percent"):
        corpus_lib.is_heldout("a.py", 101)


PINNED_BUCKETS = {"os.py": 92, "json/decoder.py": 93, "test/test_re.py": 2}


def _fake_stdlib(root: pathlib.Path, rng: random.Random) -> dict:
    """A small stdlib-like tree with one file of each kind the rule must drop."""
    good = {}
    for i in range(40):
        rel = f"pkg{i % 4}/m{i}_{rng.randrange(10**6)}.py"
        good[rel] = f"X_{i} = {rng.randrange(10**9)}\n\ndef f{i}(a):\n    return a * {rng.random()!r}\n"
    good["test/test_ok.py"] = "import unittest\n"
    for rel, text in good.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "site-packages/thirdparty").mkdir(parents=True)
    (root / "site-packages/thirdparty/x.py").write_text("y = 1\n")
    (root / "latin.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    (root / "broken.py").write_text("def (:\n")
    (root / "huge.py").write_text("z = 0\n" * 400)
    return good


def test_load_corpus_rule_counts_and_disjoint_split(tmp_path):
    good = _fake_stdlib(tmp_path, random.Random())
    c = corpus_lib.load_corpus(tmp_path, max_file_bytes=2000, heldout_percent=30)
    train = [f.relpath for f in c.train]
    held = [f.relpath for f in c.heldout]
    assert set(train).isdisjoint(held)
    assert set(train) | set(held) == set(good)
    assert train == sorted(train) and held == sorted(held)
    assert all(corpus_lib.is_heldout(p, 30) for p in held) and not any(corpus_lib.is_heldout(p, 30) for p in train)
    info = c.info
    assert (info.skipped_not_utf8, info.skipped_unparsable, info.skipped_too_large) == (1, 1, 1)
    assert info.train_files + info.heldout_files == len(good)
    assert info.train_bytes == sum(len(good[p].encode()) for p in train)
    assert "% 100 < 30" in info.split_rule
    assert corpus_lib.CorpusInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    with pytest.raises(ValueError, match="missing \\['fingerprint'\\]"):
        corpus_lib.CorpusInfo.from_dict({k: v for k, v in info.to_dict().items() if k != "fingerprint"})
    again = corpus_lib.load_corpus(tmp_path, max_file_bytes=2000, heldout_percent=30)
    assert again.info.fingerprint == info.fingerprint
    no_tests = corpus_lib.load_corpus(tmp_path, max_file_bytes=2000, heldout_percent=30, include_tests=False)
    assert "test/test_ok.py" not in {f.relpath for f in no_tests.train + no_tests.heldout}
    with pytest.raises(FileNotFoundError):
        corpus_lib.load_corpus(tmp_path / "missing")


# --------------------------------------------------------------------------- tokenizer


def test_special_token_ids(tok):
    assert [tok.hf.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.eos_id, tok.system_id, tok.user_id, tok.assistant_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 300
    # Markers in text become single ids, never merged with their neighbours.
    assert tok.encode("a<|user|>b<|assistant|>") == tok.encode("a") + [2] + tok.encode("b") + [3]


def test_round_trip_random_code_and_unicode(tok, files):
    rng = random.Random()
    for _ in range(200):
        text = _random_code_text(rng, files)
        assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=200))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_save_load_and_errors(tok, files, tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.load(path.parent)  # a directory resolves to its tokenizer.json
    text = _random_code_text(random.Random(), files)
    assert loaded.encode(text) == tok.encode(text)
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        Tokenizer.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)


def test_tokenizer_training_is_deterministic(files):
    texts = [f.text for f in files[:3]]
    a = train_tokenizer(texts, vocab_size=400).hf.to_str()
    b = train_tokenizer(list(reversed(texts)), vocab_size=400).hf.to_str()
    assert a == b


# --------------------------------------------------------------------------- template


def test_render_conversation_template():
    p, u1, r1, u2 = "PRE\namble", "def f():", "    return 1", "x = f()"
    assert S.render_conversation(p, [], u1) == "<|system|>\nPRE\namble\n<|user|>\ndef f():\n<|assistant|>\n"
    text = S.render_conversation(p, [(u1, r1)], u2)
    assert text == ("<|system|>\nPRE\namble\n<|user|>\ndef f():\n<|assistant|>\n    return 1"
                    "\n<|user|>\nx = f()\n<|assistant|>\n")
    assert text == S.render_transcript(p, [(u1, r1)]) + S.user_suffix(u2)


def test_append_and_rerender_agree_on_text(tok, files):
    rng = random.Random()
    preamble = S.PREAMBLE
    chunks = [_random_code_text(rng, files) for _ in range(5)]
    history = []
    prev_full = None
    for k, chunk in enumerate(chunks):
        if prev_full is None:
            appended = S.first_prompt_ids(preamble, chunk, tok)
        else:
            appended = S.next_prompt_ids_append(prev_full, chunk, tok)
            assert appended[: len(prev_full)] == prev_full  # strict token extension
        rerendered = S.next_prompt_ids_rerender(preamble, history, chunk, tok)
        want = S.render_conversation(preamble, history, chunk)
        assert tok.decode(appended) == want
        assert tok.decode(rerendered) == want
        assert appended[-2:] == [tok.assistant_id, tok.encode("\n")[0]]
        # A model's reply: random non-special ids (need not be a canonical encoding).
        reply_ids = [rng.randrange(4, tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        # Keep to ids whose bytes are valid UTF-8 on their own so the text is well defined.
        reply_ids = [i for i in reply_ids if "\ufffd" not in tok.decode([i])] or tok.encode("pass")
        prev_full = appended + reply_ids
        history.append((chunk, tok.decode(reply_ids)))
        assert tok.decode(prev_full) == S.render_transcript(preamble, history)


def _chatml_tokenizer():
    """The shipped tokenizer plus Qwen's ChatML markers: what a real Qwen tokenizer.json brings."""
    import tokenizers

    hf = tokenizers.Tokenizer.from_file(str(DEFAULT_TOKENIZER_PATH))
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(hf)


def test_chatml_template_for_a_qwen_tokenizer():
    chat = _chatml_tokenizer()
    assert S.template_for(chat) is S.CHATML_TEMPLATE
    assert S.template_for(Tokenizer.load(DEFAULT_TOKENIZER_PATH)) is S.PROJECT_TEMPLATE
    t = S.CHATML_TEMPLATE
    assert S.render_conversation("PRE", [("a", "b<|im_end|>"), ("c", "d")], "e", t) == (
        "<|im_start|>system\nPRE<|im_end|>\n"
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"  # stopped on its EOS
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\nd<|im_end|>\n"  # cut by its budget
        "<|im_start|>user\ne<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("ends_on_eos", [True, False])
def test_chatml_append_and_rerender_agree(ends_on_eos):
    """A reply that ends on ``<|im_end|>`` (the model's EOS) or is cut by its budget: either way
    the append path strictly extends the sequence and reads as the re-rendered conversation."""
    tok = _chatml_tokenizer()
    im_end = tok.hf.token_to_id("<|im_end|>")
    history, prev_full = [], None
    for chunk in ("def f():", "x = f()", "print(x)"):
        appended = (S.first_prompt_ids(S.PREAMBLE, chunk, tok) if prev_full is None
                    else S.next_prompt_ids_append(prev_full, chunk, tok))
        if prev_full is not None:
            assert appended[: len(prev_full)] == prev_full
        want = S.render_conversation(S.PREAMBLE, history, chunk, S.CHATML_TEMPLATE)
        assert tok.decode(appended) == want
        assert tok.decode(S.next_prompt_ids_rerender(S.PREAMBLE, history, chunk, tok)) == want
        assert want.count("<|im_end|><|im_end|>") == 0
        reply = tok.encode("    return 1") + ([im_end] if ends_on_eos else [])
        prev_full = appended + reply
        history.append((chunk, tok.decode(reply)))


# --------------------------------------------------------------------------- session files


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"session_id": "a#0", "source": "a.py", "turns": [{"user": "x = 1", "max_new_tokens": 70}]})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{oops", r"invalid JSON"),
        ("[1, 2]", r"expected a JSON object"),
        (json.dumps({"source": "a.py", "turns": []}), r"missing key 'session_id'"),
        (json.dumps({"session_id": "b", "source": "a.py", "turns": []}), r"'turns' is empty"),
        (json.dumps({"session_id": "b", "source": "a.py", "turns": [{"user": "y", "max_new_tokens": 0}]}),
         r"turn 0: 'max_new_tokens' must be a positive integer"),
        (json.dumps({"session_id": "b", "source": "a.py", "turns": [{"user": "", "max_new_tokens": 9}]}),
         r"turn 0: 'user' must be a non-empty string"),
        (GOOD, r"duplicate session_id 'a#0' \(first on line 1\)"),
    ],
)
def test_load_sessions_errors_name_file_and_line(tmp_path, bad, message):
    path = _write_lines(tmp_path / "s.jsonl", [GOOD, "", bad])
    with pytest.raises(ValueError, match=re.escape(str(path)) + r":3: " + message):
        S.load_sessions(path)


def test_sessions_file_round_trip(tmp_path, tok, files):
    sessions = S.build_eval_sessions(files, tok, SPEC, seed=random.randrange(1000), num_sessions=5, sessions_per_file=2)
    path = tmp_path / "s.jsonl"
    S.write_sessions(path, sessions)
    assert S.load_sessions(path) == sessions
    assert path.read_bytes().isascii()
    with pytest.raises(ValueError, match="no sessions"):
        S.load_sessions(_write_lines(tmp_path / "empty.jsonl", [""]))


# --------------------------------------------------------------------------- building sessions


def _count(tok):
    return lambda s: len(tok.encode(s))


def test_eval_sessions_deterministic_and_well_formed(tok, files, tmp_path):
    seed = random.randrange(1000)
    a = S.build_eval_sessions(files, tok, SPEC, seed, num_sessions=8, sessions_per_file=3)
    b = S.build_eval_sessions(list(reversed(files)), tok, SPEC, seed, num_sessions=8, sessions_per_file=3)
    S.write_sessions(tmp_path / "a.jsonl", a)
    S.write_sessions(tmp_path / "b.jsonl", b)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert len(a) == 8 and len({s.session_id for s in a}) == 8
    count = _count(tok)
    text_of = {f.relpath: f.text for f in files}
    for s in a:
        assert SPEC.min_turns <= len(s.turns) <= SPEC.max_turns
        src = text_of[s.source]
        pos = 0
        for t in s.turns:
            assert SPEC.reply_min_tokens <= t.max_new_tokens <= SPEC.reply_max_tokens
            assert SPEC.user_min_tokens <= count(t.user) <= SPEC.user_max_tokens
            # Real lines of the file, in order: each chunk starts at a line start after the last.
            at = src.find(t.user, pos)
            assert at >= 0 and (at == 0 or src[at - 1] == "\n")
            pos = at + len(t.user)
    with pytest.raises(ValueError, match="requested"):
        S.build_eval_sessions(files[:1], tok, SPEC, seed, num_sessions=50, sessions_per_file=1)


def test_preamble_only_sessions_share_only_the_preamble(tok, files):
    out = S.build_preamble_only_sessions(files, tok, SPEC, seed=random.randrange(1000), num_sessions=5)
    assert len({s.source for s in out}) == 5 and all(len(s.turns) == 1 for s in out)
    # Up to the <|user|> id: the newline after it may merge with a chunk's indentation.
    header = tok.encode(S.render_transcript(S.PREAMBLE, []) + "\n<|user|>")
    prompts = [S.first_prompt_ids(S.PREAMBLE, s.turns[0].user, tok) for s in out]
    for i in range(len(prompts)):
        assert prompts[i][: len(header)] == header
        for j in range(i + 1, len(prompts)):
            common = next(k for k, (x, y) in enumerate(zip(prompts[i], prompts[j])) if x != y)
            assert common >= len(header)
            assert out[i].turns[0].user.split("\n")[0] != out[j].turns[0].user.split("\n")[0]


def test_training_conversations_cover_the_file(tok, files):
    f = random.choice(files)
    convs = S.conversations_from_file(f.relpath, f.text, tok, SPEC, seed=random.randrange(1000))
    assert convs and all(1 <= len(c) <= SPEC.max_turns for c in convs)
    used = "".join(t.user + t.reference for c in convs for t in c)
    squash = lambda s: re.sub(r"\s+", "", s)
    assert squash(used) == squash(f.text)  # every line once, in order


def test_build_token_arrays(tmp_path, tok):
    root = tmp_path / "stdlib"
    for f in _sample_files():
        (root / f.relpath).parent.mkdir(parents=True, exist_ok=True)
        (root / f.relpath).write_text(f.text, encoding="utf-8")
    c = corpus_lib.load_corpus(root, heldout_percent=30)
    seed = random.randrange(1000)
    stats = corpus_lib.build_token_arrays(c, tok, S.PREAMBLE, SPEC, seed=seed, chat_percent=50,
                                          out_dir=tmp_path / "out", progress=False)
    train = np.load(tmp_path / "out" / "train.npy")
    assert train.dtype == np.uint16 and train.size == stats["train"]["tokens"]
    assert int((train == tok.eos_id).sum()) == stats["train"]["documents"]
    docs = np.split(train, np.flatnonzero(train == tok.eos_id) + 1)[:-1]
    expected = list(corpus_lib.documents(c.train, tok, S.PREAMBLE, SPEC, seed, 50))
    assert [tok.decode(d[:-1]) for d in docs] == [text for text, _ in expected]
    n_chat = sum(is_chat for _, is_chat in expected)
    assert stats["train"]["chat_documents"] == n_chat
    assert sum(int(d[0]) == tok.system_id for d in docs) == n_chat
    loaded = corpus_lib.load_token_array(tmp_path / "out" / "train.npy", tok.vocab_size)
    assert np.array_equal(loaded, train)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        corpus_lib.load_token_array(tmp_path / "out" / "train.npy", int(train.max()))
    np.save(tmp_path / "i32.npy", train.astype(np.int32))
    with pytest.raises(ValueError, match="uint16"):
        corpus_lib.load_token_array(tmp_path / "i32.npy", tok.vocab_size)
    with pytest.raises(FileNotFoundError, match="build_data"):
        corpus_lib.load_token_array(tmp_path / "missing.npy", tok.vocab_size)


# --------------------------------------------------------------------------- shipped assets


def test_shipped_assets_are_consistent():
    tok = Tokenizer.load(DEFAULT_TOKENIZER_PATH)
    assert tok.vocab_size == 8192 and tok.special_ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    sess_dir = S.DEFAULT_SESSIONS_DIR
    preamble = S.load_preamble(sess_dir / S.PREAMBLE_FILE)
    assert preamble == S.PREAMBLE
    assert 300 <= len(tok.encode(S.render_transcript(preamble, []))) <= 400
    evals = S.load_sessions(sess_dir / S.EVAL_SESSIONS_FILE)
    assert 95 <= len(evals) <= 110
    assert all(4 <= len(s.turns) <= 8 for s in evals)
    assert all(64 <= t.max_new_tokens <= 128 for s in evals for t in s.turns)
    assert all(40 <= len(tok.encode(t.user)) <= 120 for s in evals for t in s.turns)
    assert all(corpus_lib.is_heldout(s.source) for s in evals)
    only = S.load_sessions(sess_dir / S.PREAMBLE_ONLY_FILE)
    assert len(only) == 24 and len({s.source for s in only}) == 24 and all(len(s.turns) == 1 for s in only)
