"""Byte-level BPE tokenizer: training on the corpus and a thin wrapper used everywhere.

Byte-level (GPT-2 style byte-to-unicode alphabet, all 256 bytes in the base vocabulary)
so that any text, including the odd unicode in the stdlib's test suite and whatever a
user types, encodes without an unknown token and decodes back to the same string.
The chat markers are special tokens so that the template's structure is one id each
and can never be produced by merging ordinary text.
"""

from __future__ import annotations

import os
import pathlib
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
# Order fixes the ids: <|endoftext|> must be 0 (the document separator in the token arrays).
SPECIAL_TOKENS = (EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
DEFAULT_VOCAB_SIZE = 8192
# The shipped tokenizer (built by experiments/build_data.py); found relative to the
# source tree because the assets are data of the repository, not of the package.
DEFAULT_TOKENIZER_PATH = pathlib.Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "tokenizer.json"


class Tokenizer:
    """Wraps a HF ``tokenizers.Tokenizer`` with the handful of calls the project makes.

    Any ``tokenizer.json`` loads (a real Qwen3-Next one too) as long as it has the
    ``<|endoftext|>`` token; the chat-role ids are ``None`` when the file lacks them.
    """

    def __init__(self, hf: tokenizers.Tokenizer):
        self._hf = hf
        eos = hf.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token; it is needed as the end-of-text id")
        self._eos_id = eos
        self._system_id = hf.token_to_id(SYSTEM_TOKEN)
        self._user_id = hf.token_to_id(USER_TOKEN)
        self._assistant_id = hf.token_to_id(ASSISTANT_TOKEN)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the HF error names neither the file nor the cause well
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
        return cls(hf)

    def save(self, path: str | os.PathLike) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write bytes ourselves so line endings and the trailing newline never depend on the OS.
        path.write_bytes((self._hf.to_str(pretty=True) + "\n").encode("utf-8"))

    @property
    def hf(self) -> tokenizers.Tokenizer:
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def system_id(self) -> int | None:
        return self._system_id

    @property
    def user_id(self) -> int | None:
        return self._user_id

    @property
    def assistant_id(self) -> int | None:
        return self._assistant_id

    @property
    def special_ids(self) -> dict[str, int]:
        return {t: i for t in SPECIAL_TOKENS if (i := self._hf.token_to_id(t)) is not None}

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"token ids out of range [0, {size}): {bad[:8]}")
        return self._hf.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._hf.id_to_token(i)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE with the special tokens at ids 0..3.

    HF's BPE trainer breaks count ties by pair id, so the result depends only on the
    texts (not on their order across threads); build_data checks that by training twice.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (bytes + special tokens), got {vocab_size}")
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    tok = Tokenizer(hf)
    for want, name in enumerate(SPECIAL_TOKENS):
        if hf.token_to_id(name) != want:
            raise RuntimeError(f"{name} got id {hf.token_to_id(name)}, expected {want}")
    return tok
