"""Tests for RAGEN-2's maths in common.py (the rollout filter, pass@k, the collapse diagnostics, bi-level GAE) and
the cross-scoring pass in plumbing/forward.py.

The worked examples are those of the spec (RAGEN2-SPEC.md §A1.4, §A1.9, §A2.5, §A3.1, §A3.2), each recomputed by
hand from RAGEN's code; the filter is also checked against the v1 filter it generalises (filter_groups), the
diagnostics on matrices whose answer is known (a reasoning that ignores its prompt, one that copies it, noise), and
cross_logprobs against one plain forward pass per (prompt, reasoning) pair on a tiny random model.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from common import filter_groups, filter_loss_scale, group_stat, pass_at_k, select_groups

########################################################################################################################
# the rollout filter: group_stat, select_groups, filter_loss_scale
########################################################################################################################

# §A1.9 example 1: Bandit-like, 8 groups x 4 members; the low arm pays 0.1, the high arm 1 or 0.
BANDIT = torch.tensor(
    [
        [0.1, 0.1, 0.1, 0.1],
        [0, 0, 0, 0],
        [1, 0, 0, 0.1],
        [0.1, 1, 0.1, 0.1],
        [0, 0, 0.1, 0.1],
        [1, 1, 0, 0],
        [0.1, 0.1, 0.1, 0.1],
        [0, 0, 0, 0],
    ],
    dtype=torch.float64,
)
BANDIT_STD = [0, 0, 0.4856, 0.4500, 0.0577, 0.5774, 0, 0]


def test_group_stat_on_the_bandit_example():
    assert group_stat(BANDIT).tolist() == pytest.approx(BANDIT_STD, abs=1e-4)
    assert group_stat(BANDIT, "var").tolist() == pytest.approx([0, 0, 0.2358, 0.2025, 0.0033, 0.3333, 0, 0], abs=1e-4)
    assert group_stat(BANDIT).dtype == torch.float64
    assert group_stat(torch.tensor([[3.0], [1.0]])).tolist() == [0.0, 0.0]  # one member: no spread
    with pytest.raises(ValueError, match="statistic"):
        group_stat(BANDIT, "mad")


# (stat, strategy, value, prob_mode, include_zero, kept): every kept set of §A1.9, ascending.
S2 = [4.9, 0.3, 0.2, 0.2, 0.1, 0, 0, 0]  # example 2: Sokoban-scale, one dominant group
S3 = [0.004, 0.005, 0, 0]  # example 3: a near-dead batch
WORKED = [
    # example 1
    (BANDIT_STD, "top_p", 0.9, "linear", False, [2, 3, 5]),
    (BANDIT_STD, "top_p", 0.9, "linear", True, [2, 3, 5]),  # zeros add nothing to the walk
    (BANDIT_STD, "top_p", 0.5, "linear", False, [2, 5]),
    (BANDIT_STD, "top_p", 1.0, "linear", False, [2, 3, 4, 5]),  # the zero-variance filter alone
    (BANDIT_STD, "top_p", 0.9, "softmax", False, [2, 3, 4, 5]),
    (BANDIT_STD, "top_p", 0.9, "softmax", True, [0, 1, 2, 3, 4, 5, 6]),  # tied zeros: g7 is the one left out
    (BANDIT_STD, "top_k", 0.25, "linear", True, [2, 5]),
    (BANDIT_STD, "top_k_abs", 3, "linear", False, [2, 3, 5]),
    (BANDIT_STD, "min_p", 0.5, "linear", False, [2, 3, 5]),
    ([0, 0, 0.2358, 0.2025, 0.0033, 0.3333, 0, 0], "top_p", 0.9, "linear", False, [2, 3, 5]),  # --filter-stat var
    # example 2
    (S2, "top_p", 0.9, "linear", False, [0, 1]),
    (S2, "top_p", 0.95, "linear", False, [0, 1, 2, 3]),  # g2 and g3 tie, both needed
    (S2, "top_p", 0.9, "softmax", False, [0]),
    (S2, "top_k", 0.25, "linear", False, [0, 1]),
    (S2, "min_p", 0.05, "linear", False, [0, 1]),
    # example 3
    ([0, 0, 0, 0], "top_p", 0.9, "linear", False, []),
    ([0, 0, 0, 0], "top_p", 0.9, "linear", True, []),
    ([0, 0, 0, 0], "top_p", 0.9, "softmax", True, [0, 1, 2, 3]),
    ([0, 0, 0, 0], "top_k", 0.25, "linear", True, [0]),  # a tie: the lowest index
    ([0, 0, 0, 0], "top_k", 0.25, "linear", False, []),
    ([0, 0, 0, 0], "min_p", 0.5, "linear", True, [0, 1, 2, 3]),
    (S3, "top_p", 0.9, "linear", False, []),  # total 0.009 < eps / 0.9: below the floor
    (S3, "top_p", 1.0, "linear", False, [0, 1]),
    (S3, "top_k", 0.25, "linear", False, [1]),
    (S3, "top_k", 0.25, "linear", True, [1]),
    (S3, "top_p", 0.9, "softmax", True, [0, 1, 2, 3]),
    # RAGEN's own suite (tests/test_rollout_filter.py)
    ([4, 3, 2, 1], "top_p", 0.6, "linear", True, [0, 1]),
    ([1, 1, 1], "top_p", 0.6, "softmax", True, [0, 1]),
    ([10, 1, 0, 0], "top_p", 0.9, "softmax", False, [0]),
    ([4, 2, 0, 0], "top_p", 0.9, "softmax", False, [0, 1]),
    ([1, 1, 1, 0], "top_p", 0.6, "softmax", False, [0, 1]),
    ([3, 1, 1, 0], "top_p", 0.9, "linear", False, [0, 1, 2]),
    ([4, 2, 0, 0], "top_p", 1.0, "linear", True, [0, 1, 2, 3]),
    ([0, 0, 0], "top_p", 1.0, "linear", True, [0, 1, 2]),
    ([1, 3, 2], "top_p", 1.0, "linear", True, [0, 1, 2]),
    ([0.5] * 4, "top_p", 0.6, "linear", False, [0, 1, 2]),
    ([0.5] * 4, "top_p", 0.6, "linear", True, [0, 1, 2]),
    ([0.5] * 4, "top_p", 0.9, "linear", False, [0, 1, 2, 3]),
    # the 'none' strategy keeps everything, zeros included
    (S2, "none", 0.9, "linear", False, list(range(8))),
]


@pytest.mark.parametrize("stat, strategy, value, prob_mode, include_zero, kept", WORKED)
def test_select_groups_worked_examples(stat, strategy, value, prob_mode, include_zero, kept):
    assert select_groups(stat, strategy, value, prob_mode, include_zero) == kept
    assert select_groups(torch.tensor(stat), strategy, value, prob_mode, include_zero) == kept  # a tensor too


# §A1.4: what each setting keeps when every one of 8 groups has zero variance.
ALL_ZERO = [
    ("top_p", 0.9, "linear", False, []),
    ("top_p", 0.9, "linear", True, []),
    ("top_p", 1.0, "linear", True, list(range(8))),
    ("top_p", 1.0, "linear", False, []),
    ("top_p", 0.9, "softmax", True, list(range(8))),  # first k with k / 8 >= 0.9: 8 of 8
    ("top_p", 0.6, "softmax", True, list(range(5))),  # first k with k / 8 >= 0.6: 5, the lowest indices
    ("top_k", 0.25, "linear", True, [0, 1]),  # max(1, int(0.25 * 8)), ties to the lowest indices
    ("top_k", 0.1, "linear", True, [0]),  # int(0.8) = 0, but at least one
    ("top_k", 0.25, "linear", False, []),
    ("min_p", 0.5, "linear", False, []),
    ("min_p", 0.5, "linear", True, list(range(8))),
]


@pytest.mark.parametrize("strategy, value, prob_mode, include_zero, kept", ALL_ZERO)
def test_select_groups_when_every_group_has_zero_variance(strategy, value, prob_mode, include_zero, kept):
    assert select_groups([0.0] * 8, strategy, value, prob_mode, include_zero) == kept


def test_the_linear_walk_step_by_step():
    """Example 1 at p = 0.9: T = 0.9 * 1.5707 - 0.01 = 1.4036; 0.5774 -> 1.0630 -> 1.5130 >= T, so three groups."""
    assert sum(BANDIT_STD) == pytest.approx(1.5707, abs=1e-4)
    assert select_groups(BANDIT_STD, "top_p", 1.4036 / 1.5707 + 0.01 / 1.5707 - 1e-4) == [2, 3, 5]
    assert select_groups(BANDIT_STD, "top_p", (1.0630 + 0.01) / 1.5707 - 1e-4) == [2, 5]  # two reach it exactly


def test_equal_groups_in_another_member_order_tie():
    """Two groups with the same returns in another order: their stds can differ in the last bit; they still tie."""
    row = [0.3, -0.1, 0.3, 0.1, -0.1]
    perms = torch.tensor(sorted(set(itertools.permutations(row))), dtype=torch.float64)  # (P, 5)
    std = group_stat(perms)  # (P,)
    low, high = perms[std.argmin()], perms[std.argmax()]
    assert std.max() > std.min()  # the bits differ: without rounding, the later group would win
    scores = torch.stack([low, high])  # (2, 5)
    assert select_groups(group_stat(scores), "top_k_abs", 1) == [0]
    assert select_groups(group_stat(scores.flip(0)), "top_k_abs", 1) == [0]
    assert filter_groups(scores, 0.5).tolist() == [0]


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0, 0.3, 0.29])
def test_top_k_matches_filter_groups(ratio):
    """The v1 filter is select_groups' top_k with include_zero on: same groups on random, tie-heavy score sets."""
    rng = random.Random(int(ratio * 1000))
    for _ in range(300):
        G, n = rng.randint(1, 16), rng.randint(1, 8)
        values = rng.choice([[0.0, 1.0], [0.0, 0.1, 1.0], [0.5], [-0.1, 0.0, 0.2, 0.7, 1.0]])
        s = torch.tensor([[rng.choice(values) for _ in range(n)] for _ in range(G)], dtype=torch.float64)  # (G, n)
        if rng.random() < 0.3:  # some groups repeat another's returns in a shuffled order
            for g in range(1, G):
                if rng.random() < 0.5:
                    s[g] = s[rng.randrange(g)][torch.randperm(n)]
        kept = torch.tensor(select_groups(group_stat(s), "top_k", ratio, include_zero=True), dtype=torch.long)
        assert torch.equal(kept, filter_groups(s, ratio)), (s, ratio)


