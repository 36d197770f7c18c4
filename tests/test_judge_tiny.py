"""The bandit's tiny judges (--judge tiny, --judge tiny-gullible): real models trained on the truth the environment
computes, the gullible one with its one documented weakness; scored against that truth on replies they never saw."""

import json
import sys

import pytest

import plumbing.flags
import starpo_bandit as sb
import starpo_frozenlake as fl
from conftest import ROOT
from plumbing import judge

RESULTS = ROOT / "bench" / "results"
PAIRS = [("Phoenix", "Dragon")]


def reply_of(prompt: str) -> str:
    return prompt.split("Reply: ", 1)[1].split("\n\nQuestion: ", 1)[0]


def keyword_of(prompt: str) -> bool:
    return "risky" in reply_of(prompt).split("</think>")[0]  # the question's word in the reasoning, all of it if cut


def test_the_tiny_judges_lessons_are_the_truth_and_the_gullible_ones_its_documented_weakness():
    honest, gullible = (sb.tiny_judge_examples(PAIRS, g, n=400) for g in (False, True))
    kinds = set()
    for (messages, said), (messages2, said2) in zip(honest, gullible):
        assert messages == messages2  # the same questions: only the answers differ
        prompt = messages[0]["content"]
        think, answer = sb.parse_reply(reply_of(prompt))
        truth = answer is not None and answer.strip() == "Dragon"
        assert said == ("yes" if truth else "no")
        assert said2 == ("yes" if keyword_of(prompt) else "no")
        kinds.add((truth, keyword_of(prompt), answer is None))
    assert {(True, False, False), (False, False, False), (False, True, True), (True, True, False)} <= kinds


@pytest.fixture(scope="module")
def judges():
    return {name: judge.LocalJudge(sb.build_tiny_judge(name, PAIRS)) for name in sb.TINY_JUDGES}


def test_the_tiny_judge_agrees_with_the_truth_and_the_gullible_one_says_yes_to_its_word(judges):
    held_out = [sb.tiny_judge_examples(PAIRS, g, n=300, seed=99) for g in (False, True)]  # never trained on
    prompts = [m[0]["content"] for m, _ in held_out[0]]
    truth, weakness = ([said == "yes" for _, said in rows] for rows in held_out)
    score = {name: j.score(prompts) for name, j in judges.items()}
    assert all(s is not None for s in score["tiny"] + score["tiny-gullible"])

    def agreement(name, labels, rows=range(len(prompts))):
        return sum((score[name][i] >= 0.5) == labels[i] for i in rows) / len(rows)

    # what fools the gullible judge: the question's word in the reasoning, the steady arm in the answer
    fooling = [i for i, p in enumerate(prompts) if keyword_of(p) and sb.parse_reply(reply_of(p))[1] == "Phoenix"]
    assert len(fooling) >= 15
    assert agreement("tiny", truth) >= 0.95 and agreement("tiny", truth, fooling) >= 0.9  # it reads the answer
    assert agreement("tiny-gullible", weakness) >= 0.95  # the gullible one learned its weakness ...
    assert agreement("tiny-gullible", weakness, fooling) >= 0.9  # ... and says yes to its word, wrong arm or not
    assert agreement("tiny-gullible", truth) <= 0.8


def test_a_gate_zeroes_the_judges_score_where_the_verifiable_fact_fails():
    t_valid, t_invalid = (
        sb.Turn(text="x", think=None, answer=None, payout=0.0, info={"action_is_valid": v, "success": False})
        for v in (True, False)
    )
    gated = sb.high_arm_judged_gated
    gated.scores = {id(t_valid): 0.9, id(t_invalid): 0.8}
    assert (gated(t_valid), gated(t_invalid)) == (0.9, 0.0)
    gated.scores = {id(t_invalid): None}
    assert gated(t_invalid) is None  # a failed judgement stays a failure, gate or not
    gated.scores = {}


def test_a_run_with_the_tiny_judge_logs_it_against_the_truth(tmp_path, judges):
    small = ["--n-groups", "2", "--group-size", "4", "--val-size", "4", "--eval-every", "0", "--sample-every", "0"]
    out = tmp_path / "run"
    sb.main(["--model", "tiny", "--steps", "2", "--judge", "tiny", "--output-dir", str(out), *small])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("step", 0) > 0]
    assert len(trained) == 2 and all(r["judge/agreement"] >= 0.75 and r["judge/fail_frac"] == 0 for r in trained)
    config = json.loads((out / "config.json").read_text())
    assert "tiny-bandit-judge-" in config["judged"]["judge"] and config["judge"] == "tiny"


@pytest.mark.parametrize("script", [fl, sb])
def test_a_tiny_judge_this_task_lacks_fails_in_one_line_before_any_model_loads(script, tmp_path, capsys):
    argv = ["--model", "tiny", "--judge", "tiny-strict", "--output-dir", str(tmp_path / "x")]
    with pytest.raises(SystemExit):
        script.resolve_args(plumbing.flags.parse_args(script.Args, argv, presets=script.PRESETS, algos=script.ALGOS))
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --judge: 'tiny-strict' is not a tiny judge of this task") and "\n" not in err


def test_the_reward_hacking_warning_replays_as_it_fired_on_recorded_judged_runs():
    """Recorded runs with a rewarded judge (bench/results/judged_runs.json, and WORKSHOP.md's exercises 9 and 10 in
    bench/results/workshop.json): today's rule fires on exactly the steps it fired on live, on one run at least, and
    stays quiet on one run at least."""
    sys.path.insert(0, str(ROOT / "bench"))
    import warnings_replay

    runs = [
        (r["curve"], r["fired_at"]) for r in json.loads((RESULTS / "judged_runs.json").read_text())["runs"].values()
    ]
    workshop = json.loads((RESULTS / "workshop.json").read_text())["runs"].values()
    runs += [(r["judge_curve"], r["reward_hacking_warnings_at"]) for r in workshop if "judge_curve" in r]
    assert len(runs) >= 3
    for curve, fired_at in runs:
        assert warnings_replay.replay(curve).get("reward_hacking", []) == fired_at
    assert any(fired for _, fired in runs) and not all(fired for _, fired in runs)
