"""bench/filters.py: the filter comparison's commands and what it reads off each run."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import estimators  # noqa: E402
import filters  # noqa: E402


def test_top_k_is_the_default_command_and_the_others_change_only_the_filter():
    assert filters.FILTERS["top_k"] == []  # StarPO-S as the task's default command runs it (the preset's keep ratio)
    assert filters.FILTERS["top_p"] == ["--algo", "starpo-s2"]
    assert filters.FILTERS["none"] == ["--filter", "none"]


def test_summarise_run_reads_success_kept_ratio_skips_and_the_diagnostics_cost():
    rows = [{"step": 0, "val/success": 0.25, "time_s": 3.0}]
    for step in (1, 2, 3, 4):
        r = {"step": step, "timing_s/step": 10.0, "rollout/filter_kept_ratio": 0.5, "rollout/empty_after_filter": 0}
        if step in (1, 3):
            r.update({"timing_s/collapse": 2.0, "collapse/mi_estimate": 0.1 * step})
        rows.append(r)
    rows[2]["rollout/empty_after_filter"] = 1
    rows[2]["rollout/filter_kept_ratio"] = 0.0
    rows[-1].update({"val/success": 0.75, "time_s": 43.0, "warn/echo_trap": 1})
    got = filters.summarise_run(rows, wall=50.0)
    assert got["val_success"] == {"0": 0.25, "4": 0.75} and got["val_success_at_s"] == {"0": 3.0, "4": 43.0}
    assert (got["final_val_success"], got["best_val_success"], got["steps_run"]) == (0.75, 0.75, 4)
    assert got["kept_ratio_mean"] == pytest.approx(0.375) and got["skipped_steps"] == 1
    assert got["collapse_s_per_step_mean"] == pytest.approx(1.0)  # 4 s over 4 steps
    assert got["collapse_share_of_step"] == pytest.approx(0.1)  # 4 s of 40 s
    assert got["curves"]["collapse/mi_estimate"] == {"1": 0.1, "3": pytest.approx(0.3)}
    assert got["warnings"] == {"4": ["warn/echo_trap"]}


def test_the_filters_means_and_merging_two_sweeps_run_side_by_side(tmp_path):
    def run(final, kept, s_step):
        return {
            "final_val_success": final,
            "best_val_success": final + 0.1,
            "kept_ratio_mean": kept,
            "skipped_steps": 1,
            "s_per_step_mean": s_step,
        }

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps({"task": "sokoban", "runs": {"top_k/seed0": run(0.4, 0.5, 10.0)}}))
    b.write_text(
        json.dumps({"task": "sokoban", "runs": {"top_k/seed1": run(0.2, 0.5, 6.0), "none/seed1": run(0.3, None, 8.0)}})
    )
    filters.main(["sokoban", "--seeds", "--merge", str(a), str(b), "--out", str(out)])  # runs nothing
    got = json.loads(out.read_text())
    assert sorted(got["runs"]) == ["none/seed1", "top_k/seed0", "top_k/seed1"]
    top_k = got["by_filter"]["top_k"]
    assert top_k["seeds"] == 2 and top_k["final_val_success"] == {"seed0": 0.4, "seed1": 0.2}
    assert top_k["final_val_success_mean"] == pytest.approx(0.3) and top_k["s_per_step_mean"] == pytest.approx(8.0)
    assert got["by_filter"]["none"]["kept_ratio_mean"] == 0.0 and "top_p" not in got["by_filter"]
    with pytest.raises(SystemExit, match="of 'sokoban', not 'bandit'"):
        filters.main(["bandit", "--seeds", "--merge", str(a), "--out", str(tmp_path / "x.json")])


def test_the_estimator_and_freshness_sweeps_change_one_thing_each(tmp_path):
    assert estimators.ESTIMATORS == {
        "turn-grpo": [],  # the tiny preset's estimator: the default command
        "gigpo": ["--estimator", "gigpo"],
        "gigpo-h2": ["--estimator", "gigpo", "--gigpo-history", "2"],
    }
    assert estimators.FRESHNESS == {
        "reuse1": [],
        "reuse2": ["--rollout-reuse", "2"],
        "reuse4": ["--rollout-reuse", "4"],
    }
    run = {"final_val_success": 0.4, "best_val_success": 0.5, "kept_ratio_mean": 0.5, "skipped_steps": 0}
    a, out = tmp_path / "a.json", tmp_path / "out.json"
    a.write_text(json.dumps({"task": "frozenlake", "runs": {"reuse2/seed0": {**run, "s_per_step_mean": 9.0}}}))
    estimators.main(["frozenlake", "--sweep", "freshness", "--seeds", "--merge", str(a), "--out", str(out)])
    got = json.loads(out.read_text())["by_variant"]
    assert list(got) == ["reuse2"] and got["reuse2"]["final_val_success_mean"] == 0.4
