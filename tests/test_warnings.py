"""plumbing/run.py: the collapse warnings (one named kind each) on synthetic histories, and the run's new writers."""

import gc
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plumbing import run as plumbing_run
from plumbing.run import collapse_warnings


def history(std=(), norms=(), mi=()):
    """One dict per step, as Run.end_step keeps it: step, then whichever metrics that step logged."""
    n = max(len(std), len(norms), len(mi))
    rows = [{"step": s + 1} for s in range(n)]
    for key, values in (("rollout/in_group_std", std), ("actor/grad_norm", norms), ("collapse/mi_zscore_ema", mi)):
        for row, v in zip(rows, values):
            if v is not None:  # None: the step did not log it (a skipped step, a step without a collapse measurement)
                row[key] = v
    for row in rows:
        if "collapse/mi_zscore_ema" in row:
            row.update({"collapse/retrieval_accuracy": 0.15, "collapse/retrieval_chance_level": 0.125})
    return rows


def kinds(rows, warned=None):
    return [kind for kind, _ in collapse_warnings(rows, set() if warned is None else warned)]


def fired_by_step(rows):
    """Replay a run step by step (as end_step does): step -> the kinds that fired on it."""
    warned, out = set(), {}
    for i in range(1, len(rows) + 1):
        if got := kinds(rows[:i], warned):
            out[rows[i - 1]["step"]] = got
    return out


# ---- echo trap: the in-group reward std collapses -------------------------------------------------------------------


def test_echo_trap_fires_once_when_the_std_collapses():
    rows = history(std=[0.4] * 12 + [0.02] * 12)
    fired = fired_by_step(rows)
    assert fired == {20: ["echo_trap"]}  # steps 11-20 average (2 x 0.4 + 8 x 0.02) / 10 = 0.096 < 0.4 / 4; once
    _, msg = collapse_warnings(rows[:20], set())[0]
    assert "0.400 -> 0.096" in msg and "val/success" in msg


# Sokoban without a filter (python starpo_sokoban.py --filter none --seed 1), steps 1-30: a healthy run (val/success
# 0.03 -> 0.43 by step 30) whose 8 groups all agreed at steps 14, 15, 20, 23, 27 and 30. A 3-step window fired at 16.
SOKOBAN_STD = [1.73, 1.46, 1.98, 0.74, 2.80, 1.72, 1.64, 0.67, 1.64, 1.73, 1.13, 1.91, 3.52, 0.0, 0.0]
SOKOBAN_STD += [0.09, 0.49, 1.99, 0.67, 0.0, 0.49, 1.91, 0.0, 0.98, 0.49, 1.42, 0.0, 0.49, 0.50, 0.0]


@pytest.mark.parametrize(
    "std",
    [
        [0.4] * 25,  # steady
        [0.4] * 10 + [0.12] * 15,  # a mild fall: 0.12 is over a quarter of 0.4
        [0.0] * 25,  # never any signal: nothing collapsed
        [0.4] * 10 + [0.0] * 9,  # too few steps (19)
        SOKOBAN_STD,  # a few unanimous batches in a noisy std
    ],
)
def test_echo_trap_quiet_on_a_steady_std_a_mild_fall_an_all_zero_run_too_few_steps_or_unanimous_batches(std):
    assert fired_by_step(history(std=std)) == {}


# ---- gradient spike -------------------------------------------------------------------------------------------------


def test_a_gradient_spike_alone_is_only_a_gradient_spike():
    """The FrozenLake case: one spike at step 69 while everything else held."""
    norms = [1.0 + 0.01 * (s % 3) for s in range(68)] + [40.0] + [1.0] * 5
    rows = history(std=[0.3] * 74, norms=norms)
    fired = fired_by_step(rows)
    assert fired == {69: ["gradient_spike"]}
    msg = dict(collapse_warnings(rows[:69], set()))["gradient_spike"]
    assert "40" in msg and "1.01" in msg


def test_gradient_spike_fires_each_time_and_not_on_a_skipped_step():
    rows = history(norms=[1.0] * 8 + [20.0] + [1.0] * 8 + [30.0] + [None])  # step 19 skipped: no actor/* at all
    assert fired_by_step(rows) == {9: ["gradient_spike"], 18: ["gradient_spike"]}


