"""RAGEN-2 in the scripts: the bandit's per-member payouts and arm pairs, the filter's flags and its empty-batch skip,
the collapse diagnostics, pass@k at evaluation and bi-level GAE, as a user runs them (the maths itself is tested in
test_ragen2_maths.py)."""

import json

import pytest
import torch

import common
import plumbing.collapse
import starpo_bandit as sb
import starpo_frozenlake as fl
import starpo_sokoban as ss
from conftest import FakeTok, run_script_file

QUICK = ["--steps", "2", "--eval-every", "0", "--val-size", "8", "--sample-every", "0"]


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- the bandit's payouts ----------------------------------------------------------------------------------------


def payouts(draw, seed=12, members=16):
    envs = [sb.BanditEnv(payout_draw=draw) for _ in range(members)]
    prompts = [env.reset(seed, m) for m, env in enumerate(envs)]
    return prompts, [env.step("Dragon")[1] for env in envs]


def test_a_group_shares_its_prompt_and_each_member_draws_its_own_payout():
    prompts, paid = payouts("member")
    assert len(set(prompts)) == 1  # one prompt per group: the GRPO baseline compares like with like
    assert set(paid) == {0.0, 1.0}  # members who chose the same arm were paid differently
    assert payouts("member") == (prompts, paid)  # reproducible: a function of (group seed, member)
    assert payouts("member", seed=13)[1] != paid


def test_payout_draw_group_shares_one_draw():
    prompts, paid = payouts("group")
    assert len(set(prompts)) == 1 and len(set(paid)) == 1
    for seed in range(20):  # member 0's payout stream differs from the group's, the arm order does not
        assert payouts("member", seed, 1)[0] == payouts("group", seed, 1)[0]


def test_rollout_numbers_the_members_of_a_group():
    def generate(prompts, temperature, seeds=None):
        tok = FakeTok()
        text = "<think> t </think> <answer> Dragon </answer>"
        return [(tok(text)["input_ids"] + [1], [-0.5] * (len(text) + 1)) for _ in prompts]

    kw = dict(payout_draw="member", pairs=())
    trajs = sb.rollout(generate, FakeTok(), [5] * 16, kw, 1.0, 10**6, sb.RUBRIC)
    assert [t.turn.payout for t in trajs] == payouts("member", 5)[1]


def test_ragen_arm_pairs_train_on_twelve_and_evaluate_on_eight_held_out():
    args = sb.Args(arm_pairs="ragen")
    train, val = sb.env_kwargs_of(args, "train"), sb.env_kwargs_of(args, "val")
    assert len(train["pairs"]) == 12 and len(val["pairs"]) == 8
    assert not {n for p in train["pairs"] for n in p} & {n for p in val["pairs"] for n in p}
    seen = set()
    for seed in range(200):
        envs = [sb.BanditEnv(**train) for _ in range(4)]
        states = {env.reset(seed, m) for m, env in enumerate(envs)}
        assert len(states) == 1  # the group shares its pair and its order
        seen.add((envs[0].low_name, envs[0].high_name))
    assert seen == set(sb.RAGEN_TRAIN_PAIRS)
    env = sb.BanditEnv(**train)
    env.reset(3)
    assert env.step(env.high_name)[3]["success"] and not env.step(env.low_name)[3]["success"]


# ---- the algorithms' settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [sb, fl, ss])
def test_starpo_s_is_the_papers_filter_and_starpo_s2_is_ragen2s(script):
    s, s2 = script.ALGOS["starpo-s"], script.ALGOS["starpo-s2"]
    assert (s["filter"], s["keep_ratio"], s["keep_zero"]) == ("top_k", 0.25, True)
    assert (s2["filter"], s2["keep_ratio"], s2["keep_zero"]) == ("top_p", 0.9, False)
    assert {k: v for k, v in s.items() if not k.startswith(("filter", "keep"))} == {
        k: v for k, v in s2.items() if not k.startswith(("filter", "keep"))
    }  # the filter is the only difference
    assert script.SETTINGS["filter_prob_mode"] == "linear" and script.SETTINGS["filter_eps"] == 0.01
    assert script.ALGOS["starpo"]["filter"] == "none"


def test_the_default_filter_keeps_what_starpo_s_kept_before():
    """select_groups' top_k with zero-std groups allowed is the old filter_groups: ties to the lower index."""
    gen = torch.Generator().manual_seed(36)
    for _ in range(200):
        G, n = int(torch.randint(1, 17, (1,), generator=gen)), int(torch.randint(2, 9, (1,), generator=gen))
        scores = torch.randint(0, 3, (G, n), generator=gen).double() / 2  # many ties and zero-std groups
        for r in (0.25, 0.5, 0.29, 1.0):
            std = [round(x, 9) for x in scores.std(dim=1).tolist()]
            k = max(1, int(G * r + 1e-9))
            old = sorted(sorted(range(G), key=lambda g: (-std[g], g))[:k])  # the old rule, spelled out
            assert common.select_groups(common.group_stat(scores), "top_k", r, include_zero=True) == old


