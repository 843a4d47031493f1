"""Config for experiments/build_data.py: the corpus, tokenizer, token stream and sessions.

Changing anything here changes the shipped tokenizer or sessions; rebuild with
`python -m experiments.build_data` and commit the assets together with the change. ``FIELDS``
says what each field means and which values it takes (``--help`` lists it).
"""

import ml_collections

from experiments import cli
from mtp.data.tokenizer import SPECIAL_TOKENS


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Corpus (mtp/data/corpus.py documents the file rule).
    c.heldout_percent = 5
    c.max_file_bytes = 200_000
    c.include_tests = True
    c.limit_files = 0  # > 0: only the first N kept files, for smoke runs

    # Tokenizer.
    c.vocab_size = 8192
    c.check_determinism = True  # train twice and require identical tokenizer.json

    # Token stream: this share of files (by path hash) is rendered as chat conversations.
    c.chat_percent = 30

    # Sessions; token bounds count a chunk encoded on its own.
    c.min_turns = 4
    c.max_turns = 8
    c.user_min_tokens = 40
    c.user_max_tokens = 120
    c.reply_min_tokens = 64
    c.reply_max_tokens = 128
    c.num_sessions = 100
    c.sessions_per_file = 3
    c.num_preamble_only = 24

    # Outputs, relative to the repository root unless absolute.
    c.tokenizer_path = "assets/tokenizer/tokenizer.json"
    c.sessions_dir = "assets/sessions"
    return c


_COUNT = cli.integer(1)
_PERCENT = cli.integer(0, 100)
FIELDS = {
    "seed": cli.Field("Seed of the evaluation sessions and of the token stream (which documents become chats).", cli.integer()),
    "heldout_percent": cli.Field("Share of the corpus files (by path hash) held out, in percent.",
                                 cli.integer(1, 99)),
    "max_file_bytes": cli.Field("Larger files are left out of the corpus.", _COUNT),
    "include_tests": cli.Field("Whether the standard library's test files are part of the corpus.", cli.BOOLEAN),
    "limit_files": cli.Field("Only the first N kept files, for smoke runs (0: all).", cli.integer(0)),
    "vocab_size": cli.Field("The BPE tokenizer's vocabulary (token arrays are uint16).",
                            cli.integer(256 + len(SPECIAL_TOKENS), 65536)),
    "check_determinism": cli.Field("Train the tokenizer twice and require identical results.", cli.BOOLEAN),
    "chat_percent": cli.Field("Share of the files (by path hash) rendered as chat conversations, in percent.",
                              _PERCENT),
    "min_turns": cli.Field("Fewest turns of an evaluation session.", _COUNT),
    "max_turns": cli.Field("Most turns of an evaluation session.", _COUNT),
    "user_min_tokens": cli.Field("Shortest user chunk, in tokens encoded alone.", _COUNT),
    "user_max_tokens": cli.Field("Longest user chunk.", _COUNT),
    "reply_min_tokens": cli.Field("Smallest reply budget of a turn.", _COUNT),
    "reply_max_tokens": cli.Field("Largest reply budget of a turn.", _COUNT),
    "num_sessions": cli.Field("Evaluation sessions built.", _COUNT),
    "sessions_per_file": cli.Field("Most evaluation sessions taken from one held-out file.", _COUNT),
    "num_preamble_only": cli.Field("Sessions that share only the preamble (the sweep's Marconi axis).",
                                   cli.integer(0)),
    "tokenizer_path": cli.Field("Where the tokenizer is written (relative to the repository root).",
                                cli.OUTPUT_PATH),
    "sessions_dir": cli.Field("Where the preamble and session files are written (relative to the repository "
                              "root).", cli.OUTPUT_PATH),
}
