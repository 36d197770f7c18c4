"""Tests for common.gigpo_advantages, GiGPO's advantage (Feng et al., arXiv 2505.10978, Eqs. 3-8).

Hand-worked cases in numbers that are exact in binary (singletons give 0, two members give +-half their difference,
omega = 0 is group_advantages exactly, discounting, the logged stats), and one recorded FrozenLake-like batch checked
against a plain-Python reference written here with loops and dicts, independently of common.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import common
from common import gigpo_advantages


# ---------------------------------------------------------------------------------------------------------------------
# The plain-Python reference: loops, dicts and floats, no torch
# ---------------------------------------------------------------------------------------------------------------------


def ref_relative(x, pool, norm, eps):
    """(x - mean(pool)) / F; 0 when the pool has fewer than two values or all of them are equal."""
    if len(pool) < 2 or max(pool) == min(pool):
        return 0.0
    mean = sum(pool) / len(pool)
    if norm == "mean":
        return x - mean
    std = math.sqrt(sum((p - mean) ** 2 for p in pool) / (len(pool) - 1))
    return (x - mean) / (std + eps)


def ref_gigpo(turn_rewards, anchors, gamma, omega, norm, episode_baseline, eps=1e-6):
    totals = [sum(r) for r in turn_rewards]
    if episode_baseline == "trajectory":
        pool = list(totals)
    else:  # every step-sample carries its trajectory's total
        pool = [totals[i] for i in range(len(turn_rewards)) for _ in turn_rewards[i]]
    a_e = [ref_relative(R, pool, norm, eps) for R in totals]
    togo = []  # backward scan, the other way round from common's closed form
    for rewards in turn_rewards:
        acc, out = 0.0, []
        for r in reversed(rewards):
            acc = r + gamma * acc
            out.insert(0, acc)
        togo.append(out)
    members = {}
    for i in range(len(anchors)):
        for t in range(len(anchors[i])):
            members.setdefault(anchors[i][t], []).append((i, t))
    a_s = {}
    for group in members.values():
        values = [togo[i][t] for i, t in group]
        for i, t in group:
            a_s[(i, t)] = ref_relative(togo[i][t], values, norm, eps)
    adv = [[a_e[i] + omega * a_s[(i, t)] for t in range(len(turn_rewards[i]))] for i in range(len(turn_rewards))]
    sizes = [len(g) for g in members.values()]
    samples = sum(len(r) for r in turn_rewards)
    mean_abs = []
    for t in range(max(len(r) for r in turn_rewards)):
        played = [abs(a_s[(i, t)]) for i in range(len(turn_rewards)) if len(turn_rewards[i]) > t]
        mean_abs.append(sum(played) / len(played))
    singles = sum(1 for s in sizes if s == 1)
    return adv, {"step_group_sizes": sizes, "singleton_share": singles / samples, "mean_abs_step_adv": mean_abs}


# ---------------------------------------------------------------------------------------------------------------------
# Hand-worked cases
# ---------------------------------------------------------------------------------------------------------------------


def test_a_singleton_state_gives_zero_step_advantage():
    # Two members, every state seen once: only the episode term is left (R = 1 and 0: A_E = +-0.5).
    adv, stats = gigpo_advantages([[1.0], [0.0]], [["a"], ["b"]], omega=1.0)
    assert adv == [[0.5], [-0.5]]
    assert stats["singleton_share"] == 1.0 and stats["mean_abs_step_adv"] == [0.0]


def test_a_lone_member_has_no_episode_advantage_but_its_revisits_still_compare():
    # n = 1: A_E = 0 (verl-agent would keep R_i); state a seen at turns 0 and 1 with returns 0.95 and 1.
    adv, stats = gigpo_advantages([[0.0, 1.0]], [["a", "a"]])
    assert adv == [[pytest.approx(-0.025), pytest.approx(0.025)]]
    assert stats["step_group_sizes"] == [2] and stats["singleton_share"] == 0.0


def test_two_members_in_one_state_get_plus_minus_half_their_difference():
    # Equal totals (A_E = 0); at turn 0 both see state s with returns 0 + 0.5 * 1 = 0.5 and 1 + 0.5 * 0 = 1.
    adv, _ = gigpo_advantages([[0.0, 1.0], [1.0, 0.0]], [["s", "x"], ["s", "y"]], gamma=0.5)
    assert adv == [[-0.25, 0.0], [0.25, 0.0]]  # +-(1 - 0.5) / 2; turn 1's states are singletons
    adv, _ = gigpo_advantages([[3.0], [1.0]], [["s"], ["s"]], omega=0.5)  # A_E = +-1, A_S = +-1
    assert adv == [[1.5], [-1.5]]


def random_group(rng, n):
    """n members of 1-6 turns, rewards of a FrozenLake-like rubric (0.15 steps make float32 means inexact)."""
    rewards = [[rng.choice([0.0, 0.15, -0.1, 1.0]) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    anchors = [[rng.choice("abcd") for _ in r] for r in rewards]
    return rewards, anchors


@pytest.mark.parametrize("norm", ["mean", "mean_std"])
@pytest.mark.parametrize("seed", range(20))
def test_omega_zero_is_the_episode_level_estimator_exactly(norm, seed):
    rng = random.Random(seed)
    rewards, anchors = random_group(rng, rng.choice([2, 3, 5, 8]))
    adv, _ = gigpo_advantages(rewards, anchors, omega=0.0, norm=norm)
    assert all(row == [row[0]] * len(row) for row in adv)  # every turn of a trajectory carries the same value
    scores = torch.tensor([[sum(r) for r in rewards]], dtype=torch.float64)  # (1, n): the trajectory scores
    expected = common.group_advantages(scores, norm_std=norm == "mean_std")[0]  # (n,) float32
    ours = torch.tensor([row[0] for row in adv], dtype=torch.float64)  # (n,)
    assert torch.equal(ours.float(), expected)  # bit for bit once rounded to group_advantages' float32
    assert torch.equal(common.relative_to(scores[0], scores[0], norm), ours)  # and the float64 is that arithmetic


@pytest.mark.parametrize("norm", ["mean", "mean_std"])
@pytest.mark.parametrize("baseline", ["trajectory", "step"])
def test_no_signal_gives_exact_zeros_never_nan(norm, baseline):
    same = [[0.15, 0.15, 0.15]] * 3  # float sums of 0.15 are inexact: the zero must not come from eps absorbing it
    adv, _ = gigpo_advantages(same, [["a", "b", "c"]] * 3, norm=norm, episode_baseline=baseline)
    assert adv == [[0.0] * 3] * 3
    assert gigpo_advantages([[1.0]], [["a"]], norm=norm, episode_baseline=baseline)[0] == [[0.0]]  # a lone member
    assert gigpo_advantages([], [], norm=norm, episode_baseline=baseline) == (
        [],
        {"step_group_sizes": [], "singleton_share": 0.0, "mean_abs_step_adv": []},
    )


def test_step_baseline_weighs_long_episodes_more():
    # One member wins in 1 turn (R = 1), the other fails in 3 (R = 0); all states distinct, so A = A_E.
    rewards, anchors = [[1.0], [0.0, 0.0, 0.0]], [["a"], ["b", "c", "d"]]
    traj, _ = gigpo_advantages(rewards, anchors)  # baseline over members: mean(1, 0) = 0.5
    step, _ = gigpo_advantages(rewards, anchors, episode_baseline="step")  # over step-samples: mean(1, 0, 0, 0)
    assert traj == [[0.5], [-0.5] * 3]
    assert step == [[0.75], [-0.25] * 3]
    traj_std, _ = gigpo_advantages(rewards, anchors, norm="mean_std")  # std(1, 0) = sqrt(1/2)
    step_std, _ = gigpo_advantages(rewards, anchors, norm="mean_std", episode_baseline="step")  # std(1, 0, 0, 0) = 1/2
    assert traj_std[0][0] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-15)
    assert step_std == [[0.75 / (0.5 + 1e-6)], [-0.25 / (0.5 + 1e-6)] * 3]


def test_discounting_credits_a_turn_with_what_followed():
    # The winner's returns at turns 0, 1, 2 are 0.25, 0.5, 1 (gamma 0.5); the loser's 0, 0, 0 in the same states.
    rewards, anchors = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], [["a", "b", "c"]] * 2
    adv, _ = gigpo_advantages(rewards, anchors, gamma=0.5)
    assert adv == [[0.5 + 0.125, 0.5 + 0.25, 0.5 + 0.5], [-0.5 - 0.125, -0.5 - 0.25, -0.5 - 0.5]]
    undiscounted, _ = gigpo_advantages(rewards, anchors, gamma=1.0)
    assert undiscounted == [[1.0] * 3, [-1.0] * 3]


def test_stats_on_a_hand_case():
    # a: (0,0), (1,0), returns 1 and 0; b: (0,1), (1,2), returns 1 and 0; c: (1,1) alone. Sizes by first sight.
    adv, stats = gigpo_advantages([[0.0, 1.0], [0.0, 0.0, 0.0]], [["a", "b"], ["a", "c", "b"]], gamma=1.0)
    assert adv == [[1.0, 1.0], [-1.0, -0.5, -1.0]]
    assert stats == {"step_group_sizes": [2, 2, 1], "singleton_share": 0.2, "mean_abs_step_adv": [0.5, 0.25, 0.5]}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        gigpo_advantages([[1.0]], [["a"]], norm="mean_std_norm")
    with pytest.raises(ValueError):
        gigpo_advantages([[1.0]], [["a"]], episode_baseline="trajectories")
    with pytest.raises(ValueError):
        gigpo_advantages([[1.0, 0.0]], [["a"]])


# ---------------------------------------------------------------------------------------------------------------------
# One recorded batch against the reference
# ---------------------------------------------------------------------------------------------------------------------

# One episode group of FrozenLake 4x4 (start 00, goal beyond 12): the state shown at each turn as row-column, the
# rubric's reward per turn (1 on reaching the goal, -0.1 for an unparseable reply, which leaves the state unchanged).
RECORDED_REWARDS = [
    [0.0, -0.1, 0.0, 0.0, 1.0],  # 00 -> 01, bad reply (stays), 01 -> 02 -> 12 -> goal
    [0.0, -0.1, 0.0],  # 00 -> 10, bad reply, 10 -> hole
    [-0.1, 0.0, 0.0, 0.0, 1.0],  # bad reply at the start, then 00 -> 01 -> 02 -> 12 -> goal
    [0.0, 0.0, 0.0],  # 00 -> 01 -> 11 -> hole
]
RECORDED_ANCHORS = [
    ["00", "01", "01", "02", "12"],
    ["00", "10", "10"],
    ["00", "00", "01", "02", "12"],
    ["00", "01", "11"],
]


@pytest.mark.parametrize("norm", ["mean", "mean_std"])
@pytest.mark.parametrize("baseline", ["trajectory", "step"])
@pytest.mark.parametrize("gamma, omega", [(0.95, 1.0), (1.0, 0.5), (0.9, 0.0)])
def test_recorded_batch_matches_the_plain_python_reference(norm, baseline, gamma, omega):
    adv, stats = gigpo_advantages(RECORDED_REWARDS, RECORDED_ANCHORS, gamma, omega, norm, baseline)
    want, want_stats = ref_gigpo(RECORDED_REWARDS, RECORDED_ANCHORS, gamma, omega, norm, baseline)
    assert [len(row) for row in adv] == [5, 3, 5, 3]
    for row, want_row in zip(adv, want):
        assert row == pytest.approx(want_row, rel=1e-12, abs=1e-12)
    assert stats["step_group_sizes"] == want_stats["step_group_sizes"] == [5, 4, 2, 2, 2, 1]  # 00 01 02 12 10 11
    assert stats["singleton_share"] == want_stats["singleton_share"] == 1 / 16
    assert stats["mean_abs_step_adv"] == pytest.approx(want_stats["mean_abs_step_adv"], rel=1e-12, abs=1e-12)
    assert all(isinstance(a, float) and math.isfinite(a) for row in adv for a in row)  # plain floats for the caller


def test_recorded_batch_by_hand_at_its_defaults():
    # gamma 0.95, omega 1, mean-norm, trajectory baseline. Totals 0.9, -0.1, 0.9, 0: mean 0.425.
    adv, _ = gigpo_advantages(RECORDED_REWARDS, RECORDED_ANCHORS)
    # State 12 (turn 4 of members 0 and 2): both returns 1, so A_S = 0 and A = A_E = 0.9 - 0.425.
    assert adv[0][4] == pytest.approx(0.475) and adv[2][4] == pytest.approx(0.475)
    # State 11 is seen once: member 3's last turn gets its A_E = -0.425 alone.
    assert adv[3][2] == pytest.approx(-0.425)
    # State 10: member 1's returns -0.1 (the bad reply) and 0 (the fall): A_S = -0.05 and +0.05.
    assert adv[1][1] == pytest.approx(-0.525 - 0.05) and adv[1][2] == pytest.approx(-0.525 + 0.05)