def test_top_k_counts_like_filter_groups_not_like_int():
    """0.29 * 100 is 28.999999999999996 in floats: RAGEN's int() keeps 28, filter_groups and select_groups 29."""
    stat = [float(g) for g in range(1, 101)]
    assert len(select_groups(stat, "top_k", 0.29)) == 29
    assert select_groups(stat, "top_k", 0.29) == list(range(71, 100))


def test_top_k_counts_all_groups_but_keeps_only_live_ones():
    """k = int(value * G) over ALL G groups, then at most the non-zero ones (include_zero off can under-fill)."""
    assert select_groups([0.3, 0, 0, 0.2, 0.1, 0, 0, 0], "top_k", 0.5, include_zero=False) == [0, 3, 4]
    assert select_groups([0.3, 0, 0, 0.2, 0.1, 0, 0, 0], "top_k", 0.5, include_zero=True) == [0, 1, 3, 4]
    assert select_groups([0.3, 0, 0.2], "top_k_abs", 5) == [0, 2]


def test_select_groups_edge_cases():
    assert select_groups([], "top_p", 0.9) == []
    assert select_groups([], "none") == []
    assert select_groups([1e-11, 2.0], "top_p", 1.0) == [1]  # |stat| <= 1e-10 counts as zero
    assert select_groups([0.2], "top_p", 0.9) == [0]
    assert select_groups([0.005], "top_p", 0.9) == []  # a lone group below the eps floor
    assert select_groups([0.005], "top_p", 0.9, eps=0.0) == [0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strategy="top_q"), "strategy"),
        (dict(prob_mode="cubic"), "prob_mode"),
        (dict(strategy="top_p", value=0.0), r"\(0, 1\]"),
        (dict(strategy="top_p", value=1.5), r"\(0, 1\]"),
        (dict(strategy="top_k", value=2.0), r"\(0, 1\]"),
        (dict(strategy="min_p", value=-0.1), r"\(0, 1\]"),
        (dict(strategy="top_k_abs", value=0.5), ">= 1"),
    ],
)
def test_select_groups_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_groups([0.1, 0.2], **kwargs)


