"""Judges in the scripts' rubrics (plumbing/judge.py wired): off unless weighted or named, a failed judgement is never
a score, the judge against the truth every step, the cache across a resume, GDPO's normalize_then_sum and each
component's share of the advantage, and the reward-hacking warning. (The judges themselves: tests/test_judge.py;
over HTTP against vLLM's server: tests/test_judge_server.py.)"""

import json

import pytest
import torch

import common
import plumbing.flags
import starpo_bandit as sb
import starpo_frozenlake as fl
from plumbing import judge, metrics
from plumbing.run import collapse_warnings

SMALL = ["--n-groups", "2", "--group-size", "4", "--val-size", "4", "--eval-every", "0", "--sample-every", "0"]


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_failed_judgement_is_left_out_of_the_sum_never_a_0_or_a_1():
    asked = judge.Component("asked", "?", render=str)
    t = sb.Turn(text="x", think=None, answer=None, payout=1.0, info={"action_is_valid": True, "success": True})
    rubric = [(sb.env_reward, 1.0), (asked, 5.0)]
    asked.scores = {id(t): None}
    total, parts = sb.score_turn(t, rubric)
    assert (total, parts["asked"]) == (1.0, None)
    asked.scores = {id(t): 0.5}
    assert sb.score_turn(t, rubric)[0] == 3.5
    assert fl.sum_parts([None, 0.25, None, 0.5]) == 0.75 and fl.sum_parts([None, None]) is None
    assert fl.sum_parts([]) == 0  # an episode with no turn (its first prompt overflowed)


def test_a_judge_component_runs_only_when_weighted_or_named():
    asked = judge.Component("asked", "?", render=str)
    rubric = [(sb.env_reward, 1.0), (asked, 0.0)]
    assert judge.running(rubric, weights_on=False) == [(sb.env_reward, 1.0)]  # off: never called, never logged
    assert judge.running(rubric, weights_on=True) == rubric  # --judge given: logged at weight 0
    assert judge.running([(asked, 0.5)], weights_on=False) == [(asked, 0.5)]  # weighted: it runs


