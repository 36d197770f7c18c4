"""Tests for RAGEN-2's maths in common.py (the rollout filter, pass@k, the collapse diagnostics, bi-level GAE) and
the cross-scoring pass in plumbing/forward.py.

The worked examples are those of the spec (RAGEN2-SPEC.md §A1.4, §A1.9, §A2.5, §A3.1, §A3.2), each recomputed by
hand from RAGEN's code; the filter is also checked against the v1 filter it generalises (filter_groups), the
diagnostics on matrices whose answer is known (a reasoning that ignores its prompt, one that copies it, noise), and
cross_logprobs against one plain forward pass per (prompt, reasoning) pair on a tiny random model.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from common import (
    bi_level_gae,
    collapse_metrics,
    filter_loss_scale,
    group_stat,
    masked_whiten,
    pass_at_k,
    select_groups,
)

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


def filter_groups(scores: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """The v1 StarPO-S filter as it shipped until select_groups replaced it (common.py at 62c6e3d), kept as the
    reference `--algo starpo-s` must still reproduce: the top keep_ratio of groups by reward std, at least one, ties
    to the lower index on stds rounded to 9 decimals."""
    G, n = scores.shape
    std = scores.double().std(dim=1, unbiased=True).tolist() if n > 1 else [0.0] * G
    std = [round(x, 9) for x in std]
    k = max(1, int(G * keep_ratio + 1e-9))
    ranked = sorted(range(G), key=lambda g: (-std[g], g))
    return torch.tensor(sorted(ranked[:k]), dtype=torch.long)


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


########################################################################################################################
# the collapse diagnostics
########################################################################################################################

# §A2.5: N = 2 prompts, 4 reasonings (z1, z2 from x1; z3, z4 from x2), per-token mean log-probs.
A25 = torch.tensor([[-1.0, -3.0], [-1.2, -1.4], [-2.5, -0.8], [-1.1, -1.0]], dtype=torch.float64)
A25_COLS = [0, 0, 1, 1]
KEYS = {
    "mi_estimate", "mi_seq_estimate", "mi_upper_bound", "conditional_entropy_est", "reasoning_entropy_est",
    "conditional_entropy_seq_est", "reasoning_entropy_seq_est", "matched_log_prob_mean", "marginal_log_prob_mean",
    "retrieval_accuracy", "retrieval_chance_level", "retrieval_above_chance",
    "marginal_std", "mi_zscore", "marginal_std_ema", "mi_zscore_ema",
    "marginal_std_seq", "mi_zscore_seq", "marginal_std_ema_seq", "mi_zscore_ema_seq",
}  # fmt: skip
KEYS |= {f"retrieval_{m}@{k}" for m in ("accuracy", "chance_level", "above_chance") for k in (2, 4, 8)}


def test_collapse_metrics_worked_example():
    ema = {"marginal_std": 0.5, "marginal_std_seq": 0.5}
    m = collapse_metrics(A25, A25 * 10, A25_COLS, ema=ema)
    assert set(m) == KEYS
    marginal = [-1.5662, -1.2950, -1.3254, -1.0488]
    assert m["matched_log_prob_mean"] == pytest.approx(-1.0, abs=1e-9)
    assert m["marginal_log_prob_mean"] == pytest.approx(sum(marginal) / 4, abs=1e-4)
    assert m["mi_estimate"] == pytest.approx(0.3088, abs=1e-4)
    assert m["mi_upper_bound"] == pytest.approx(math.log(2))
    assert m["conditional_entropy_est"] == pytest.approx(1.0, abs=1e-9)
    assert m["reasoning_entropy_est"] == pytest.approx(1.3088, abs=1e-4)
    assert (m["retrieval_accuracy"], m["retrieval_chance_level"], m["retrieval_above_chance"]) == (1.0, 0.5, 0.5)
    assert (m["retrieval_accuracy@2"], m["retrieval_chance_level@2"]) == (1.0, 1.0)
    assert (m["retrieval_accuracy@8"], m["retrieval_chance_level@8"]) == (1.0, 1.0)  # k_eff = N = 2
    assert m["marginal_std"] == pytest.approx(0.1833, abs=1e-4)
    assert m["mi_zscore"] == pytest.approx(1.676, abs=1e-3)
    assert m["marginal_std_ema"] == pytest.approx(0.9 * 0.5 + 0.1 * 0.1833, abs=1e-4)  # 0.4683
    assert m["mi_zscore_ema"] == pytest.approx(0.658, abs=1e-3)
    assert ema["marginal_std"] == m["marginal_std_ema"]  # updated in place
    # the sums: every number ten times larger (the marginal's logsumexp is not linear, so recompute it)
    seq_marginal = torch.logsumexp(A25 * 10, 1) - math.log(2)
    matched = torch.tensor([-10.0, -12.0, -8.0, -10.0], dtype=torch.float64)
    assert m["mi_seq_estimate"] == pytest.approx((matched - seq_marginal).mean().item(), abs=1e-9)
    assert m["conditional_entropy_seq_est"] == pytest.approx(10.0, abs=1e-9)
    assert m["reasoning_entropy_seq_est"] == pytest.approx(-seq_marginal.mean().item(), abs=1e-9)
    assert m["marginal_std_seq"] == pytest.approx(seq_marginal.std(unbiased=False).item(), abs=1e-9)
    s = m["marginal_std_seq"]
    assert m["mi_zscore_seq"] == pytest.approx(((matched - seq_marginal) / (s + 1e-3)).mean().item(), abs=1e-9)
    assert m["marginal_std_ema_seq"] == pytest.approx(0.45 + 0.1 * s, abs=1e-9)


def test_collapse_metrics_ema_starts_from_the_first_value_and_none_keeps_no_history():
    ema = {}
    first = collapse_metrics(A25, A25, A25_COLS, ema=ema)
    assert ema == {"marginal_std": first["marginal_std"], "marginal_std_seq": first["marginal_std_seq"]}
    assert first["marginal_std_ema"] == first["marginal_std"] and first["mi_zscore_ema"] == first["mi_zscore"]
    second = collapse_metrics(A25 * 2, A25 * 2, A25_COLS, ema=ema)
    assert second["marginal_std_ema"] == pytest.approx(0.9 * first["marginal_std"] + 0.1 * second["marginal_std"])
    fresh = collapse_metrics(A25 * 2, A25 * 2, A25_COLS)  # no state: the EMA is this step's value
    assert fresh["marginal_std_ema"] == fresh["marginal_std"]


def test_a_reasoning_that_ignores_its_prompt_carries_no_information():
    """Template collapse: each row scores the same under every prompt. MI is exactly 0; H(Z|X) is untouched.

    Argmax ties go to the first column (torch.argmax's rule), so retrieval here counts the rows whose prompt is
    column 0: with two of four, accuracy 0.5 = chance, but that is the tie rule, not a measurement.
    """
    L = torch.tensor([[-1.0, -1.0], [-1.2, -1.2], [-0.8, -0.8], [-1.0, -1.0]], dtype=torch.float64)
    m = collapse_metrics(L, L * 7, A25_COLS)
    assert m["mi_estimate"] == 0.0 and m["mi_seq_estimate"] == 0.0
    assert m["conditional_entropy_est"] == pytest.approx(1.0) and m["reasoning_entropy_est"] == pytest.approx(1.0)
    assert m["mi_zscore"] == 0.0 and m["mi_zscore_seq"] == 0.0
    assert m["retrieval_accuracy"] == 0.5  # rows 0 and 1 (true column 0) win the tie, rows 2 and 3 lose it
    m = collapse_metrics(L, L, [1, 1, 1, 1])
    assert m["retrieval_accuracy"] == 0.0  # every true column is 1, every tie goes to 0


def test_a_reasoning_that_copies_its_prompt_is_retrieved_and_near_log_n():
    """Each reasoning is near-certain under its own prompt and near-impossible under the others: MI -> log N."""
    N, R = 6, 24
    cols = [i % N for i in range(R)]
    L = torch.full((R, N), -30.0, dtype=torch.float64)  # (R, N)
    L[torch.arange(R), torch.tensor(cols)] = -0.01
    m = collapse_metrics(L, L * 20, cols)
    assert m["retrieval_accuracy"] == 1.0 and m["retrieval_chance_level"] == pytest.approx(1 / N)
    assert m["mi_estimate"] == pytest.approx(math.log(N), abs=1e-9)
    assert m["mi_seq_estimate"] == pytest.approx(math.log(N), abs=1e-9)
    assert m["retrieval_accuracy@2"] == 1.0 and m["retrieval_chance_level@2"] == pytest.approx(2 / N)
    assert m["retrieval_chance_level@4"] == pytest.approx(4 / N) and m["retrieval_chance_level@8"] == 1.0  # k_eff = 6
    assert m["retrieval_above_chance@4"] == pytest.approx(1 - 4 / N)


def test_noise_retrieves_at_chance():
    """i.i.d. noise: every column is equally likely to win, so accuracy@k is near k / N for every k."""
    g = torch.Generator().manual_seed(0)
    R, N = 20000, 5
    L = torch.randn(R, N, generator=g, dtype=torch.float64) - 2  # (R, N)
    cols = torch.randint(N, (R,), generator=g).tolist()
    m = collapse_metrics(L, L, cols)
    assert m["retrieval_accuracy"] == pytest.approx(1 / N, abs=0.015)
    assert m["retrieval_accuracy@2"] == pytest.approx(2 / N, abs=0.015)
    assert m["retrieval_accuracy@4"] == pytest.approx(4 / N, abs=0.015)
    assert m["retrieval_accuracy@8"] == 1.0 and m["retrieval_chance_level@8"] == 1.0  # k_eff = N = 5: every column
    # No information, and the estimate reads below 0: the row's log-mean-exp over columns exceeds its mean (Jensen),
    # the finite-sample downward bias the spec's reference doc names (the estimate "can be slightly negative").
    assert -0.5 < m["mi_estimate"] < 0


def test_retrieval_with_equal_prompts_counts_either_column():
    """Columns 0 and 2 hold the same prompt: a row of column 0 retrieved as column 2 is right."""
    L = torch.tensor([[-2.0, -3.0, -1.0], [-2.0, -1.0, -3.0], [-3.0, -1.0, -2.0]], dtype=torch.float64)
    m = collapse_metrics(L, L, [0, 1, 2], signatures=[(5, 6), (7,), (5, 6)])
    assert m["retrieval_accuracy"] == pytest.approx(2 / 3)  # row 0 picks column 2, its twin: right; row 2 misses
    assert m["retrieval_chance_level"] == pytest.approx((2 / 3 + 1 / 3 + 2 / 3) / 3)
    assert m["retrieval_chance_level@2"] == 1.0  # min(1, 5/9 * 2)
    assert m["retrieval_accuracy@2"] == 1.0
    plain = collapse_metrics(L, L, [0, 1, 2])
    assert plain["retrieval_accuracy"] == pytest.approx(1 / 3) and plain["retrieval_chance_level"] == pytest.approx(
        1 / 3
    )


def test_collapse_metrics_needs_two_prompts():
    assert collapse_metrics(A25[:, :1], A25[:, :1], [0, 0, 0, 0]) == {}
    assert collapse_metrics(A25[:0], A25[:0], []) == {}


########################################################################################################################
# bi-level GAE
########################################################################################################################


def test_bi_level_gae_ragen_worked_example():
    """RAGEN's own __main__: two turns of five tokens, ends at 4 and 9, each paying 1; gamma = lam = 1."""
    r = torch.tensor([[0, 0, 0, 0, 1, 0, 0, 0, 0, 1.0]])
    V = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]])
    mask = torch.ones(1, 10)
    adv, ret = bi_level_gae(r, V, mask, [[4, 9]], gamma=1.0, lam=1.0, high_gamma=0.95)
    assert adv[0].tolist() == pytest.approx([1.85, 1.75, 1.65, 1.55, 1.45, 0.40, 0.30, 0.20, 0.10, 0.00], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([1.95] * 5 + [1.0] * 5, abs=1e-6)
    white = masked_whiten(adv, mask)  # verl's (x - mean) / sqrt(var + 1e-8), unbiased var, as common's
    expected = [1.188, 1.060, 0.931, 0.803, 0.674, -0.674, -0.803, -0.931, -1.060, -1.188]
    assert white[0].tolist() == pytest.approx(expected, abs=1e-3)


def naive_bi_level(r, V, m, ends, gamma, lam, hg):
    """One row, plain Python floats: the spec's recursion read literally (high level, then low level)."""
    G, adv_h, nxt = {}, 0.0, 0.0
    for e in reversed(ends):
        adv_h = r[e] + hg * nxt - V[e] + hg * lam * adv_h
        G[e], nxt = adv_h + V[e], V[e]
    valid = [t for t in range(len(r)) if m[t]]
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    last = 0.0
    for i in reversed(range(len(valid))):
        t = valid[i]
        if t in G:
            last = G[t] - V[t]
        else:
            nv = V[valid[i + 1]] if i + 1 < len(valid) else 0.0
            last = r[t] + gamma * nv - V[t] + gamma * lam * last
        adv[t], ret[t] = last, last + V[t]
    return (adv, ret) if ends else ([0.0] * len(r), [0.0] * len(r))


def test_a_turn_that_earned_nothing_still_discounts():
    """r = [0,0,0,0,0, 0,0,0,0,1]: RAGEN would see one turn (A = 1 - V); with the ends given, high_gamma applies."""
    r = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0]])
    V = torch.zeros(1, 10)
    adv, ret = bi_level_gae(r, V, torch.ones(1, 10), [[4, 9]], high_gamma=0.95)
    assert adv[0].tolist() == pytest.approx([0.95] * 5 + [1.0] * 5)
    one_turn, _ = bi_level_gae(r, V, torch.ones(1, 10), [[9]], high_gamma=0.95)
    assert one_turn[0].tolist() == pytest.approx([1.0] * 10)  # RAGEN's reading of the same rewards