def test_filter_loss_scale():
    assert filter_loss_scale(3, 8, "none") == 1.0
    assert filter_loss_scale(3, 8, "linear") == 0.375  # example 1: 3 of 8 groups kept
    assert filter_loss_scale(3, 8, "sqrt") == pytest.approx(0.6124, abs=1e-4)
    assert filter_loss_scale(0, 8, "sqrt") == 0.0
    assert filter_loss_scale(8, 8, "linear") == 1.0
    with pytest.raises(ValueError, match="scaling"):
        filter_loss_scale(3, 8, "log")
    with pytest.raises(ValueError, match="kept"):
        filter_loss_scale(9, 8, "linear")


########################################################################################################################
# pass@k
########################################################################################################################


@pytest.mark.parametrize(
    "n, c, expected",
    [
        (16, 2, {1: 0.1250, 2: 0.2417, 4: 0.4500, 8: 0.7667, 16: 1.0}),
        (8, 3, {1: 0.375, 2: 0.6429, 4: 0.9286, 8: 1.0}),
        (16, 0, {1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0, 16: 0.0}),
        (16, 16, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}),
        (8, 8, {1: 1.0, 8: 1.0}),
    ],
)
def test_pass_at_k_worked(n, c, expected):
    for k, p in expected.items():
        assert pass_at_k(n, c, k) == pytest.approx(p, abs=1e-4)


def test_pass_at_k_is_the_chance_that_k_draws_hold_a_success():
    """Against counting: the share of k-subsets of n samples that contain at least one of the c successes."""
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                share = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(share, abs=1e-12)
    assert pass_at_k(16, 2, 1) == 2 / 16  # pass@1 is the success rate


@pytest.mark.parametrize("n, c, k", [(8, 9, 1), (8, -1, 1), (8, 2, 0), (8, 2, 9)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
