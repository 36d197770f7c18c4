"""bench/tabular_estimators.py: a policy that reads the outcome words learns with both estimators; a blind one
cannot use them (their weights get no gradient at all)."""

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import tabular_estimators as te  # noqa: E402


def test_a_reading_policy_learns_with_either_estimator():
    for est, progress in (("grpo", 0.0), ("turn-grpo", 0.5)):
        r = te.run(est, read=1.0, progress=progress, keep=1.0, steps=30, seed=0)
        assert r["first_5_steps"]["success"] < 0.35 < 0.6 < r["last_10_steps"]["success"], r
        good, bad = ("goal", "to"), ("ice", "wall", "hole")
        assert min(r["theta"][w] for w in good) > 0 > max(r["theta"][w] for w in bad), r["theta"]


def test_a_blind_policy_gets_nothing_from_the_words():
    r = te.run("grpo", read=0.0, progress=0.0, keep=1.0, steps=5, seed=0)
    assert all(r["theta"][w] == 0.0 for w in te.WORDS)
    assert r["last_10_steps"]["success"] < 0.3