def test_the_default_run_never_builds_a_judge(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a judge was built")

    monkeypatch.setattr(judge, "make", refuse)
    sb.main([*SMALL, "--steps", "1", "--output-dir", str(tmp_path)])
    assert not any(k.startswith(("judge/", "rubric/high_arm_judged")) for r in rows_of(tmp_path) for k in r)
    assert json.loads((tmp_path / "config.json").read_text())["judged"] is None


class FlakyJudge:
    """A judge that fails every third question and answers the rest with a fixed yes-probability."""

    model_id, decoding, hits = "flaky", {"max_tokens": 1}, 0

    def __init__(self):
        self.asked = 0

    def describe(self):
        return "flaky test judge"

    def score(self, prompts):
        out = [None if (self.asked + i) % 3 == 0 else 0.8 for i in range(len(prompts))]
        self.asked += len(prompts)
        return out


def test_a_judged_run_logs_the_judge_against_the_truth_and_counts_failures(tmp_path, monkeypatch):
    monkeypatch.setattr(judge, "make", lambda *a, **k: FlakyJudge())
    sb.main(
        [
            *SMALL,
            "--steps",
            "2",
            "--judge",
            "policy",
            "--rubric-weights",
            "high_arm_judged=0.5",
            "--output-dir",
            str(tmp_path),
        ]
    )
    row = rows_of(tmp_path)[1]
    assert row["judge/fail_frac"] == pytest.approx(1 / 3, abs=0.1)  # every third question failed, and was counted
    assert row["rubric/high_arm_judged"] == pytest.approx(0.8)  # the mean of the judged replies only: never a 0
    assert 0 <= row["judge/agreement"] <= 1 and row["judge/false_positive"] + row["judge/false_negative"] <= 1
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["judged"] == {"judge": "flaky test judge", "rewarded": ["high_arm_judged"]}


def test_the_local_judge_on_the_policys_start_weights_caches_its_verdicts_across_a_resume(tmp_path):
    flags = [*SMALL, "--judge", "policy", "--save-every", "1", "--output-dir", str(tmp_path)]
    sb.main([*flags, "--steps", "1"])
    cache = tmp_path / "judge_cache.jsonl"
    first = cache.read_text().splitlines()
    assert first and all(0 <= json.loads(line)["score"] <= 1 for line in first)
    assert "judge/agreement" in rows_of(tmp_path)[1] and "rubric/high_arm_judged" in rows_of(tmp_path)[1]
    sb.main(["--resume", "--steps", "2", "--output-dir", str(tmp_path)])
    keys = [json.loads(line)["key"] for line in cache.read_text().splitlines()]
    assert keys[: len(first)] == [json.loads(line)["key"] for line in first] and len(keys) == len(set(keys))


def test_bad_judge_and_rubric_norm_flags_fail_in_one_line(tmp_path, capsys):
    cases = [
        (
            ["--estimator", "gae", "--rubric-norm", "normalize_then_sum"],
            "error: --rubric-norm: normalize_then_sum needs",
        ),
        (["--judge-model-id", "m"], "error: --judge-model-id: names the model of a judge server"),
    ]
    for flags, error in cases:
        with pytest.raises(SystemExit) as e:
            sb.resolve_args(
                plumbing.flags.parse_args(sb.Args, ["--model", "tiny", "--output-dir", str(tmp_path), *flags])
            )
        assert e.value.code == 2 and capsys.readouterr().err.startswith(error)


def test_gdpo_keeps_the_component_a_sum_hides():
    """Two components of one group of four: A decides (0 or 1), B is small (0 or 0.01). Summed first, B barely moves
    the advantage; normalised first (GDPO), it moves it as much as A does."""
    a, b = [[1.0], [1.0], [0.0], [0.0]], [[0.0], [0.01], [0.0], [0.01]]
    centred = [[[v[0] - sum(x[0] for x in c) / 4] for v in c] for c in (a, b)]  # sum_then_normalize's parts
    shares = metrics.advantage_shares(centred, [("a", 1.0), ("b", 1.0)])
    assert shares["adv_share/b"] < 0.02 < 0.98 < shares["adv_share/a"]
    z = [common.group_advantages(torch.tensor([[v[0] for v in c]])).view(-1, 1).tolist() for c in (a, b)]
    gdpo = common.normalize_then_sum(z, [1.0, 1.0])
    assert metrics.advantage_shares(z, [("a", 1.0), ("b", 1.0)])["adv_share/b"] == pytest.approx(0.5, abs=1e-3)
    assert gdpo[1][0] - gdpo[0][0] == pytest.approx(gdpo[0][0] - gdpo[2][0], rel=1e-3)  # B moves it as A does
    flat = torch.tensor([row[0] for row in gdpo], dtype=torch.float64)
    assert flat.mean().item() == pytest.approx(0, abs=1e-9) and flat.std().item() == pytest.approx(1, abs=1e-5)
    assert common.normalize_then_sum([[[1.0], [1.0]]], [2.0]) == [[0.0], [0.0]]  # no signal: zeros


def test_a_gdpo_run_logs_each_components_share(tmp_path):
    fl.main([*SMALL, "--steps", "1", "--rubric-norm", "normalize_then_sum", "--output-dir", str(tmp_path)])
    row = rows_of(tmp_path)[1]
    shares = {k: v for k, v in row.items() if k.startswith("adv_share/")}
    assert set(shares) == {"adv_share/env_reward", "adv_share/format_penalty", "adv_share/progress"}
    assert sum(shares.values()) == pytest.approx(1.0)


def hacking_history(judged, agreement, val):
    return [{"step": s + 1, "rubric/think_judged": j, "judge/agreement": a} | ({"val/success": v} if v is not None else {})
            for s, (j, a, v) in enumerate(zip(judged, agreement, val))]  # fmt: skip


def test_the_reward_hacking_warning_fires_when_the_judged_reward_rises_as_the_truth_falls():
    rising, flat = [0.3] * 10 + [0.6] * 10, [0.45] * 20
    falling, steady = [0.9] * 10 + [0.6] * 10, [0.9] * 20
    no_val = [None] * 20
    kinds = lambda h: [k for k, _ in collapse_warnings(h, set())]  # noqa: E731
    assert kinds(hacking_history(rising, falling, no_val)) == ["reward_hacking"]  # pleasing the judge
    assert kinds(hacking_history(rising, steady, no_val)) == []  # the judge and the truth rise together
    assert kinds(hacking_history(flat, falling, no_val)) == []  # the judge worse, but nothing rewarded rose
    vals = [0.5 if s == 9 else (0.3 if s == 19 else None) for s in range(20)]
    assert kinds(hacking_history(rising, steady, vals)) == ["reward_hacking"]  # val/success fell instead
    msg = collapse_warnings(hacking_history(rising, falling, no_val), set())[0][1]
    assert "think_judged rose 0.30 -> 0.60" in msg and "agreement with the truth 0.90 -> 0.60" in msg
    warned = {"reward_hacking"}
    assert collapse_warnings(hacking_history(rising, falling, no_val), warned) == []  # once per run


def test_a_group_whose_judgements_all_failed_gives_no_signal_and_no_error():
    """GDPO and the shares run each component through the estimator: a judge component with no value in a group
    (its server down) fills the group alike, so it moves no advantage."""
    args = fl.Args(estimator="turn-grpo", group_size=2)
    trajs = [fl.Trajectory(0, 0, [], [], []) for _ in range(2)]
    for t, r in zip(trajs, (1.0, 0.0)):
        t.turns = [fl.Turn("s", "", None, None, [], False, r, [], parts={"env_reward": r, "asked": None})]
    values, _ = fl.group_relative(args, trajs, lambda turn: turn.parts["asked"])
    assert values == [[0.0], [0.0]]
    assert fl.group_relative(args, trajs, lambda turn: turn.parts["env_reward"])[0][0][0] > 0