# ---- runs --------------------------------------------------------------------------------------------------------


def test_bandit_top_p_run_logs_ragens_filter_metrics_and_each_steps_groups(tmp_path):
    r = run_script_file("starpo_bandit.py", *QUICK, "--algo", "starpo-s2", "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = rows_of(tmp_path / "metrics.jsonl")
    groups = rows_of(tmp_path / "groups.jsonl")
    assert [g["step"] for g in groups] == [1, 2]
    for g, m in zip(groups, metrics[1:]):
        assert (g["strategy"], g["value"], g["stat"]) == ("top_p", 0.9, "std") and len(g["values"]) == 8
        assert g["kept"] == common.select_groups(g["values"], "top_p", 0.9, "linear", False, 0.01)
        assert m["rollout/filter_kept_count"] == len(g["kept"]) and m["rollout/filter_kept_ratio"] == len(g["kept"]) / 8
        assert m["rollout/filter_zero_count"] == sum(v <= 1e-10 for v in g["values"])
        assert m["rollout/empty_after_filter"] == int(not g["kept"])
        assert ("actor/pg_loss" in m) == bool(g["kept"])


def test_a_step_with_no_signal_is_skipped_and_empty_steps_in_a_row_end_the_run(tmp_path):
    zero = "env_reward=0,format_reward=0,invalid_answer_penalty=0"  # every score 0: no group carries a signal
    flags = [*QUICK[2:], "--steps", "7", "--algo", "starpo-s2", "--rubric-weights", zero]  # SETTINGS: 5 in a row
    r = run_script_file("starpo_bandit.py", *flags, "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped after step 5: the filter kept no group for 5 steps in a row" in r.stdout + r.stderr
    rows = rows_of(tmp_path / "metrics.jsonl")[1:]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5] and sb.SETTINGS["empty_stop_steps"] == 5
    assert [m["rollout/consecutive_empty_after_filter_steps"] for m in rows] == [1, 2, 3, 4, 5]
    assert all(m["rollout/empty_after_filter"] == 1 and "actor/pg_loss" not in m for m in rows)
    assert (tmp_path / "checkpoints" / "step-000005").is_dir() or any(tmp_path.rglob("step-000005"))
    assert "done: 5 steps" in r.stdout + r.stderr


def test_collapse_diagnostics_and_pass_at_k_in_a_bandit_run(tmp_path):
    flags = [*QUICK, "--mi-every", "1", "--val-samples", "4", "--output-dir", str(tmp_path)]
    r = run_script_file("starpo_bandit.py", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(tmp_path / "metrics.jsonl")
    for m in rows[1:]:
        assert 0 <= m["collapse/valid_thinking_rate"] <= 1 and m["collapse/first_turn_num_total"] == 64
        if m["collapse/first_turn_num_valid"]:
            assert m["collapse/mi_upper_bound"] == pytest.approx(torch.log(torch.tensor(8.0)).item())
            assert 0 <= m["collapse/retrieval_accuracy"] <= 1 and "collapse/mi_zscore_ema" in m
        assert m["timing_s/collapse"] > 0 and "train/pass@8" in m
    for m in (rows[0], rows[-1]):  # evaluations: every episode played 4 times
        assert m["val/pass@1"] == pytest.approx(m["val/success"])
        assert m["val/pass@1"] <= m["val/pass@2"] <= m["val/pass@4"] <= 1
    heat = rows_of(tmp_path / "collapse.jsonl")
    assert heat and all(len(row) == len(h["prompts"]) for h in heat for row in h["matrix"])
    assert all(len(h["cols"]) == len(h["matrix"]) <= 64 for h in heat)


def test_think_ids_are_the_sampled_tokens_inside_the_think():
    tok = FakeTok()
    ids = tok("<think> abc </think> <answer> x </answer>")["input_ids"]
    assert tok.decode(plumbing.collapse.think_ids(tok, ids)) == " abc "
    assert plumbing.collapse.think_ids(tok, tok("<think>   </think>")["input_ids"]) == []  # blank
    assert plumbing.collapse.think_ids(tok, tok("<think> no end")["input_ids"]) == []
    assert plumbing.collapse.think_ids(tok, tok("no think </think>")["input_ids"]) == []


@pytest.mark.parametrize("script", ["starpo_frozenlake.py", "starpo_sokoban.py"])
def test_multi_turn_bi_level_gae_filter_and_diagnostics_run(script, tmp_path):
    flags = [*QUICK, "--max-turns", "2", "--estimator", "bi-level-gae", "--filter", "top_p", "--keep-ratio", "0.9"]
    r = run_script_file(script, *flags, "--mi-every", "1", "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rows_of(tmp_path / "metrics.jsonl")
    assert all("collapse/valid_thinking_rate" in m and "train/pass@8" in m for m in rows[1:])
    assert any("critic/vf_loss" in m for m in rows[1:]) or all(m["rollout/empty_after_filter"] for m in rows[1:])
    assert rows_of(tmp_path / "groups.jsonl")[0]["strategy"] == "top_p"
