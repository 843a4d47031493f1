"""The session experiments' shared pieces (`experiments/harness.py`)."""

import pytest
from absl import app

from experiments.harness import session_subset


def test_session_subset_takes_a_prefix_or_all_and_names_a_bad_count():
    sessions = list("abcde")
    assert session_subset(sessions, 2, "num_sessions") == ["a", "b"]
    assert session_subset(sessions, -1, "num_sessions") == sessions
    assert session_subset(sessions, 9, "num_sessions") == sessions
    for bad in (0, -3):
        with pytest.raises(app.UsageError, match=rf"--config.num_preamble_only={bad}: .* -1 for all 5"):
            session_subset(sessions, bad, "num_preamble_only")
