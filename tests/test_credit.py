"""Multi-turn credit in the scripts: --estimator gigpo (GiGPO's state groups, common.gigpo_advantages, on each turn's
tokens) and --rollout-reuse k (RAGEN's Online-k freshness knob), in both multi-turn scripts. (The maths' hand cases
and reference check: tests/test_gigpo.py; vLLM: tests/test_vllm_cpu.py; two processes: tests/test_torchrun.py.)"""

import json

import pytest
import torch

import common
import plumbing.dist
import plumbing.flags
import starpo_frozenlake as fl
import starpo_sokoban as ss
from conftest import FakeTok
from plumbing import metrics

QUICK = ["--n-groups", "2", "--group-size", "4", "--val-size", "4", "--eval-every", "0", "--sample-every", "0"]
TIMING = plumbing.dist.MEASURED


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def turn(state, actions, reward=0.0):
    return fl.Turn(state, "", None, None, actions, False, reward, [], reward=reward)


def test_the_anchor_is_the_observation_plus_the_last_k_moves():
    t = fl.Trajectory(0, 0, [], [], [])
    t.turns = [turn("A", ["Left"]), turn("B", ["Up", "Up"]), turn("A", ["Down"]), turn("C", [])]
    assert fl.anchors(t, 0) == [("A", ()), ("B", ()), ("A", ()), ("C", ())]
    assert fl.anchors(t, 2) == [("A", ()), ("B", ("Left",)), ("A", ("Up", "Up")), ("C", ("Up", "Down"))]
    assert fl.anchors is not ss.anchors and ss.anchors(t, 1)[2] == ("A", ("Up",))  # the copy reads the same


def test_gigpo_puts_each_turns_advantage_on_that_turns_tokens():
    """advantages_of(gigpo) = common.gigpo_advantages per kept group, placed on each turn's sampled tokens."""
    args = fl.Args(estimator="gigpo", group_size=2, gamma=0.95, max_turns=3)
    replies = iter(["<think> a </think> <answer> Left </answer>", "<think> b </think> <answer> Up </answer>"] * 20)
    tok = FakeTok()

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        ids = [tok(next(replies))["input_ids"] + [1] for _ in prompts]  # + <|im_end|>
        return [(x, [-0.5] * len(x)) for x in ids]

    rubric = plumbing.flags.weighted_rubric(fl.RUBRIC, "tiny")[0]
    trajs = fl.rollout(generate, tok, [7, 7, 9, 9], args, 1.0, rubric)
    rows = fl.training_rows(trajs, None)
    batch = fl.collate(rows, 0, "cpu")
    mask = batch["loss_mask"]
    adv, returns, stats = fl.advantages_of(args, None, trajs, rows, mask, None, rubric)
    assert returns is None and stats["gigpo/step_groups"] >= 2 and 0 <= stats["gigpo/singleton_frac"] <= 1
    want = []
    for g in (trajs[:2], trajs[2:]):
        per_turn = [[x.reward for x in t.turns] for t in g]
        want += common.gigpo_advantages(per_turn, [fl.anchors(t, 0) for t in g], 0.95, 1.0, "mean", "trajectory")[0]
    assert torch.equal(adv, fl.place_turn_values(rows, want, mask.shape[1]) * mask)
    assert {k: v for k, v in stats.items() if k.startswith("gigpo/")} == metrics.gigpo_stats(
        [common.gigpo_advantages([[x.reward for x in t.turns] for t in g], [fl.anchors(t, 0) for t in g])[1]
         for g in (trajs[:2], trajs[2:])]
    )  # fmt: skip