def test_bi_level_gae_rows_without_turns_and_padding():
    """Row 0: two turns with an observation (mask 0) between them and padding after; row 1: no turn at all."""
    r = torch.tensor([[0, 0, 0.5, 0, 0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    V = torch.tensor([[0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5, 9.0, 9.0], [0.1] * 9])
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]])
    adv, ret = bi_level_gae(r, V, mask, [[2, 6], []], gamma=1.0, lam=1.0, high_gamma=0.9)
    # high level: A_2 = 1 - 0.5 = 0.5, G_2 = 1.0; A_1 = 0.5 + 0.9 * 0.5 - 0.3 + 0.9 * 0.5 = 1.1, G_1 = 1.4
    assert adv[0].tolist() == pytest.approx([1.3, 1.2, 1.1, 0, 0, 0.6, 0.5, 0, 0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([1.4, 1.4, 1.4, 0, 0, 1.0, 1.0, 0, 0], abs=1e-6)
    assert adv[1].tolist() == [0.0] * 9 and ret[1].tolist() == [0.0] * 9


@pytest.mark.parametrize("gamma, lam, hg", [(1.0, 1.0, 0.95), (0.99, 0.95, 0.9), (0.9, 0.5, 1.0)])
def test_bi_level_gae_vs_naive(gamma, lam, hg):
    g = torch.Generator().manual_seed(7)
    B, T = 6, 20
    V = torch.randn(B, T, generator=g)  # (B, T)
    mask = (torch.rand(B, T, generator=g) < 0.7).float()  # (B, T)
    mask[:, -3:] = 0  # padding after the last turn
    turn_ends, r = [], torch.zeros(B, T)
    for b in range(B):
        valid = mask[b].nonzero()[:, 0].tolist()
        ends = sorted(random.Random(b).sample(valid, k=min(len(valid), b % 4)))  # rows with 0 to 3 turns
        if b == 5 and valid:
            ends = ends[:-1] + [valid[-3]] if ends else []  # masked-in tokens after the last turn end
        turn_ends.append(ends)
        for e in ends:
            r[b, e] = float(torch.randn(1, generator=g))
    r[3, turn_ends[3][0]] = 0.0  # a turn may earn exactly 0 and still be a turn
    adv, ret = bi_level_gae(r, V, mask, turn_ends, gamma, lam, hg)
    for b in range(B):
        a, R_ = naive_bi_level(r[b].tolist(), V[b].tolist(), mask[b].tolist(), turn_ends[b], gamma, lam, hg)
        assert adv[b].tolist() == pytest.approx(a, abs=1e-5) and ret[b].tolist() == pytest.approx(R_, abs=1e-5)


def test_bi_level_gae_rejects_bad_turn_ends():
    r, V, m = torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([[1, 1, 0, 1]])
    for ends in ([2], [3, 1], [1, 1]):
        with pytest.raises(ValueError, match="turn ends"):
            bi_level_gae(r, V, m, [ends])
    with pytest.raises(ValueError, match="rows"):
        bi_level_gae(r, V, m, [[1], [3]])


########################################################################################################################
# cross_logprobs: the shared-prefill pass against one full forward pass per (prompt, reasoning)
########################################################################################################################


def tiny_model(kind: str):
    """A random two-layer model built from its config (no download): hidden 32, vocabulary 64."""
    import transformers

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    if kind.startswith("qwen2"):  # "qwen2-eager": the attention that adds a float mask to its scores
        attention = "eager" if kind.endswith("eager") else "sdpa"
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes, attn_implementation=attention)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()


def naive_cross(model, prompts, thinks, temperature):
    """Each [prompt_j + think_i] in its own forward pass, no cache, no padding: the reference."""
    mean = torch.zeros(len(thinks), len(prompts), dtype=torch.float64)
    total = torch.zeros_like(mean)
    with torch.no_grad():
        for j, x in enumerate(prompts):
            for i, z in enumerate(thinks):
                logits = model(input_ids=torch.tensor([x + z])).logits[0].double() / temperature  # (P + L, V)
                logp = torch.log_softmax(logits[len(x) - 1 : -1], -1)  # (L, V): the positions that predict z
                picked = logp[torch.arange(len(z)), torch.tensor(z)]  # (L,)
                mean[i, j], total[i, j] = picked.mean(), picked.sum()
    return mean, total


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen2-eager"])
@pytest.mark.parametrize("max_tokens", [1024, 6, 1])
def test_cross_logprobs_matches_full_passes(kind, max_tokens):
    from plumbing.forward import cross_logprobs

    model = tiny_model(kind)
    rng = random.Random(1)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (5, 9, 1)]
    thinks = [[rng.randrange(64) for _ in range(n)] for n in (1, 4, 7, 2, 6)]  # R = 5 > batch_size = 2
    mean, total = cross_logprobs(model, prompts, thinks, temperature=0.7, max_tokens=max_tokens)
    ref_mean, ref_total = naive_cross(model, prompts, thinks, 0.7)
    assert mean.shape == total.shape == (5, 3) and mean.dtype == torch.float64
    assert torch.allclose(mean, ref_mean, atol=1e-5, rtol=0) and torch.allclose(total, ref_total, atol=1e-5, rtol=0)


