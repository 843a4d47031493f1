"""Config for experiments/build_data.py: the corpus, tokenizer, token stream and sessions.

Changing anything here changes the shipped tokenizer or sessions; rebuild with
`python -m experiments.build_data` and commit the assets together with the change.
"""

import ml_collections


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