@pytest.mark.parametrize("script", [fl, ss])
def test_a_gigpo_run_logs_its_state_groups_and_takes_gigpos_discount(script, tmp_path):
    script.main([*QUICK, "--steps", "1", "--estimator", "gigpo", "--output-dir", str(tmp_path)])
    row = rows_of(tmp_path)[1]
    assert {"gigpo/step_groups", "gigpo/singleton_frac", "gigpo/abs_step_adv_mean", "gigpo/abs_step_adv_turn_1"} <= set(
        row
    )
    assert row["gigpo/step_group_size_max"] >= row["gigpo/step_group_size_mean"] >= 1
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["estimator"], config["gamma"], config["gigpo_omega"]) == ("gigpo", 0.95, 1.0)
    script.main([*QUICK, "--steps", "1", "--estimator", "gigpo", "--gamma", "0.5", "--output-dir", str(tmp_path / "g")])
    assert json.loads((tmp_path / "g" / "config.json").read_text())["gamma"] == 0.5  # a --gamma you type wins


def test_rollout_reuse_1_is_todays_run(tmp_path):
    """k = 1 (the default) takes exactly the path it always did: the same metrics, and no freshness key."""
    fl.main([*QUICK, "--steps", "2", "--output-dir", str(tmp_path / "a")])
    fl.main([*QUICK, "--steps", "2", "--rollout-reuse", "1", "--output-dir", str(tmp_path / "b")])
    a, b = rows_of(tmp_path / "a"), rows_of(tmp_path / "b")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(TIMING)}  # noqa: E731
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert not any(k.startswith(("rollout/policy_age", "rollout/stale_")) for r in a for k in r)


@pytest.mark.parametrize("script", [fl, ss])
def test_rollout_reuse_trains_one_batch_k_steps_in_a_row(script, tmp_path):
    script.main([*QUICK, "--steps", "3", "--rollout-reuse", "2", "--output-dir", str(tmp_path)])
    rows = rows_of(tmp_path)[1:]
    assert [r["rollout/policy_age"] for r in rows] == [0, 1, 0]
    same = [k for k in rows[0] if k.startswith(("train/", "rollout/in_group", "rubric/"))]
    assert same and all(rows[1][k] == rows[0][k] for k in same)  # step 2 trains on step 1's episodes
    assert "timing_s/gen" in rows[0] and "timing_s/gen" not in rows[1]  # nothing sampled at step 2
    assert "rollout/stale_logprob_diff_mean" in rows[1] and "rollout/stale_logprob_diff_mean" not in rows[0]
    assert rows[1]["rollout/stale_logprob_diff_mean"] > 0  # the policy moved since the batch was sampled
    assert abs(rows[0]["actor/ppo_kl"]) < 1e-6 < abs(rows[1]["actor/ppo_kl"])  # ratio 1 only on a fresh batch


def test_bad_freshness_and_gigpo_flags_fail_in_one_line(capsys, tmp_path):
    cases = [
        (["--rollout-reuse", "0"], "error: --rollout-reuse: must be >= 1 (1 = fresh rollouts every step)"),
        (["--gigpo-history", "-1"], "error: --gigpo-history: must be >= 0 (0 = the observation alone)"),
        (["--estimator", "gigpo", "--group-size", "1"], "error: --group-size: must be >= 2 with --estimator gigpo"),
    ]
    for flags, error in cases:
        with pytest.raises(SystemExit) as e:
            fl.resolve_args(
                plumbing.flags.parse_args(fl.Args, ["--model", "tiny", "--output-dir", str(tmp_path), *flags])
            )
        assert e.value.code == 2 and capsys.readouterr().err.startswith(error)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_run_resumed_in_the_middle_of_a_reused_batch_starts_a_fresh_one(tmp_path):
    flags = [*QUICK, "--rollout-reuse", "2", "--save-every", "1", "--output-dir", str(tmp_path)]
    fl.main([*flags, "--steps", "1"])
    fl.main(["--resume", "--steps", "4", "--output-dir", str(tmp_path)])
    ages = [r.get("rollout/policy_age") for r in rows_of(tmp_path)]
    assert ages == [None, 0, 0, 0, 1]  # step 2 sampled afresh (its batch was not saved); steps 3-4 one batch