def test_gradient_spike_needs_six_norms_and_ignores_nan():
    assert fired_by_step(history(norms=[1.0] * 4 + [50.0])) == {}
    assert fired_by_step(history(norms=[1.0] * 6 + [float("nan"), 1.0])) == {}


def test_a_zero_norm_is_no_update_neither_counted_nor_in_the_median():
    """Every group agreed, so nothing was learned (Sokoban without a filter, often): a norm of 0 is not a typical
    norm. Counted, these zeros would halve the median and make 0.2 a 5x spike."""
    assert fired_by_step(history(norms=[0.05, 0.0] * 6 + [0.2])) == {}
    assert fired_by_step(history(norms=[0.05, 0.0] * 6 + [0.3])) == {13: ["gradient_spike"]}  # 6x the 0.05s
    assert fired_by_step(history(norms=[1.0] * 4 + [0.0] * 4 + [50.0])) == {}  # 5 norms, not 9


# ---- template collapse: the MI z-score (EMA) falls -----------------------------------------------------------------


def test_template_collapse_fires_once_on_a_falling_series():
    mi = [None, 1.0, None, 2.0, None, 1.5, None, 0.5, None, 0.3, None, 0.1, None, 0.05]  # measured every 2 steps
    rows = history(mi=mi)
    assert fired_by_step(rows) == {10: ["template_collapse"]}  # (0.5 + 0.3) / 2 = 0.4 < 0.3 * 2.0; never again
    msg = dict(collapse_warnings(rows[:10], set()))["template_collapse"]
    assert msg == (
        "MI z-score (EMA) fell from 2.00 (step 4) to 0.40; the reasoning stops depending on the prompt "
        "(retrieval 0.15 vs chance 0.12)"
    )


@pytest.mark.parametrize(
    "mi",
    [
        [1.5, 1.5, 1.5, 1.5, 1.5, 1.5],  # flat
        [0.2, 0.5, 1.0, 2.0, 3.0],  # rising
        [2.0, 0.1, 0.1],  # falling, but only 3 measurements
        [0.4, 0.4, 0.05, 0.05],  # fell, but never above 0.5: there was no prompt dependence to lose
        [2.0, 2.0, 0.7, 0.5],  # the last two average 0.6, above 30% of 2.0
    ],
)
def test_template_collapse_quiet(mi):
    assert fired_by_step(history(mi=mi)) == {}


def test_template_collapse_needs_four_measurements_not_four_steps():
    rows = history(std=[0.3] * 9, mi=[2.0, None, None, None, None, 0.1, None, None, 0.1])  # 3 measurements
    assert fired_by_step(rows) == {}
    assert kinds(rows + history(mi=[None] * 9 + [0.1])[9:]) == ["template_collapse"]  # a fourth


def test_kinds_fire_together_and_apart():
    rows = history(std=[0.4] * 12 + [0.01] * 8, norms=[1.0] * 19 + [9.0], mi=[2.0, None, 2.0, None, 0.1, None, 0.1])
    assert fired_by_step(rows) == {7: ["template_collapse"], 20: ["echo_trap", "gradient_spike"]}


# ---- the run's writers and end_step -----------------------------------------------------------------------------


@dataclass
class Args:
    output_dir: str
    steps: int = 100
    eval_every: int = 0
    save_every: int = 0
    filter: str = "top_p"
    keep_ratio: float = 0.9