def test_cross_logprobs_packs_the_reasonings_after_each_prompt():
    """No pass per (prompt, reasoning): one row per prompt, [x_j | z_0[:-1] | z_1[:-1] ...] (each reasoning's last
    token is only predicted), in as few passes as max_tokens (reasoning tokens a row) allows."""
    from plumbing.forward import cross_logprobs

    model, shapes = tiny_model("qwen2"), []
    model.base_model.register_forward_hook(
        lambda mod, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    prompts, thinks = [[1, 2, 3], [4, 5]], [[6, 7], [8], [9, 10, 11]]
    cross_logprobs(model, prompts, thinks)
    assert shapes == [(2, 3 + 1 + 0 + 2)]  # the prompts padded to 3, then 1, 0 and 2 fed tokens
    shapes.clear()
    cross_logprobs(model, prompts, thinks, max_tokens=2)  # [6, 7] and [8] fit two tokens; [9, 10, 11] goes alone
    assert shapes == [(2, 3 + 1), (2, 3 + 2)]
    shapes.clear()
    cross_logprobs(model, [[1, 2, 3]], [[6]])  # one-token reasonings need the prompt only
    assert shapes == [(1, 3)]


def test_cross_logprobs_rejects_empty_reasonings():
    from plumbing.forward import cross_logprobs

    with pytest.raises(ValueError, match="empty"):
        cross_logprobs(tiny_model("qwen2"), [[1, 2]], [[3], []])
