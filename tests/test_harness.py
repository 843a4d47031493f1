"""The session experiments' shared pieces (`experiments/harness.py`)."""

from types import SimpleNamespace

import pytest
from absl import app

from experiments.harness import eos_id, lossless, session_subset, write_atomic


def test_session_subset_takes_a_prefix_or_all_and_names_a_bad_count():
    sessions = list("abcde")
    assert session_subset(sessions, 2, "num_sessions") == ["a", "b"]
    assert session_subset(sessions, -1, "num_sessions") == sessions
    assert session_subset(sessions, 9, "num_sessions") == sessions
    for bad in (0, -3):
        with pytest.raises(app.UsageError, match=rf"--config.num_preamble_only={bad}: .* -1 for all 5"):
            session_subset(sessions, bad, "num_preamble_only")


def _turns(outputs):
    return {key: SimpleNamespace(output=out) for key, out in outputs.items()}


def test_lossless_compares_the_turns_before_their_tokens():
    """A run that lost a turn used to raise KeyError in carry_ablation, discarding every run before it."""
    ref = _turns({("a", 0): [1, 2], ("a", 1): [3]})
    assert lossless(_turns({("a", 0): [1, 2], ("a", 1): [3]}), ref)
    assert not lossless(_turns({("a", 0): [1, 2]}), ref)  # a lost turn
    assert not lossless(_turns({("a", 0): [1, 2], ("a", 1): [3], ("b", 0): [4]}), ref)  # an extra one
    assert not lossless(_turns({("a", 0): [1, 2], ("a", 1): [4]}), ref)  # a different token


def test_eos_id_is_minus_one_where_the_checkpoint_names_none():
    assert eos_id(SimpleNamespace(eos_token_id=None)) == -1
    assert eos_id(SimpleNamespace(eos_token_id=0)) == 0  # id 0 is an id, not "none"


def test_write_atomic_replaces_the_file_whole(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["results.json"]