@pytest.fixture
def run(tmp_path):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    settings = dict(max_skipped=3, filter_stat="std", empty_stop_steps=5)  # what Run reads of a script's SETTINGS
    r = plumbing_run.Run(Args(str(tmp_path)), "frozenlake", None, None, None, {}, {"settings": settings})
    r.bar = SimpleNamespace(set_postfix=lambda _: None)
    yield r
    for f in (r.metrics, r.rollouts, r.groups, r.collapse):
        f.close()
    for sig, handler in handlers.items():  # Run installs Ctrl-C / SIGTERM handlers; pytest keeps its own
        signal.signal(sig, handler)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_groups_and_log_collapse_append_one_line_per_step(run, tmp_path):
    run.log_groups(7, torch.tensor([0.0, 0.5]), [1])  # the settings come from the run's flags
    run.log_groups(8, [0.1, 0.2], [0, 1])
    run.log_collapse(10, {"matrix": np.array([[-1.0, -2.0]]), "cols": [0], "prompts": ["a", "b"]})
    assert lines(tmp_path / "groups.jsonl") == [
        {"step": 7, "stat": "std", "strategy": "top_p", "value": 0.9, "values": [0.0, 0.5], "kept": [1]},
        {"step": 8, "stat": "std", "strategy": "top_p", "value": 0.9, "values": [0.1, 0.2], "kept": [0, 1]},
    ]
    assert lines(tmp_path / "collapse.jsonl") == [
        {"step": 10, "matrix": [[-1.0, -2.0]], "cols": [0], "prompts": ["a", "b"]}
    ]
    assert {"groups.jsonl", "collapse.jsonl"} <= set(plumbing_run.LOGS)  # cut back on resume, removed on --overwrite


def test_end_step_names_the_warning_in_the_line_and_the_metric(run, tmp_path, capsys):
    for step in range(1, 10):
        run.t_step = time.time()
        record = {"step": step, "train/success": 0.5, "rollout/in_group_std": 0.3, "actor/grad_norm": 1.0}
        if step == 9:
            record["actor/grad_norm"] = 50.0
        run.end_step(step, record, skipped=0)
    rows = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if any(k.startswith("warn/") for k in r)] == [9]
    assert rows[-1]["warn/gradient_spike"] == 1 and "warn/echo_trap" not in rows[-1]
    out = capsys.readouterr().out
    assert "warning: gradient spike: gradient norm 50 is over 5x" in out and out.count("warning:") == 1
    assert run.history[-1] == {"step": 9, "rollout/in_group_std": 0.3, "actor/grad_norm": 50.0}


def test_bench_warnings_replay_replays_a_sweep_runs_std_curve_step_by_step():
    """bench/warnings_replay.py: today's rule over a recorded curve, beside what fired when it was recorded."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import warnings_replay

    std = {str(s + 1): v for s, v in enumerate([0.4] * 12 + [0.02] * 12)}  # keys as JSON keeps them: "1" .. "24"
    run = {"curves": {"rollout/in_group_std": std}, "warnings": {"9": ["warn/echo_trap"], "5": ["warn/gradient_spike"]}}
    rows, then = warnings_replay.from_sweep(run)
    assert [r["step"] for r in rows] == list(range(1, 25)) and then == {"echo_trap": [9]}
    assert warnings_replay.replay(rows) == {"echo_trap": [20]}
    assert warnings_replay.recorded([{"step": 3, "warn/gradient_spike": 1}, {"step": 4}]) == {"gradient_spike": [3]}


@pytest.mark.skipif(plumbing_run.peak_rss_gb() is None, reason="no /proc high-water mark on this system")
def test_each_phase_logs_its_own_peak_memory_and_eval_keeps_its_own(run, tmp_path):
    """memory_gb/<phase>: 500 MB held inside `update` shows there and in the process's peak, not in `gen` (run
    before it, the count reset between them); `gen` inside `eval` counts for eval only, as its seconds do."""
    gc.collect()  # (in a long test session: nothing is freed inside the phases below but the block)
    plumbing_run.release_memory()
    run.t_step = time.time()
    with run.timer("gen"):
        pass
    with run.timer("update"):
        block = bytearray(500 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident
        del block
    with run.timer("eval"):
        with run.timer("gen"):
            pass
    run.end_step(1, {"step": 1, "train/success": 0.5, "rollout/in_group_std": 0.3}, skipped=0)
    row = lines(tmp_path / "metrics.jsonl")[-1]
    assert row["memory_gb/update"] - row["memory_gb/gen"] > 0.3
    assert row["memory_gb/peak"] >= row["memory_gb/update"] > row["memory_gb/eval"]
