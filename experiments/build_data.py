"""Build everything the embedded default model is trained and evaluated on.

    python -m experiments.build_data [--config=configs/data.py] [--work_dir=runs/data]

Outputs:
  assets/tokenizer/tokenizer.json        (committed)
  assets/sessions/preamble.txt            (committed)
  assets/sessions/eval_sessions.jsonl     (committed)
  assets/sessions/preamble_only.jsonl     (committed)
  {work_dir}/train.npy, heldout.npy       (uint16 ids, EOS-separated documents; not committed)
  {work_dir}/data_info.json               (CorpusInfo, token counts, hashes, timing)

Everything is a function of the config and the running interpreter's stdlib, so two
runs on the same Python give byte-identical assets; with check_determinism the
tokenizer is trained twice to prove it on this machine. The config is checked against
`configs.data.FIELDS` before any file is read; the last lines name what was written.
"""

from __future__ import annotations

import hashlib
import pathlib
import time

from absl import app, flags, logging
from tqdm import tqdm

from configs import data as config_module
from experiments import cli
from experiments.results_io import provenance, to_json, write_atomic
from mtp.data import corpus as corpus_lib
from mtp.data import sessions as sessions_lib
from mtp.data.tokenizer import train_tokenizer

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_CONFIG = cli.define_config(str(REPO_ROOT / "configs" / "data.py"), "The data config file; its fields are listed above.")
_WORK_DIR = flags.DEFINE_string("work_dir", "runs/data", "Where the token arrays and data_info.json go.")


def _resolve(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def spec_from_config(cfg) -> sessions_lib.SessionSpec:
    return sessions_lib.SessionSpec(
        min_turns=cfg.min_turns,
        max_turns=cfg.max_turns,
        user_min_tokens=cfg.user_min_tokens,
        user_max_tokens=cfg.user_max_tokens,
        reply_min_tokens=cfg.reply_min_tokens,
        reply_max_tokens=cfg.reply_max_tokens,
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cfg = _CONFIG.value
    origin = provenance(cfg)  # the code and command as the run starts
    try:
        spec = spec_from_config(cfg)
    except ValueError as e:
        raise app.UsageError(f"--config.min_turns/max_turns, user_/reply_min_tokens/max_tokens: {e}") from None
    work_dir = _resolve(_WORK_DIR.value)
    t_start = time.perf_counter()
    timings = {}

    t = time.perf_counter()
    corpus = corpus_lib.load_corpus(
        heldout_percent=cfg.heldout_percent,
        max_file_bytes=cfg.max_file_bytes,
        include_tests=cfg.include_tests,
        limit_files=cfg.limit_files,
    )
    timings["corpus_s"] = time.perf_counter() - t
    info = corpus.info
    logging.info("corpus: %d train files (%d bytes), %d held-out files (%d bytes)",
                 info.train_files, info.train_bytes, info.heldout_files, info.heldout_bytes)

    t = time.perf_counter()
    texts = [f.text for f in corpus.train]
    tok = train_tokenizer(tqdm(texts, desc="train tokenizer", unit="file"), cfg.vocab_size)
    if cfg.check_determinism:
        again = train_tokenizer(texts, cfg.vocab_size)
        if again.hf.to_str(pretty=True) != tok.hf.to_str(pretty=True):
            raise RuntimeError("tokenizer training is not deterministic on this machine: two runs differ")
    tokenizer_path = _resolve(cfg.tokenizer_path)
    tok.save(tokenizer_path)
    timings["tokenizer_s"] = time.perf_counter() - t

    preamble = sessions_lib.PREAMBLE
    preamble_tokens = len(tok.encode(sessions_lib.render_transcript(preamble, [])))
    t = time.perf_counter()
    sessions_dir = _resolve(cfg.sessions_dir)
    heldout = corpus.heldout
    eval_sessions = sessions_lib.build_eval_sessions(
        heldout, tok, spec, cfg.seed, cfg.num_sessions, cfg.sessions_per_file
    )
    preamble_only = sessions_lib.build_preamble_only_sessions(heldout, tok, spec, cfg.seed, cfg.num_preamble_only)
    sessions_lib.write_preamble(sessions_dir / sessions_lib.PREAMBLE_FILE, preamble)
    sessions_lib.write_sessions(sessions_dir / sessions_lib.EVAL_SESSIONS_FILE, eval_sessions)
    sessions_lib.write_sessions(sessions_dir / sessions_lib.PREAMBLE_ONLY_FILE, preamble_only)
    timings["sessions_s"] = time.perf_counter() - t

    t = time.perf_counter()
    token_stats = corpus_lib.build_token_arrays(
        corpus, tok, preamble, spec, seed=cfg.seed, chat_percent=cfg.chat_percent, out_dir=work_dir
    )
    timings["token_arrays_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start

    assets = [tokenizer_path] + [sessions_dir / n for n in (sessions_lib.PREAMBLE_FILE, sessions_lib.EVAL_SESSIONS_FILE, sessions_lib.PREAMBLE_ONLY_FILE)]
    turns = [len(s.turns) for s in eval_sessions]
    summary = {
        **origin,
        "corpus": info.to_dict(),
        "tokenizer": {"path": str(tokenizer_path), "vocab_size": tok.vocab_size, "special_ids": tok.special_ids},
        "preamble_tokens": preamble_tokens,
        "sessions": {
            "eval": len(eval_sessions),
            "eval_turns": sum(turns),
            "eval_turns_min_max": [min(turns), max(turns)],
            "preamble_only": len(preamble_only),
        },
        "tokens": token_stats,
        "asset_sha256": {p.name: _sha256(p) for p in assets},
        "asset_bytes": {p.name: p.stat().st_size for p in assets},
        "timings": {k: round(v, 2) for k, v in timings.items()},
    }
    work_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(work_dir / "data_info.json", to_json(summary, indent=2) + "\n")

    print(f"python {info.python_version}, stdlib {info.stdlib_path}")
    print(f"files: train {info.train_files}, held-out {info.heldout_files} "
          f"(skipped: {info.skipped_too_large} too large, {info.skipped_not_utf8} not UTF-8, "
          f"{info.skipped_unparsable} unparsable)")
    for split in ("train", "heldout"):
        s = token_stats[split]
        print(f"{split}: {s['tokens']:,} tokens in {s['documents']:,} documents "
              f"({s['chat_documents']:,} chat, {s['chat_tokens']:,} chat tokens) -> {s['path']}")
    print(f"vocab {tok.vocab_size}; preamble header {preamble_tokens} tokens; "
          f"sessions: {len(eval_sessions)} eval ({sum(turns)} turns), {len(preamble_only)} preamble-only")
    print(f"assets: {sum(summary['asset_bytes'].values()):,} bytes; "
          + ", ".join(f"{k} {v}s" for k, v in summary["timings"].items()))
    cli.wrote(tokenizer_path.parent, (tokenizer_path.name,))
    cli.wrote(sessions_dir, tuple(p.name for p in assets[1:]))
    cli.wrote(work_dir, ("train.npy", "heldout.npy", "data_info.json"))


if __name__ == "__main__":
    cli.run(main, _CONFIG, config_module)
