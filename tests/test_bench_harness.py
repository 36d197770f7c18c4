"""bench/harness.py: the three CPU benchmarks share one command line and one JSON schema."""

import json
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402


def fake_run(multi_turn: bool) -> dict:
    rows = [{"step": 0, "val/success": 0.2, "timestamp": 110.0}]
    for step in (1, 2):
        r = {
            "step": step,
            "timestamp": 110.0 + 10 * step,
            "timing_s/gen": 4.0,
            "timing_s/env": 0.5,
            "timing_s/logprob": 0.1,
            "timing_s/update": 3.0,
            "timing_s/step": 8.0,
            "response_length/mean": 20.0,
        }
        if multi_turn:
            r["train/num_turns"] = 3.0
        rows.append(r)
    rows[-1].update({"val/success": 0.5, "timing_s/eval": 2.0, "timing_s/step": 10.0, "warn/gradient_spike": 1})
    if multi_turn:
        for r in rows:
            if "val/success" in r:
                r.update({"val/random_success": 0.2, "val/optimal_success": 0.9})
    config = {"model": "tiny", "preset": "tiny", "n_groups": 2, "group_size": 4, "steps": 2}
    return dict(rows=rows, config=config, t0=100.0, wall=130.0, load_start=(0.1, 0.2, 0.3))


def test_one_schema_for_every_task():
    single = harness.summarise(fake_run(False), "python starpo_bandit.py", 0.95, 180, (0.9, 0.95), judged=True)
    multi = harness.summarise(fake_run(True), "python starpo_sokoban.py", 0.4, 1200, (0.4, 0.6), judged=True)
    assert set(multi) - set(single) == {"val_random_success", "val_optimal_success"}  # logged by the grid tasks only
    assert multi["eval_curve"][-1] == {
        "step": 2,
        "wall_s": 30.0,
        "val_success": 0.5,
        "val_random_success": 0.2,
        "val_optimal_success": 0.9,
    }
    assert multi["wall_s_before_training"] == 10.0 and multi["wall_s_to_val"] == {"0.4": 30.0, "0.6": None}
    assert multi["target_met"] and not single["target_met"]  # 0.5 >= 0.4 at 30 s; the bandit never reached 0.95
    assert multi["median_s_per_step_excl_eval"] == 8.0 and multi["median_s_breakdown"]["gen"] == 4.0
    assert multi["gen_tokens_per_s"] == 20 * 8 * 3 / 4.0 and single["gen_tokens_per_s"] == 20 * 8 / 4.0
    assert not harness.summarise(fake_run(True), "x", 0.4, 1200, (0.4,), judged=False)["target_met"]  # a quick check
    assert multi["warnings"] == {"gradient_spike": [2]}  # kind -> the steps it fired on
    assert single["collapse_share_of_step"] == 0.0 and single["collapse_s_per_step_mean"] == 0.0  # none measured


def test_the_collapse_diagnostics_cost_is_their_share_of_all_steps_seconds():
    run = fake_run(False)
    run["rows"][1]["timing_s/collapse"] = 0.9  # measured on step 1 only (steps: 8 s and 10 s)
    got = harness.summarise(run, "python starpo_bandit.py", 0.95, 180, (0.9,), judged=True)
    assert got["collapse_share_of_step"] == 0.05 and got["collapse_s_per_step_mean"] == 0.45


def test_every_benchmark_uses_the_harness_command_line():
    for task in ("bandit", "frozenlake", "sokoban"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "bench" / f"{task}_cpu.py"), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0
        for flag in ("--warm-cache", "--steps", "--val-size", "--out", "--seed"):
            assert flag in out.stdout, (task, flag)


def test_a_short_bandit_benchmark_writes_the_schema(tmp_path):
    out = tmp_path / "b.json"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bandit_cpu.py"),
            "--warm-cache",
            "--steps",
            "2",
            "--val-size",
            "8",
            "--out",
            str(out),
            "--",
            "--eval-every",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and [c["step"] for c in result["eval_curve"]] == [0, 1, 2]
    assert not result["target_met"] and result["cold_cache"] is False and result["config"]["preset"] == "tiny"
    assert result["machine"]["cpus"] >= 1 and len(result["machine"]["load_avg_at_start"]) == 3


def test_profile_step_lists_where_a_rollout_and_its_update_spend_their_time(tmp_path):
    """bench/profile_step.py: the default FrozenLake command's rollout and update under torch.profiler, the top
    operators with their shares, the page faults of each rollout; script flags after -- reach the script."""
    import profile_step

    out = tmp_path / "prof.json"
    profile_step.main(["--rollouts", "1", "--top", "3", "--out", str(out), "--", "--max-turns", "2"])
    r = json.loads(out.read_text())
    assert r["script_flags"][-2:] == ["--max-turns", "2"] and r["update"]["old_logprobs_s"] >= 0
    assert [x["profiled"] for x in r["rollouts"]] == [True] and 1 <= r["rollouts"][0]["turns_per_episode"] <= 2
    for part in ("rollout_top_ops", "update_top_ops"):
        ops = r[part]
        assert len(ops) == 3 and all(0 < o["share"] <= 1 and o["calls"] > 0 for o in ops)
        assert [o["self_s"] for o in ops] == sorted((o["self_s"] for o in ops), reverse=True)
    assert r["update"]["rows"] == 32 and r["update"]["padded_tokens"] > 0  # half of 8 groups of 8 kept


def test_the_memory_benchmark_records_each_phase_and_the_peak(tmp_path):
    """bench/memory_cpu.py on a short bandit run: the peak covers every phase of step 1, evaluation included."""
    out = tmp_path / "m.json"
    flags = ["--val-size", "8", "--n-groups", "2", "--group-size", "4"]
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_cpu.py"), "bandit", "--out", str(out), "--", *flags],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"].values()
    assert (
        run["command"].startswith("python starpo_bandit.py --steps 1 --eval-every 1") and len(run["val_success"]) == 2
    )
    if run["step1_gb"]:  # Linux
        assert {"gen", "update", "eval", "peak"} <= set(run["step1_gb"]) and 0.1 < run["peak_gb"] < 100
        assert max(run["step1_gb"].values()) <= run["peak_gb"] and run["step0_gb"]["peak"] <= run["peak_gb"]
    bad = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory_cpu.py"), "pong"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown task(s): pong" in bad.stderr
