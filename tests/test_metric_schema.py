"""One metric schema: a key means the same thing in every script and in both splits (the README's glossary).

Both multi-turn scripts play the same scripted replies (three turns of one invalid word each, so no episode ends
early and nothing depends on the task); their shared statistics must agree key for key and value for value. The
bandit logs the subset that applies to a one-turn task, with the same meaning.
"""

import re

import pytest

import plumbing.flags
from plumbing import judge, metrics
import starpo_bandit as sb
import starpo_frozenlake as fl
import starpo_sokoban as ss
from conftest import ROOT, FakeTok

REPLY = "<think> same words </think> <answer> Jump </answer>"  # 52 characters: 52 tokens + <|im_end|>


def generate(prompts, temperature, turn_cache=None, seeds=None):
    tok = FakeTok()
    return [(tok(REPLY)["input_ids"] + [1], [-0.5] * (len(REPLY) + 1)) for _ in prompts]


def paper_rubric(script):
    """The script's RUBRIC as the paper preset runs it: [(function, weight)]."""
    return plumbing.flags.weighted_rubric(script.RUBRIC, "paper")[0]


def multi_turn(script, seeds=(1, 2, 3)):
    args = script.Args(max_turns=3)
    trajs = script.rollout(generate, FakeTok(), list(seeds), args, 1.0, paper_rubric(script))
    return {**metrics.episode_stats(trajs, "train"), **metrics.reply_stats(trajs)}, trajs


def test_multi_turn_scripts_log_the_same_keys_with_the_same_values():
    a, ta = multi_turn(fl)
    b, tb = multi_turn(ss)
    shared = set(a) & set(b)
    assert set(a) - shared == {"rubric/env_reward", "rubric/format_penalty", "rubric/format_reward"} - shared
    assert set(a) == set(b)  # the same rubric component names, too
    for key in sorted(shared - {"sequence_length/mean", "train/reward", "train/reward_min", "train/reward_max"}):
        assert a[key] == pytest.approx(b[key]), key  # the prompts differ by task; these must not
    assert a["train/num_turns"] == 3 and a["train/num_actions"] == 0 and a["train/action_is_valid"] == 0.0
    # response_length/mean is tokens per reply (per turn), never per episode: 3 turns of 53 tokens log 53
    assert a["response_length/mean"] == b["response_length/mean"] == len(REPLY) + 1
    assert a["think_length/mean"] == len("same words")
    assert a["rubric/format_penalty"] == b["rubric/format_penalty"] == -3.0  # summed per episode: three bad turns
    # the rubric totals differ only by the weights each script gives the same components
    wa = dict((fn.__name__, w) for fn, w in fl.RUBRIC)["format_penalty"]
    wb = dict((fn.__name__, w) for fn, w in ss.RUBRIC)["format_penalty"]
    assert a["train/reward"] == pytest.approx(-3 * wa) and b["train/reward"] == pytest.approx(-3 * wb)


def test_train_and_val_splits_share_their_keys():
    for script in (fl, ss):
        args = script.Args(max_turns=3, val_size=2)
        val, _ = script.evaluate(generate, FakeTok(), args, paper_rubric(script))
        train = metrics.episode_stats(multi_turn(script)[1], "train")
        assert {k.split("/", 1)[1] for k in val} == {k.split("/", 1)[1] for k in train}, script.__name__


def test_the_bandit_logs_the_same_keys_where_they_apply():
    trajs = sb.rollout(generate, FakeTok(), [1, 2], dict(), 1.0, 10**6, sb.RUBRIC)
    a = {**metrics.one_turn_episode_stats(trajs, "train"), **metrics.one_turn_reply_stats(trajs)}
    b, _ = multi_turn(fl)
    missing = set(a) - set(b)
    assert missing <= {"rubric/invalid_answer_penalty"}, missing  # its own rubric component, nothing else new
    assert a["response_length/mean"] == len(REPLY) + 1 == b["response_length/mean"]  # per reply, like the others
    assert a["train/action_is_valid"] == 0.0 and a["think_length/mean"] == len("same words")


def test_filter_stats():
    import torch

    # four groups of two: std (ddof 1) 0, 0.5, 1, 0; the filter kept groups 1 and 2
    scores = torch.tensor([[1.0, 1.0], [0.0, 1.0 / 2**0.5], [0.0, 2**0.5], [3.0, 3.0]], dtype=torch.float64)
    stat = scores.std(dim=1)
    out = metrics.filter_stats(scores, stat, [1, 2])
    assert sb.filter_stats is fl.filter_stats is ss.filter_stats is metrics.filter_stats  # one definition
    assert out["rollout/zero_std_frac"] == 0.5 and out["rollout/chosen_in_group_std"] == 0.75
    assert out["rollout/filter_kept_count"] == 2 and out["rollout/filter_kept_ratio"] == 0.5
    assert out["rollout/filter_zero_count"] == 2 and out["rollout/empty_after_filter"] == 0
    assert out["rollout/in_group_max"] == (1 + 2**-0.5 + 2**0.5 + 3) / 4
    empty = metrics.filter_stats(scores, stat, [])
    assert empty["rollout/empty_after_filter"] == 1 and "rollout/chosen_in_group_std" not in empty
    assert plumbing.flags.given_fields(fl.Args(max_turns=3)) == {"max_turns"}


def glossary_rows():
    section = (ROOT / "README.md").read_text().split("## Metrics glossary", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]


def documented(key: str, rows) -> bool:
    """Whether the README's glossary names `key`: in full, or as a row's later `_suffix` / `name` after the row's
    first full name of the same namespace (`<j>`: a number, `<name>`: a component)."""
    ns, leaf = key.split("/", 1)
    for cell in rows:
        names = re.findall(r"`([^`]+)`", cell)
        if not names or not names[0].startswith(ns + "/"):
            continue
        for n in names:
            pat = re.escape(n.split("/", 1)[-1]).replace(re.escape("<j>"), r"\d+").replace(re.escape("<name>"), r"\w+")
            if re.fullmatch(pat, leaf) or (n.startswith("_") and re.search(pat + "$", leaf)):
                return True
    return False


def test_the_judge_gigpo_gdpo_freshness_and_memory_metrics_are_in_the_glossary():
    stats = {"step_group_sizes": [3, 1], "mean_abs_step_adv": [0.5, 0.25]}
    keys = set(metrics.gigpo_stats([stats])) | set(metrics.advantage_shares([[[1.0]], [[0.5]]], [("a", 1), ("b", 1)]))
    keys |= {k for k in judge.combine({"judge/n_asked": 2, "judge/n_failed": 1, "judge/n_checked": 1,
             "judge/n_agree": 1, "judge/n_false_positive": 0, "judge/n_false_negative": 0,
             "judge/n_cached": 1, "judge/latency_s": 0.1}) if "/n_" not in k}  # fmt: skip
    keys |= {"memory_gb/peak", "memory_gb/gen", "memory_gb/update", "memory_gb/eval", "timing_s/push"}
    keys |= {"rollout/policy_age", "rollout/stale_logprob_diff_mean", "rollout/stale_logprob_diff_max"}
    keys |= {"warn/reward_hacking", "rubric/high_arm_judged"}
    assert len(keys) > 15
    rows = glossary_rows()
    assert [k for k in sorted(keys) if not documented(k, rows)] == []
    assert not documented("gigpo/no_such_metric", rows) and not documented("judge/no_such_rate", rows)
