"""The training corpus: Python sources of the running interpreter's standard library.

The stdlib is present wherever Python is, so the embedded default model can be
rebuilt from the repository alone with nothing downloaded. The split is by file and
depends only on the file's path relative to the stdlib root, so adding or removing
files (another patch release of Python) never moves a surviving file across the
train / held-out boundary.

Which files count:

* every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, **including** ``test/``:
  the test suite is ordinary, idiomatic Python written by the same people and more
  than doubles the data a 10-30M-parameter model sees;
* except ``site-packages/`` (third-party code that varies by machine);
* except files larger than ``max_file_bytes`` (generated tables such as
  ``pydoc_data/topics.py`` and a few huge test modules that would dominate);
* except files that are not valid UTF-8 or that the running interpreter cannot parse.
  That one rule drops the deliberately broken fixtures (``tokenizedata/``,
  ``encoded_modules/``, Python 2 grammar samples) without a hand-kept list of
  directories.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import pathlib
import platform
import sys
import sysconfig
import warnings
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from mtp.data import sessions as sessions_lib
from mtp.data.tokenizer import Tokenizer

DEFAULT_HELDOUT_PERCENT = 5
DEFAULT_MAX_FILE_BYTES = 200_000


def stdlib_root() -> pathlib.Path:
    """The stdlib directory of the interpreter running this code (not of a venv)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def path_bucket(relpath: str, salt: str = "") -> int:
    """A stable bucket in ``[0, 100)`` for a relative path.

    sha256 rather than ``hash()`` because Python's string hash is salted per process.
    """
    if not relpath or relpath.startswith("/") or "\\" in relpath:
        raise ValueError(f"expected a relative POSIX path, got {relpath!r}")
    digest = hashlib.sha256((salt + relpath).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100


def is_heldout(relpath: str, heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> bool:
    """Whether a file belongs to the held-out split."""
    if not 0 <= heldout_percent <= 100:
        raise ValueError(f"heldout_percent must be in [0, 100], got {heldout_percent}")
    return path_bucket(relpath) < heldout_percent


def split_rule_text(heldout_percent: int) -> str:
    """The split rule in words, stored with the checkpoint so a reader can re-derive it."""
    return (
        "held-out iff int.from_bytes(sha256(relpath.encode('utf-8')).digest()[:8], 'big') "
        f"% 100 < {heldout_percent}, relpath = POSIX path relative to the stdlib root"
    )


@dataclasses.dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
    """What the corpus was, recorded in data_info.json and the checkpoint metadata."""

    python_version: str
    python_implementation: str
    stdlib_path: str
    include_tests: bool
    max_file_bytes: int
    heldout_percent: int
    split_rule: str
    train_files: int
    heldout_files: int
    train_bytes: int
    heldout_bytes: int
    skipped_too_large: int
    skipped_not_utf8: int
    skipped_unparsable: int
    fingerprint: str  # sha256 over (relpath, content) of every kept file, in order

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CorpusInfo":
        """Read back a record (from data_info.json or checkpoint metadata)."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing, extra = names - d.keys(), d.keys() - names
        if missing or extra:
            raise ValueError(f"not a CorpusInfo record: missing {sorted(missing)}, unexpected {sorted(extra)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]
    info: CorpusInfo


def _candidate_paths(root: pathlib.Path, include_tests: bool) -> Iterator[tuple[str, pathlib.Path]]:
    # Sorted by relative path string so the order is identical across filesystems.
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        top = rel.split("/", 1)[0]
        if top == "site-packages":
            continue
        if not include_tests and top == "test":
            continue
        if not path.is_file():
            continue
        found.append((rel, path))
    found.sort(key=lambda item: item[0])
    yield from found


def _parses(text: str) -> bool:
    with warnings.catch_warnings():
        # Old escape sequences in test fixtures raise SyntaxWarning; they still parse.
        warnings.simplefilter("ignore")
        try:
            ast.parse(text)
        except (SyntaxError, ValueError):
            return False
    return True


def load_corpus(
    root: str | pathlib.Path | None = None,
    *,
    heldout_percent: int = DEFAULT_HELDOUT_PERCENT,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    include_tests: bool = True,
    limit_files: int = 0,
) -> Corpus:
    """Read and split the corpus.

    ``limit_files`` > 0 keeps only the first that many kept files (in path order),
    for fast tests and smoke runs; the split of each kept file is unchanged.
    """
    root = stdlib_root() if root is None else pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory {root} does not exist")
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    if limit_files < 0:
        raise ValueError(f"limit_files must be >= 0, got {limit_files}")
    train, heldout = [], []
    too_large = not_utf8 = unparsable = 0
    fingerprint = hashlib.sha256()
    for rel, path in _candidate_paths(root, include_tests):
        if limit_files and len(train) + len(heldout) >= limit_files:
            break
        raw = path.read_bytes()
        if len(raw) > max_file_bytes:
            too_large += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            not_utf8 += 1
            continue
        if not _parses(text):
            unparsable += 1
            continue
        fingerprint.update(rel.encode("utf-8") + b"\0" + hashlib.sha256(raw).digest())
        (heldout if is_heldout(rel, heldout_percent) else train).append(SourceFile(rel, text))
    if not train:
        raise ValueError(f"no usable training files under {root}")
    info = CorpusInfo(
        python_version=platform.python_version(),
        python_implementation=sys.implementation.name,
        stdlib_path=str(root),
        include_tests=include_tests,
        max_file_bytes=max_file_bytes,
        heldout_percent=heldout_percent,
        split_rule=split_rule_text(heldout_percent),
        train_files=len(train),
        heldout_files=len(heldout),
        train_bytes=sum(len(f.text.encode("utf-8")) for f in train),
        heldout_bytes=sum(len(f.text.encode("utf-8")) for f in heldout),
        skipped_too_large=too_large,
        skipped_not_utf8=not_utf8,
        skipped_unparsable=unparsable,
        fingerprint=fingerprint.hexdigest(),
    )
    return Corpus(tuple(train), tuple(heldout), info)


# ---------------------------------------------------------------------------------
# Token stream


DEFAULT_CHAT_PERCENT = 30


def is_chat_file(relpath: str, seed: int, chat_percent: int = DEFAULT_CHAT_PERCENT) -> bool:
    """Whether a file enters the token stream rendered as chat conversations.

    Salted with the seed so the chat subset is independent of the held-out split.
    """
    if not 0 <= chat_percent <= 100:
        raise ValueError(f"chat_percent must be in [0, 100], got {chat_percent}")
    return path_bucket(relpath, salt=f"chat\0{seed}\0") < chat_percent


def documents(
    files: Sequence[SourceFile],
    tok: Tokenizer,
    preamble: str,
    spec: sessions_lib.SessionSpec,
    seed: int,
    chat_percent: int,
) -> Iterator[tuple[str, bool]]:
    """(text, is_chat) for every document of ``files``, in path order.

    A chat file becomes several documents, each a complete conversation in the
    sessions' template (user chunks and the file's own lines as replies), every one
    starting with the preamble so a training window of ~1k tokens regularly sees it.
    """
    for f in files:
        if is_chat_file(f.relpath, seed, chat_percent):
            for turns in sessions_lib.conversations_from_file(f.relpath, f.text, tok, spec, seed):
                yield sessions_lib.render_transcript(preamble, [(t.user, t.reference) for t in turns]), True
        else:
            yield f.text, False


def build_token_arrays(
    corpus: Corpus,
    tok: Tokenizer,
    preamble: str,
    spec: sessions_lib.SessionSpec,
    *,
    seed: int,
    chat_percent: int = DEFAULT_CHAT_PERCENT,
    out_dir: str | pathlib.Path,
    progress: bool = True,
) -> dict:
    """Write ``train.npy`` and ``heldout.npy``: uint16 ids, each document followed by EOS.

    The held-out stream mixes chat documents by the same rule so its loss measures
    the same distribution the training stream has. Returns per-split counts.
    """
    if tok.vocab_size > 1 << 16:
        raise ValueError(f"vocab_size {tok.vocab_size} does not fit uint16 token arrays")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {}
    for split, files in (("train", corpus.train), ("heldout", corpus.heldout)):
        pieces, n_docs, n_chat_docs, chat_tokens = [], 0, 0, 0
        eos = np.array([tok.eos_id], dtype=np.uint16)
        bar = tqdm(files, desc=f"tokenize {split}", unit="file", disable=not progress)
        for f in bar:
            for text, is_chat in documents([f], tok, preamble, spec, seed, chat_percent):
                ids = np.asarray(tok.encode(text), dtype=np.uint16)
                pieces.extend((ids, eos))
                n_docs += 1
                if is_chat:
                    n_chat_docs += 1
                    chat_tokens += len(ids)
        arr = np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)
        path = out_dir / f"{split}.npy"
        np.save(path, arr, allow_pickle=False)
        stats[split] = {
            "path": str(path),
            "files": len(files),
            "documents": n_docs,
            "chat_documents": n_chat_docs,
            "tokens": int(arr.size),
            "chat_tokens": chat_tokens,
        }
    return stats


def load_token_array(path: str | pathlib.Path, vocab_size: int) -> np.ndarray:
    """Memory-map a token array written by ``build_token_arrays`` and check it.

    Catches a stream built with another tokenizer (ids past the vocabulary) before
    it turns into an out-of-bounds embedding gather inside a jitted step.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no token array at {path}; run `python -m experiments.build_data` first")
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.dtype != np.uint16 or arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D uint16 array, got {arr.dtype} with shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{path}: empty token array")
    top = int(arr.max())
    if top >= vocab_size:
        raise ValueError(f"{path}: token id {top} is outside the vocabulary of {vocab_size}")
    return arr
