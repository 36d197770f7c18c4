"""Tests for the MATHS half of common.py.

Three kinds of check, all of veRL's semantics (verl.trainer.ppo.core_algos; tolerance 1e-5):
  * the hand-worked cases of §3, exactly;
  * each function against a naive plain-Python reference (loops over Python floats, math.exp / math.log),
    written here independently of common.py, on seeded random tensors of several shapes and masks;
  * edge cases (empty masks, ties, clamps, bad arguments) and two structural properties: micro-batch
    accumulation reproduces the mini-batch loss, and clipped tokens get no policy gradient.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import common
import plumbing.cpu
import plumbing.engine
import plumbing.flags
import plumbing.forward
import plumbing.tiny
from common import (
    agg_loss,
    entropy_from_logits,
    gae,
    group_stat,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    micro_batch_weight,
    policy_loss,
    select_groups,
    token_logprobs,
    value_loss,
)

TOL = 1e-5
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SHAPES = [(1, 1), (2, 3), (4, 7), (8, 16)]
MASK_KINDS = ["ones", "random", "empty_row", "lengths", "zeros"]


########################################################################################################################
# helpers
########################################################################################################################


def close(actual, expected, tol: float = TOL):
    """Compare a tensor / float with a (nested) list of Python floats at rtol = atol = tol."""
    a = actual.detach().double() if isinstance(actual, torch.Tensor) else torch.tensor(actual, dtype=torch.float64)
    e = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(a, e.reshape(a.shape), rtol=tol, atol=tol)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_mask(B: int, T: int, kind: str, seed: int) -> torch.Tensor:
    """(B, T) float 0/1 mask. 'empty_row' and 'lengths' always contain a fully masked row when B > 1."""
    g = gen(seed)
    if kind == "ones":
        return torch.ones(B, T)
    if kind == "zeros":
        return torch.zeros(B, T)
    if kind == "random":
        m = (torch.rand(B, T, generator=g) < 0.6).float()
        m[0, 0] = 1.0
        return m
    if kind == "empty_row":
        m = (torch.rand(B, T, generator=g) < 0.6).float()
        m[0, -1] = 1.0
        m[B - 1] = 0.0 if B > 1 else m[B - 1]
        return m
    if kind == "lengths":  # right-padded rows of varying length, with one empty row (response of length 0)
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        if B > 1:
            lengths[B // 2] = 0
        return (torch.arange(T)[None, :] < lengths[:, None]).float()
    raise AssertionError(kind)


# ---- plain-Python references (float64, loops, math.*) ----------------------------------------------------------------


def py_log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


def py_softmax(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [x / s for x in e]


def py_entropy(row):
    return -sum(p * math.log(p) for p in py_softmax(row) if p > 0)


def py_masked_mean(x, m):
    num = sum(xv * mv for xr, mr in zip(x, m) for xv, mv in zip(xr, mr))
    den = sum(mv for mr in m for mv in mr)
    return num / den if den > 0 else 0.0


def py_agg(L, M, mode):
    T = len(L[0])
    rows = []  # (row sum, row count) of rows with at least one token
    total, count = 0.0, 0.0
    for lr, mr in zip(L, M):
        s = sum(l * m for l, m in zip(lr, mr))
        c = sum(mr)
        total += s
        count += c
        if c > 0:
            rows.append((s, c))
    if mode == "token-mean":
        return total / count if count > 0 else 0.0
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in rows) / len(rows) if rows else 0.0
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in rows) / len(rows) if rows else 0.0
    if mode == "seq-mean-token-sum-norm":
        return total / T
    raise AssertionError(mode)


def py_group_advantages(S, norm_std=True, eps=1e-6):
    out = []
    for row in S:
        n = len(row)
        mean = sum(row) / n
        if not norm_std:
            out.append([s - mean for s in row])
        elif n < 2:
            out.append([0.0] * n)
        else:
            std = math.sqrt(sum((s - mean) ** 2 for s in row) / (n - 1))
            out.append([(s - mean) / (std + eps) for s in row])
    return out


def py_gae(R, V, M, gamma, lam):
    A_all, Ret_all = [], []
    for r, v, m in zip(R, V, M):
        T = len(r)
        A = [0.0] * T
        next_value, last_gae = 0.0, 0.0
        for t in range(T - 1, -1, -1):
            delta = r[t] + gamma * next_value - v[t]
            g = delta + gamma * lam * last_gae
            if m[t] == 1:
                next_value = v[t]
                last_gae = g
            A[t] = last_gae
        A_all.append(A)
        Ret_all.append([a + vv for a, vv in zip(A, v)])
    return A_all, Ret_all


def py_whiten(X, M, eps=1e-8):
    vals = [x for xr, mr in zip(X, M) for x, m in zip(xr, mr) if m == 1]
    if not vals:
        return [[0.0] * len(xr) for xr in X]
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return [[(x - mean) if m == 1 else 0.0 for x, m in zip(xr, mr)] for xr, mr in zip(X, M)]
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    scale = 1.0 / math.sqrt(var + eps)
    return [[(x - mean) * scale if m == 1 else 0.0 for x, m in zip(xr, mr)] for xr, mr in zip(X, M)]


def filter_groups(S, keep_ratio, mode="std"):
    """StarPO-S's filter as the scripts call it: common.select_groups' top_k over the groups' reward std (ddof 1),
    zero-std groups allowed, as a tensor of ascending group indices. (These tests predate select_groups.)"""
    if mode != "std":
        raise ValueError(f"unknown filter mode {mode!r}")
    return torch.tensor(select_groups(group_stat(S), "top_k", keep_ratio, include_zero=True), dtype=torch.long)


def py_filter_groups(S, keep_ratio, mode):
    G = len(S)
    stds = [statistics.stdev(row) if len(row) > 1 else 0.0 for row in S]
    k = max(1, int(Fraction(repr(keep_ratio)) * G))  # exact decimal arithmetic: 0.29 * 100 = 29
    if mode == "std":
        order = sorted(range(G), key=lambda g: (-stds[g], g))
    else:
        order = sorted(range(G), key=lambda g: (stds[g], g))
    return sorted(order[:k])


def py_pg_token(lp, old, a, clip_low, clip_high, dual_clip):
    """Per-token (loss, clipped?, clipped_lower?, -log_ratio)."""
    lr = min(max(lp - old, -20.0), 20.0)
    rho = math.exp(lr)
    l1 = -a * rho
    l2 = -a * min(max(rho, 1 - clip_low), 1 + clip_high)
    lc = max(l1, l2)
    lower = False
    if dual_clip is not None and a < 0:
        l3 = -a * dual_clip
        lower = lc > l3
        lc = min(lc, l3)
    return lc, l2 > l1, lower, -lr


def py_policy_loss(LP, OLD, A, M, clip_low, clip_high, dual_clip, agg):
    L, CF, CFL, KL = [], [], [], []
    for lpr, oldr, ar in zip(LP, OLD, A):
        row = [py_pg_token(lp, o, a, clip_low, clip_high, dual_clip) for lp, o, a in zip(lpr, oldr, ar)]
        L.append([x[0] for x in row])
        CF.append([float(x[1]) for x in row])
        CFL.append([float(x[2]) for x in row])
        KL.append([x[3] for x in row])
    return py_agg(L, M, agg), py_masked_mean(CF, M), py_masked_mean(CFL, M), py_masked_mean(KL, M)


def py_value_loss(Vn, Vo, R, M, clip, agg):
    L, CF = [], []
    for vr, vor, rr in zip(Vn, Vo, R):
        lrow, crow = [], []
        for v, vo, r in zip(vr, vor, rr):
            vc = min(max(v, vo - clip), vo + clip)
            e, ec = (v - r) ** 2, (vc - r) ** 2
            lrow.append(max(e, ec))
            crow.append(float(ec > e))
        L.append(lrow)
        CF.append(crow)
    return 0.5 * py_agg(L, M, agg), py_masked_mean(CF, M)


def py_kl(lp, ref, kind):
    if kind == "k1":
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    x = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


########################################################################################################################
# 1. worked cases, computed by hand
########################################################################################################################


def test_worked_grpo_unbiased_std():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    close(adv, [[0.8660239, -0.8660239, -0.8660239, 0.8660239]])
    assert torch.tensor([1.0, 0.0, 0.0, 1.0]).std(unbiased=True).item() == pytest.approx(0.5773503, abs=TOL)


def test_worked_grpo_all_equal_gives_zeros():
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    assert not torch.isnan(adv).any()
    close(adv, [[0.0, 0.0, 0.0, 0.0]])


def test_worked_dr_grpo():
    close(group_advantages(torch.tensor([[2.0, 0.0, 1.0]]), norm_std=False), [[1.0, -1.0, 0.0]])


def test_worked_gae_single_turn():
    A, R = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(A, [[0.5, 0.4, 0.3]])
    close(R, [[1.0, 1.0, 1.0]])


def test_worked_gae_multi_turn_mask():
    A, _ = gae(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
        torch.tensor([[0.2, 9.9, 0.4, 0.5]]),
        torch.tensor([[1.0, 0.0, 1.0, 1.0]]),
        gamma=1.0,
        lam=1.0,
    )
    close(A, [[0.8, 0.6, 0.6, 0.5]])


WORKED_PG = [(1.0, 1.5, -1.28), (-1.0, 0.5, 0.8), (-1.0, 4.0, 3.0), (2.0, 0.9, -1.8)]  # (A, rho, per-token loss)


def _pg_case_tensors():
    adv = torch.tensor([[a for a, _, _ in WORKED_PG]])
    old = torch.tensor([[-1.0, -2.0, -3.0, -0.5]])
    logp = old + torch.log(torch.tensor([[r for _, r, _ in WORKED_PG]]))
    return logp, old, adv


def test_worked_policy_loss_batch():
    logp, old, adv = _pg_case_tensors()
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx(0.18, abs=TOL)
    assert m["pg_loss"] == pytest.approx(0.18, abs=TOL)
    assert m["pg_clipfrac"] == pytest.approx(0.5, abs=TOL)
    assert m["pg_clipfrac_lower"] == pytest.approx(0.25, abs=TOL)
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for _, r, _ in WORKED_PG) / 4, abs=TOL)


@pytest.mark.parametrize("a,rho,expected", WORKED_PG)
def test_worked_policy_loss_per_token(a, rho, expected):
    old = torch.tensor([[-1.3]])
    logp = old + math.log(rho)
    loss, _ = policy_loss(logp, old, torch.tensor([[a]]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx(expected, abs=TOL)


def test_worked_policy_loss_per_token_via_sum_mode():
    """seq-mean-token-sum on a (4, 1) batch gives the mean of the four per-token losses; on (1, 4) their sum."""
    logp, old, adv = _pg_case_tensors()
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-sum")
    loss_rows, _ = policy_loss(logp.T, old.T, adv.T, torch.ones(4, 1), **kw)
    loss_one, _ = policy_loss(logp, old, adv, torch.ones(1, 4), **kw)
    assert loss_rows.item() == pytest.approx(0.18, abs=TOL)
    assert loss_one.item() == pytest.approx(0.72, abs=TOL)
    # masking all but one token isolates that token's loss
    for i, (_, _, expected) in enumerate(WORKED_PG):
        mask = torch.zeros(1, 4)
        mask[0, i] = 1
        loss_i, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        assert loss_i.item() == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 2.5),
        ("seq-mean-token-sum", 5.0),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum-norm", 3.333333),
    ],
)
def test_worked_agg(mode, expected):
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(L, m, mode).item() == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("kind,expected", [("k1", 0.6931472), ("abs", 0.6931472), ("k2", 0.2402265), ("k3", 0.1931472)])
def test_worked_kl(kind, expected):
    kl = kl_penalty(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), kind)
    assert kl.item() == pytest.approx(expected, abs=TOL)


def test_worked_kl_abs_symmetric_k1_signed():
    lp, ref = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-0.6931472, abs=TOL)
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(0.6931472, abs=TOL)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.2402265, abs=TOL)


def test_worked_entropy():
    assert entropy_from_logits(torch.tensor([0.0, math.log(3)])).item() == pytest.approx(0.5623351, abs=TOL)
    tempered = torch.tensor([0.0, 2 * math.log(3)]) / 2.0
    assert entropy_from_logits(tempered).item() == pytest.approx(0.5623351, abs=TOL)
    # without dividing by the temperature the answer is different (the classic trap: the ratio is then not 1 on-policy)
    assert entropy_from_logits(torch.tensor([0.0, 2 * math.log(3)])).item() != pytest.approx(0.5623351, abs=1e-3)


########################################################################################################################
# 2. against the plain-Python references on seeded random data
########################################################################################################################


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 3, 5), (3, 4, 11)])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_token_logprobs_vs_python(shape, temperature):
    B, T, V = shape
    g = gen(100 + B * 10 + T)
    logits = torch.randn(B, T, V, generator=g) * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    out = token_logprobs(logits, tokens, temperature)
    assert out.shape == (B, T)
    L, tok = logits.tolist(), tokens.tolist()
    expected = [[py_log_softmax([v / temperature for v in L[b][t]])[tok[b][t]] for t in range(T)] for b in range(B)]
    close(out, expected)


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 4), (2, 2, 2, 33)])
def test_entropy_vs_python(shape):
    g = gen(200 + len(shape))
    logits = torch.randn(*shape, generator=g) * 2
    out = entropy_from_logits(logits)
    assert out.shape == shape[:-1]
    flat = logits.reshape(-1, shape[-1]).tolist()
    close(out.reshape(-1), [py_entropy(r) for r in flat])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masked_mean_vs_python(shape, kind):
    x = torch.randn(*shape, generator=gen(300))
    m = make_mask(*shape, kind, seed=301)
    out = masked_mean(x, m)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(py_masked_mean(x.tolist(), m.tolist()), abs=TOL, rel=TOL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_vs_python(shape, kind, mode):
    L = torch.randn(*shape, generator=gen(400 + shape[1])) * 2
    m = make_mask(*shape, kind, seed=401 + shape[0])
    out = agg_loss(L, m, mode)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(py_agg(L.tolist(), m.tolist(), mode), abs=TOL, rel=TOL)


@pytest.mark.parametrize("G,n", [(1, 2), (3, 4), (5, 3), (8, 16), (2, 1)])
@pytest.mark.parametrize("norm_std", [True, False])
def test_group_advantages_vs_python(G, n, norm_std):
    S = torch.randn(G, n, generator=gen(500 + G * n))
    out = group_advantages(S, norm_std=norm_std)
    assert out.shape == (G, n)
    assert torch.isfinite(out).all()
    close(out, py_group_advantages(S.tolist(), norm_std=norm_std))


def test_group_advantages_binary_rewards_vs_python():
    """0/1 rewards (the common case): many ties, some all-equal groups."""
    S = (torch.rand(16, 8, generator=gen(510)) < 0.3).float()
    S[3] = 0.0
    S[7] = 1.0
    close(group_advantages(S), py_group_advantages(S.tolist()))


def test_turn_group_advantages_hand_worked():
    """Rewards per turn [[0, 1], [0], [1, 0, 0]], gamma 1: returns-to-go [[1, 1], [0], [1, 0, 0]]. Turn 0: all three
    (1, 0, 1), mean 2/3, std sqrt(1/3); turn 1: members 0 and 2 (1, 0), mean 1/2, std sqrt(1/2); turn 2: member 2
    alone, no baseline, 0."""
    a, b = (1 / 3) / math.sqrt(1 / 3), 0.5 / math.sqrt(0.5)
    out = common.turn_group_advantages([[0.0, 1.0], [0.0], [1.0, 0.0, 0.0]])
    close([x for row in out for x in row], [a, b, -2 * a, a, -b, 0.0])
    dr = common.turn_group_advantages([[0.0, 1.0], [0.0], [1.0, 0.0, 0.0]], norm_std=False)  # Dr. GRPO: G - mean
    close([x for row in dr for x in row], [1 / 3, 0.5, -2 / 3, 1 / 3, -0.5, 0.0])


def test_turn_group_advantages_discount():
    """gamma 0.5: [[1, 2], [0, 0]] has returns-to-go [[2, 2], [0, 0]]; gamma 0 leaves each turn its own reward
    [[1, 2], [0, 0]]: the same signs, other turn-0 margins."""
    g5 = common.turn_group_advantages([[1.0, 2.0], [0.0, 0.0]], gamma=0.5, norm_std=False)
    g0 = common.turn_group_advantages([[1.0, 2.0], [0.0, 0.0]], gamma=0.0, norm_std=False)
    close([x for row in g5 for x in row], [1.0, 1.0, -1.0, -1.0])
    close([x for row in g0 for x in row], [0.5, 1.0, -0.5, -1.0])


@pytest.mark.parametrize("n", [2, 3, 8])
def test_turn_group_advantages_one_turn_is_group_advantages(n):
    """Episodes of one turn: turn-level GRPO is trajectory-level GRPO."""
    S = torch.randn(1, n, generator=gen(520 + n))
    out = common.turn_group_advantages([[x] for x in S[0].tolist()])
    close([row[0] for row in out], group_advantages(S)[0].tolist())


def test_turn_group_advantages_no_signal_is_zero_never_nan():
    """Equal returns at a turn, a lone member, no members, empty episodes: zeros of the right shapes."""
    assert common.turn_group_advantages([[0.1, 1.0], [0.1, 1.0]]) == [[0.0, 0.0], [0.0, 0.0]]
    assert common.turn_group_advantages([[1.0]]) == [[0.0]]
    assert common.turn_group_advantages([]) == []
    out = common.turn_group_advantages([[], [1.0], [0.0, 2.0]])
    assert [len(r) for r in out] == [0, 1, 2] and out[2][1] == 0.0  # turn 1: member 2 alone
    assert out[1][0] == -out[2][0] != 0.0  # turn 0: returns 1 and 2


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (3, 6), (4, 12)])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 1.0), (1.0, 0.0)])
def test_gae_vs_python(shape, kind, gamma, lam):
    g = gen(600 + shape[1])
    r = torch.randn(*shape, generator=g)
    v = torch.randn(*shape, generator=g)
    m = make_mask(*shape, kind, seed=601)
    A, R = gae(r, v, m, gamma=gamma, lam=lam)
    A_ref, R_ref = py_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    close(A, A_ref)
    close(R, R_ref)


def test_gae_multi_turn_random_vs_python():
    """Two turns separated by observation tokens (mask 0) and right padding, sparse terminal reward."""
    B, T = 5, 14
    g = gen(610)
    m = torch.zeros(B, T)
    r = torch.zeros(B, T)
    for b in range(B):
        m[b, 0:3] = 1
        m[b, 6 : 9 + b % 3] = 1
        r[b, 8 + b % 3] = float(b) - 1.5
        r[b, 2] = -0.1
    v = torch.randn(B, T, generator=g)
    A, R = gae(r, v, m, gamma=0.97, lam=0.9)
    A_ref, R_ref = py_gae(r.tolist(), v.tolist(), m.tolist(), 0.97, 0.9)
    close(A, A_ref)
    close(R, R_ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masked_whiten_vs_python(shape, kind):
    x = torch.randn(*shape, generator=gen(700)) * 3 + 1
    m = make_mask(*shape, kind, seed=701)
    out = masked_whiten(x, m)
    assert torch.isfinite(out).all()
    close(out, py_whiten(x.tolist(), m.tolist()))


@pytest.mark.parametrize("G,n", [(1, 4), (4, 2), (10, 4), (25, 8), (7, 1)])
@pytest.mark.parametrize("keep_ratio", [0.01, 0.25, 0.29, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("mode", ["std"])
@pytest.mark.parametrize("discrete", [False, True])
def test_filter_groups_vs_python(G, n, keep_ratio, mode, discrete):
    g = gen(800 + G * n)
    if discrete:  # small-integer rewards: many exactly tied stds, exercises the tie-break
        S = torch.randint(0, 3, (G, n), generator=g).float()
    else:
        S = torch.randn(G, n, generator=g)
    out = filter_groups(S, keep_ratio, mode)
    assert out.dtype == torch.long
    assert out.tolist() == py_filter_groups(S.tolist(), keep_ratio, mode)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["ones", "random", "empty_row", "lengths"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clips", [(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.1, 0.3, 2.0)])
def test_policy_loss_vs_python(shape, kind, mode, clips):
    clip_low, clip_high, dual = clips
    g = gen(900 + shape[0] * shape[1])
    logp = -torch.rand(*shape, generator=g) * 5
    old = logp + torch.randn(*shape, generator=g) * 0.4
    adv = torch.randn(*shape, generator=g)
    if shape[1] > 3:  # a few exploded ratios that hit the +-20 log-ratio clamp
        old[0, 1] = logp[0, 1] - 30.0
        old[-1, 2] = logp[-1, 2] + 30.0
    m = make_mask(*shape, kind, seed=901)
    loss, met = policy_loss(logp, old, adv, m, clip_low=clip_low, clip_high=clip_high, dual_clip=dual, agg=mode)
    ref_loss, ref_cf, ref_cfl, ref_kl = py_policy_loss(
        logp.tolist(), old.tolist(), adv.tolist(), m.tolist(), clip_low, clip_high, dual, mode
    )
    assert loss.item() == pytest.approx(ref_loss, rel=TOL, abs=TOL)
    assert met["pg_loss"] == pytest.approx(ref_loss, rel=TOL, abs=TOL)
    assert met["pg_clipfrac"] == pytest.approx(ref_cf, abs=TOL)
    assert met["pg_clipfrac_lower"] == pytest.approx(ref_cfl, abs=TOL)
    assert met["ppo_kl"] == pytest.approx(ref_kl, rel=TOL, abs=TOL)


def test_policy_loss_dual_clip_on_vs_off():
    """Dual clip only changes tokens with A < 0 and a large ratio, and caps them at -A * c."""
    g = gen(950)
    logp = -torch.rand(4, 8, generator=g) * 3
    old = logp - torch.rand(4, 8, generator=g) * 2.5  # ratios in [1, e^2.5 ~ 12]
    adv = torch.randn(4, 8, generator=g)
    m = torch.ones(4, 8)
    off, m_off = policy_loss(logp, old, adv, m, 0.2, 0.28, None, "seq-mean-token-sum")
    on, m_on = policy_loss(logp, old, adv, m, 0.2, 0.28, 3.0, "seq-mean-token-sum")
    assert m_off["pg_clipfrac_lower"] == 0.0
    assert m_on["pg_clipfrac_lower"] > 0.0
    assert on.item() < off.item()
    for dual in (None, 3.0):
        ref, _, ref_cfl, _ = py_policy_loss(
            logp.tolist(), old.tolist(), adv.tolist(), m.tolist(), 0.2, 0.28, dual, "seq-mean-token-sum"
        )
        got, met = policy_loss(logp, old, adv, m, 0.2, 0.28, dual, "seq-mean-token-sum")
        assert got.item() == pytest.approx(ref, rel=TOL, abs=TOL)
        assert met["pg_clipfrac_lower"] == pytest.approx(ref_cfl, abs=TOL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["ones", "random", "empty_row", "lengths"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [0.5, 0.1])
def test_value_loss_vs_python(shape, kind, mode, clip):
    g = gen(1000 + shape[1])
    vo = torch.randn(*shape, generator=g)
    vn = vo + torch.randn(*shape, generator=g) * 0.8
    R = torch.randn(*shape, generator=g)
    m = make_mask(*shape, kind, seed=1001)
    loss, met = value_loss(vn, vo, R, m, clip=clip, agg=mode)
    ref_loss, ref_cf = py_value_loss(vn.tolist(), vo.tolist(), R.tolist(), m.tolist(), clip, mode)
    assert loss.item() == pytest.approx(ref_loss, rel=TOL, abs=TOL)
    assert met["vf_loss"] == pytest.approx(ref_loss, rel=TOL, abs=TOL)
    assert met["vf_clipfrac"] == pytest.approx(ref_cf, abs=TOL)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (6, 9)])
def test_kl_penalty_vs_python(kind, shape):
    g = gen(1100 + shape[1])
    lp = -torch.rand(*shape, generator=g) * 6
    ref = lp + torch.randn(*shape, generator=g) * 1.5
    if shape[1] > 2:
        ref[0, 0] = lp[0, 0] + 40.0  # hits the x clamp and the k3 clamp
        ref[-1, 1] = lp[-1, 1] - 40.0
    out = kl_penalty(lp, ref, kind)
    assert out.shape == shape
    LP, RF = lp.tolist(), ref.tolist()
    close(out, [[py_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(LP, RF)])


########################################################################################################################
# 3. edge cases
########################################################################################################################


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_fully_masked_row_is_ignored(mode):
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [1e6, -3e5, 7e4]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    out = agg_loss(L, m, mode)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(agg_loss(L[:2], m[:2], mode).item(), abs=TOL)
    assert out.item() == pytest.approx(py_agg(L[:2].tolist(), m[:2].tolist(), mode), abs=TOL)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_all_zero_mask_gives_zero(mode):
    L = torch.randn(3, 4, generator=gen(1200))
    out = agg_loss(L, torch.zeros(3, 4), mode)
    assert not torch.isnan(out)
    assert out.item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_accepts_bool_mask(mode):
    L = torch.randn(3, 4, generator=gen(1201))
    m = make_mask(3, 4, "empty_row", seed=1202)
    assert agg_loss(L, m.bool(), mode).item() == pytest.approx(agg_loss(L, m, mode).item(), abs=TOL)


def test_agg_loss_token_mean_vs_seq_mean_differ_on_unequal_lengths():
    L = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert agg_loss(L, m, "token-mean").item() == pytest.approx(9 / 5)
    assert agg_loss(L, m, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_masked_mean_empty_mask_is_zero_not_nan():
    out = masked_mean(torch.tensor([[1.0, float("1e30")]]), torch.zeros(1, 2))
    assert out.item() == 0.0


@pytest.mark.parametrize("norm_std", [True, False])
def test_group_advantages_group_size_one(norm_std):
    out = group_advantages(torch.tensor([[0.3], [1.0], [-2.0]]), norm_std=norm_std)
    assert not torch.isnan(out).any()
    assert out.tolist() == [[0.0], [0.0], [0.0]]


@pytest.mark.parametrize("value", [0.0, 1.0, -1.0, 0.5, 0.15, 0.1, 0.3, 10.0 / 3])
@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
def test_group_advantages_all_equal_any_value_gives_zeros(value, n):
    """A group whose scores are all equal gives 0, never NaN -- for any score, including the
    bandit's low-risk payouts 0.1 and 0.15 and the -0.1 format penalty, not only for dyadic values like 1.0."""
    S = torch.full((2, n), value)
    S[1] = torch.linspace(0, 1, n)  # a normal group alongside must not matter
    out = group_advantages(S)
    assert not torch.isnan(out).any()
    close(out[0], [0.0] * n)


def test_group_advantages_groups_are_independent():
    S = torch.randn(4, 6, generator=gen(1300))
    full = group_advantages(S)
    for i in range(4):
        close(full[i], group_advantages(S[i : i + 1])[0].tolist())
    # shifting or scaling one group leaves the GRPO advantages unchanged
    S2 = S.clone()
    S2[2] = S2[2] * 4 + 7
    close(group_advantages(S2), full.tolist(), tol=1e-4)


def test_group_advantages_integer_scores():
    close(group_advantages(torch.tensor([[1, 0, 0, 1]])), [[0.8660239, -0.8660239, -0.8660239, 0.8660239]])


def test_filter_groups_keeps_at_least_one():
    S = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    assert filter_groups(S, 0.01, "std").tolist() == [0]


def test_filter_groups_ties_go_to_lower_index():
    S = torch.tensor([[1.0, 1.0], [0.0, 2.0], [2.0, 0.0], [3.0, 3.0], [5.0, 3.0], [0.0, 0.0]])
    # stds: 0, sqrt2, sqrt2, 0, sqrt2, 0
    assert filter_groups(S, 1 / 6, "std").tolist() == [1]
    assert filter_groups(S, 2 / 6, "std").tolist() == [1, 2]
    assert filter_groups(S, 0.5, "std").tolist() == [1, 2, 4]
    assert filter_groups(S, 4 / 6, "std").tolist() == [0, 1, 2, 4]
    for _ in range(3):  # deterministic
        assert filter_groups(S, 0.5, "std").tolist() == [1, 2, 4]
    # all groups tied: the first k
    assert filter_groups(torch.ones(8, 4), 0.25, "std").tolist() == [0, 1]


@pytest.mark.parametrize("mode", ["std"])
def test_filter_groups_keep_all(mode):
    S = torch.randn(9, 4, generator=gen(1400))
    assert filter_groups(S, 1.0, mode).tolist() == list(range(9))


def test_filter_groups_std_picks_high():
    S = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 10.0, 0.0, 10.0], [0.0, 1.0, 0.0, 1.0], [0.0, 5.0, 5.0, 0.0]])
    assert filter_groups(S, 0.5, "std").tolist() == [1, 3]


def test_filter_groups_float_floor_029_of_100_keeps_29():
    S = torch.randn(100, 4, generator=gen(1401))
    assert len(filter_groups(S, 0.29, "std")) == 29
    assert len(filter_groups(S, 0.25, "std")) == 25
    out = filter_groups(S, 0.29, "std")
    assert out.tolist() == sorted(set(out.tolist()))  # ascending, unique


@pytest.mark.parametrize("G", range(1, 41))
def test_filter_groups_count_matches_decimal_floor(G):
    S = torch.randn(G, 3, generator=gen(1402))
    for r in (0.1, 0.2, 0.25, 0.29, 0.3, 0.33, 0.57, 0.7, 0.9, 1.0):
        assert len(filter_groups(S, r, "std")) == max(1, int(Fraction(repr(r)) * G)), (G, r)


@pytest.mark.parametrize("keep_ratio", [0.0, -0.25, 1.0001, 2.0, float("nan")])
def test_filter_groups_bad_keep_ratio_raises(keep_ratio):
    with pytest.raises(ValueError):
        filter_groups(torch.randn(4, 3, generator=gen(1403)), keep_ratio, "std")


def test_filter_groups_bad_mode_raises():
    with pytest.raises(ValueError):
        filter_groups(torch.randn(4, 3, generator=gen(1404)), 0.5, "variance")


@pytest.mark.parametrize("shape", [(3, 5), (6, 10)])
@pytest.mark.parametrize("kind", ["random", "empty_row", "lengths", "ones"])
def test_masked_whiten_moments(shape, kind):
    x = torch.randn(*shape, generator=gen(1500)) * 4 - 2
    m = make_mask(*shape, kind, seed=1501)
    out = masked_whiten(x, m)
    vals = [o for orow, mrow in zip(out.tolist(), m.tolist()) for o, mm in zip(orow, mrow) if mm == 1]
    assert len(vals) >= 2
    assert statistics.fmean(vals) == pytest.approx(0.0, abs=1e-5)
    assert statistics.variance(vals) == pytest.approx(1.0, abs=1e-4)  # unbiased variance
    assert (out[m == 0] == 0).all()


def test_masked_whiten_degenerate_masks():
    x = torch.tensor([[3.0, -1.0, 2.0]])
    out0 = masked_whiten(x, torch.zeros(1, 3))
    assert out0.tolist() == [[0.0, 0.0, 0.0]]
    out1 = masked_whiten(x, torch.tensor([[0.0, 1.0, 0.0]]))  # one token: centred, not scaled, no NaN
    assert out1.tolist() == [[0.0, 0.0, 0.0]]
    out2 = masked_whiten(torch.full((2, 3), 4.0), torch.ones(2, 3))  # zero variance: eps keeps it finite
    assert torch.isfinite(out2).all()
    close(out2, [[0.0] * 3] * 2)


def test_kl_k3_nonnegative_and_clamped():
    g = gen(1600)
    lp = -torch.rand(50, 20, generator=g) * 8
    ref = lp + torch.randn(50, 20, generator=g) * 3
    k3 = kl_penalty(lp, ref, "k3")
    # exp(x) - x - 1 >= 0 exactly; float32 rounding near x = 0 may give -ulp(1) ~ -6e-8
    assert (k3 >= -1e-6).all()
    assert (k3 <= 10.0).all()
    huge = kl_penalty(torch.tensor([[-100.0, 0.0, -1.0]]), torch.tensor([[0.0, -100.0, -1.0]]), "k3")
    assert huge.tolist()[0][:2] == [10.0, 10.0]
    assert huge.tolist()[0][2] == 0.0
    assert torch.isfinite(huge).all()


def test_kl_k3_at_equal_logps_is_zero():
    lp = -torch.rand(3, 4, generator=gen(1601)) * 5
    for kind in ("k1", "abs", "k2", "k3"):
        assert kl_penalty(lp, lp.clone(), kind).abs().max().item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_on_policy_ratio_one(mode):
    g = gen(1700)
    logp = -torch.rand(4, 6, generator=g) * 4
    adv = torch.randn(4, 6, generator=g)
    m = make_mask(4, 6, "empty_row", seed=1701)
    loss, met = policy_loss(logp, logp.clone(), adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=mode)
    assert loss.item() == pytest.approx(agg_loss(-adv, m, mode).item(), abs=TOL)
    assert met["ppo_kl"] == 0.0
    assert met["pg_clipfrac"] == 0.0
    assert met["pg_clipfrac_lower"] == 0.0


def test_policy_loss_clip_fractions_use_strict_inequalities():
    """veRL: clipfrac = mean[L2 > L1], clipfrac_lower = mean[Lc > -A*c and A < 0]; ties do not count.
    With ratio exactly 1 and c = 1, L1 == L2 == Lc == -A*c for every token."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[-1.0, -2.0, 1.0]])
    loss, met = policy_loss(logp, logp.clone(), adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28, dual_clip=1.0)
    assert met["pg_clipfrac"] == 0.0
    assert met["pg_clipfrac_lower"] == 0.0
    assert loss.item() == pytest.approx((1.0 + 2.0 - 1.0) / 3, abs=TOL)


def test_policy_loss_dual_clip_leaves_positive_advantages_alone():
    """The dual clip is only for A < 0: with A > 0 the cap -A*c would be *below* the loss."""
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = old + torch.log(torch.tensor([[1.0, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    with_dual, met = policy_loss(logp, old, adv, torch.ones(1, 3), 0.2, 0.28, 3.0, "seq-mean-token-sum")
    without, _ = policy_loss(logp, old, adv, torch.ones(1, 3), 0.2, 0.28, None, "seq-mean-token-sum")
    assert with_dual.item() == pytest.approx(without.item(), abs=TOL)
    assert with_dual.item() == pytest.approx(-1.0 - 1.28 - 0.5, abs=TOL)
    assert met["pg_clipfrac_lower"] == 0.0


def test_policy_loss_all_zero_mask_is_finite():
    logp = torch.tensor([[-1.0, -2.0]])
    loss, met = policy_loss(logp, logp - 5, torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2), dual_clip=3.0)
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in met.values())


def test_policy_loss_log_ratio_clamped():
    logp, old = torch.tensor([[0.0, 0.0]]), torch.tensor([[-100.0, 100.0]])
    adv = torch.tensor([[-1.0, -1.0]])
    loss, met = policy_loss(
        logp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2, dual_clip=None, agg="seq-mean-token-sum"
    )
    assert math.isfinite(loss.item())
    # token 0: ratio e^20, A < 0 -> L1 = e^20; token 1: ratio e^-20 -> clipped to 0.8
    assert loss.item() == pytest.approx(math.exp(20) + 0.8, rel=1e-5)
    assert met["ppo_kl"] == pytest.approx(0.0, abs=TOL)  # (-20 + 20) / 2


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_token_logprobs_matches_tempered_log_softmax(temperature):
    g = gen(1800)
    logits = torch.randn(2, 5, 13, generator=g) * 4
    tokens = torch.randint(0, 13, (2, 5), generator=g)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature), expected, rtol=TOL, atol=TOL)
    if temperature != 1.0:  # forgetting the temperature gives a different answer
        assert not torch.allclose(token_logprobs(logits, tokens), expected, atol=1e-3)


def test_token_logprobs_stable_and_float32():
    logits = torch.tensor([[[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]]])
    out = token_logprobs(logits, torch.tensor([[0, 2]]))
    assert torch.isfinite(out).all()
    close(out, [[0.0, -math.log(3)]])
    half = token_logprobs(logits.to(torch.bfloat16), torch.tensor([[1, 1]]))
    assert half.dtype == torch.float32


def test_token_logprobs_on_policy_ratio_is_one():
    """Same logits and temperature on both sides -> logp == old_logp -> ratio exactly 1."""
    g = gen(1801)
    logits = torch.randn(3, 4, 9, generator=g)
    tokens = torch.randint(0, 9, (3, 4), generator=g)
    lp = token_logprobs(logits, tokens, 0.7)
    _, met = policy_loss(lp, token_logprobs(logits.clone(), tokens, 0.7), torch.ones(3, 4), torch.ones(3, 4))
    assert met["ppo_kl"] == 0.0 and met["pg_clipfrac"] == 0.0


def test_entropy_extremes():
    V = 10
    assert entropy_from_logits(torch.zeros(V)).item() == pytest.approx(math.log(V), abs=TOL)
    peaked = entropy_from_logits(torch.tensor([1000.0, 0.0, -1000.0]))
    assert torch.isfinite(peaked) and peaked.item() == pytest.approx(0.0, abs=TOL)
    # shift invariance
    z = torch.randn(4, 7, generator=gen(1900))
    torch.testing.assert_close(entropy_from_logits(z + 50.0), entropy_from_logits(z), rtol=1e-4, atol=1e-4)


def test_unknown_modes_raise():
    L, m = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError):
        agg_loss(L, m, "token-sum")
    with pytest.raises(ValueError):
        kl_penalty(L, L, "k4")
    with pytest.raises(ValueError):
        policy_loss(L, L, L, m, agg="mean")
    with pytest.raises(ValueError):
        value_loss(L, L, L, m, agg="mean")
    with pytest.raises(ValueError):
        filter_groups(L, 0.5, "random")


def test_mode_tuples_are_complete():
    assert set(common.AGG_MODES) == set(MODES)
    assert set(common.KL_KINDS) == {"k1", "abs", "k2", "k3"}


########################################################################################################################
# 4. micro-batch weights reproduce the mini-batch loss
########################################################################################################################

SPLITS = [[6], [3, 3], [2, 2, 2], [1, 5], [4, 1, 1], [1, 1, 1, 1, 1, 1]]


def _mini_batch():
    B, T = 6, 7
    g = gen(2000)
    L = torch.randn(B, T, generator=g) * 3
    lengths = [7, 2, 0, 5, 1, 4]  # varying lengths, row 2 fully masked
    m = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    m[3, 1] = 0.0  # a hole inside a row (an observation token)
    return L, m


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_micro_batch_weight_accumulation(mode, split):
    L, m = _mini_batch()
    whole = agg_loss(L, m, mode).item()
    total, start = 0.0, 0
    for size in split:
        Lm, mm = L[start : start + size], m[start : start + size]
        w = micro_batch_weight(mm, m, mode)
        assert isinstance(w, float)
        total += w * agg_loss(Lm, mm, mode).item()
        start += size
    assert total == pytest.approx(whole, rel=TOL, abs=TOL)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_weight_accumulation_permuted_rows(mode):
    """Rows in any order, micro-batch of only the empty row included."""
    L, m = _mini_batch()
    perm = torch.tensor([2, 0, 5, 1, 4, 3])
    L, m = L[perm], m[perm]
    whole = agg_loss(L, m, mode).item()
    total = sum(
        micro_batch_weight(m[i : i + 1], m, mode) * agg_loss(L[i : i + 1], m[i : i + 1], mode).item() for i in range(6)
    )
    assert total == pytest.approx(whole, rel=TOL, abs=TOL)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_weight_gradients_accumulate(mode):
    """The same identity holds for gradients, which is what accumulation actually sums."""
    L0, m = _mini_batch()
    L_whole = L0.clone().requires_grad_(True)
    agg_loss(L_whole, m, mode).backward()
    L_acc = L0.clone().requires_grad_(True)
    for start, size in [(0, 2), (2, 3), (5, 1)]:
        mm = m[start : start + size]
        (micro_batch_weight(mm, m, mode) * agg_loss(L_acc[start : start + size], mm, mode)).backward()
    torch.testing.assert_close(L_acc.grad, L_whole.grad, rtol=TOL, atol=TOL)


def test_micro_batch_weight_values():
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert micro_batch_weight(m[:2], m, "token-mean") == pytest.approx(2 / 6)
    assert micro_batch_weight(m[:2], m, "seq-mean-token-mean") == pytest.approx(1 / 3)
    assert micro_batch_weight(m[:2], m, "seq-mean-token-sum") == pytest.approx(1 / 3)
    assert micro_batch_weight(m[:2], m, "seq-mean-token-sum-norm") == 1.0


########################################################################################################################
# 5. gradients: clipped tokens get none
########################################################################################################################


# (A, ratio, dual_clip, gradient flows?)
GRAD_CASES = [
    (1.0, 1.5, None, False),  # A > 0, ratio above 1 + clip_high: clipped
    (1.0, 1.1, None, True),  # A > 0, inside the trust region
    (1.0, 0.5, None, True),  # A > 0, ratio below 1 - clip_low: the unclipped term is the max, still trained
    (-1.0, 0.5, None, False),  # A < 0, ratio below 1 - clip_low: clipped
    (-1.0, 0.9, None, True),  # A < 0, inside
    (-1.0, 1.5, None, True),  # A < 0, ratio above 1 + clip_high: pessimistic L1 is kept, trained
    (-1.0, 4.0, None, True),  # no dual clip: still trained
    (-1.0, 4.0, 3.0, False),  # dual clip caps it at -A * c: no gradient
    (-1.0, 2.0, 3.0, True),  # under the dual-clip cap: trained
    (2.0, 1.27, 3.0, True),  # just inside 1 + clip_high = 1.28
    (2.0, 1.30, 3.0, False),  # just outside
]


@pytest.mark.parametrize("a,rho,dual,flows", GRAD_CASES)
def test_policy_loss_gradient_single_token(a, rho, dual, flows):
    old = torch.tensor([[-2.0]])
    logp = (old + math.log(rho)).clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp, old, torch.tensor([[a]]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28, dual_clip=dual
    )
    loss.backward()
    grad = logp.grad.item()
    if flows:
        assert grad == pytest.approx(-a * rho, rel=1e-5)  # d(-A * exp(logp - old)) / d logp
    else:
        assert grad == 0.0


def test_policy_loss_gradient_batch_mask_and_clipping():
    cases = GRAD_CASES
    B = len(cases)
    old = torch.full((B, 2), -2.0)
    logp0 = old.clone()
    adv = torch.zeros(B, 2)
    for i, (a, rho, _, _) in enumerate(cases):
        logp0[i, 0] = old[i, 0] + math.log(rho)
        adv[i] = a
    m = torch.ones(B, 2)
    m[:, 1] = 0.0  # second column masked: never any gradient
    m[0, 1] = 1.0  # except this one (ratio 1, unclipped)
    logp = logp0.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="token-mean")
    loss.backward()
    n = m.sum().item()
    for i, (a, rho, dual, flows) in enumerate(cases):
        flows_here = flows if dual is not None or not (a < 0 and rho > 3.0) else False  # dual clip on for all rows
        g = logp.grad[i, 0].item()
        if flows_here:
            assert g == pytest.approx(-a * rho / n, rel=1e-5), i
        else:
            assert g == 0.0, i
    assert logp.grad[0, 1].item() == pytest.approx(-1.0 / n, rel=1e-5)
    assert (logp.grad[1:, 1] == 0).all()


def test_value_loss_gradient_clipped_when_clipped_error_larger():
    old, R = torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.1]])
    v = torch.tensor([[1.0, 0.3]], requires_grad=True)
    # token 0: v moved 1.0 > clip 0.5 toward R -> clipped error (0.5 - 2)^2 > (1 - 2)^2 -> no gradient
    # token 1: inside the clip -> gradient 0.5 * 2 (v - R) / 2
    loss, met = value_loss(v, old, R, torch.ones(1, 2), clip=0.5)
    loss.backward()
    assert met["vf_clipfrac"] == pytest.approx(0.5)
    assert v.grad[0, 0].item() == 0.0
    assert v.grad[0, 1].item() == pytest.approx(0.5 * 2 * (0.3 - 0.1) / 2, rel=1e-5)


def test_sft_batch_right_pads_and_trains_only_the_reply():
    input_ids, labels, attn = plumbing.tiny.sft_batch([([5, 6, 7, 8], 2), ([9, 10], 1)], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]  # prompt and padding ignored
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


# ---- the reading stage (in-context copying on random strings, before a tiny model's task warm-up) ----------------

VOCAB, SEP, ARROW = list(range(3, 60)), 0, 1


def test_reading_strings_are_answered_by_copying_alone():
    """Every trained token is determined by the string before it (copy: the token n + 1 back; recall: the value that
    followed the queried key), strings are drawn from the given vocabulary only, and the markers never occur in it."""
    rng, kinds = random.Random(0), set()
    for _ in range(500):
        ids, mask = plumbing.tiny.reading_sample(rng, VOCAB, SEP, ARROW)
        assert len(ids) == len(mask) <= plumbing.tiny.READING_LEN and sum(mask) > 0
        assert all(t in VOCAB for t in ids if t not in (SEP, ARROW))
        kind = plumbing.tiny.reading_kind(ids, SEP, ARROW)
        kinds.add(kind)
        if kind == "induction":  # random tokens; each trained token follows a key whose every occurrence it follows
            assert SEP not in ids and ARROW not in ids and mask[0] == 0
            for p in (p for p, m in enumerate(mask) if m):
                key = ids[p - 1]
                seen = [q for q in range(p - 1) if ids[q] == key]
                assert seen and all(ids[q + 1] == ids[p] for q in seen)
                assert p >= len(ids) // 2 and all(ids[q] != key for q in range(p, len(ids)))
            continue
        assert ids.count(SEP) == 1
        cut = ids.index(SEP)
        if kind == "copy":  # s <sep> s
            assert ids[cut + 1 :] == ids[:cut] and mask == [0] * (cut + 1) + [1] * cut
        else:  # recall: k v k v ... <sep> k <arrow> v ...
            pairs = dict(zip(ids[:cut:2], ids[1:cut:2]))
            assert len(pairs) == cut // 2  # distinct keys: every query has one answer
            for j in range(cut + 1, len(ids), 3):
                key, arrow, value = ids[j : j + 3]
                assert arrow == ARROW and pairs[key] == value and mask[j : j + 3] == [0, 0, 1]
    assert kinds == set(plumbing.tiny.READING_KINDS)
    first_two = {
        plumbing.tiny.reading_kind(plumbing.tiny.reading_sample(rng, VOCAB, SEP, ARROW, kinds=2)[0], SEP, ARROW)
        for _ in range(200)
    }
    assert first_two == {"copy", "recall"}  # the stage's first steps (READING_PLAIN): no induction strings yet


def test_sft_replay_rows_join_every_steps_gradient():
    class Toy(torch.nn.Module):  # the Hugging Face interface sft uses: model(...).loss
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 1)

        def forward(self, input_ids, attention_mask, labels):
            hit = (labels != -100).float()
            return type("Out", (), {"loss": (self.emb(input_ids)[..., 0] * hit).sum() / hit.sum()})()

    calls, weights = [], {}
    for replay in (None, lambda: calls.append(1) or [([7, 8, 9], 1)]):
        torch.manual_seed(0)
        model = Toy()
        plumbing.tiny.sft(
            model, [([1, 2, 3], 1)], steps=4, batch_size=2, lr=0.1, pad_id=0, log=lambda _: None, replay=replay
        )
        weights[replay is None] = model.emb.weight.detach().clone()
    assert len(calls) == 4  # once a step
    assert torch.equal(weights[True][:8], weights[False][:8])  # the task rows' tokens moved alike
    assert not torch.equal(weights[True][8:], weights[False][8:])  # the replayed tokens moved only with replay


class _Reader(torch.nn.Module):
    """A stand-in model for reading_probe: copies perfectly (the rule each string was built by), or never."""

    def __init__(self, copies: bool):
        super().__init__()
        self.copies, self.dummy = copies, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, 64)
        for b, row in enumerate(input_ids.tolist()):
            n = int(attention_mask[b].sum())
            kind = plumbing.tiny.reading_kind(row[:n], SEP, ARROW)
            cut = row.index(SEP) if kind != "induction" else 0
            for t in range(cut, n - 1):  # predict row[t + 1] from row[: t + 1]
                if kind == "copy":
                    guess = row[t + 1 - (cut + 1)]
                elif kind == "recall":
                    pairs = dict(zip(row[:cut:2], row[1:cut:2]))
                    guess = pairs.get(row[t - 1], 2) if row[t] == ARROW else 2
                else:  # the token that followed the current one last time
                    guess = next((row[q + 1] for q in range(t - 1, -1, -1) if row[q] == row[t]), 2)
                logits[b, t, guess if self.copies else 2] = 1.0
        return type("Out", (), {"logits": logits})()


def test_reading_probe_scores_a_perfect_copier_one_and_a_constant_model_zero():
    assert plumbing.tiny.reading_probe(_Reader(True), VOCAB, SEP, ARROW, n=16) == dict.fromkeys(
        plumbing.tiny.READING_KINDS, 1.0
    )
    assert plumbing.tiny.reading_probe(_Reader(False), VOCAB, SEP, ARROW, n=16) == dict.fromkeys(
        plumbing.tiny.READING_KINDS, 0.0
    )


def test_a_reading_stage_changes_the_tiny_models_key_and_none_keeps_the_old_one():
    base = plumbing.tiny.tiny_recipe(0, 1024, 256, 4, 300, 8, 3e-3)
    assert "reading" not in base  # models built before the reading stage keep their names (and their shipped builds)
    assert plumbing.tiny.tiny_recipe(0, 1024, 256, 4, 300, 8, 3e-3, reading_steps=0) == base
    assert plumbing.tiny.tiny_recipe(0, 1024, 256, 4, 300, 8, 3e-3, reading_steps=1400)["reading"]["steps"] == 1400
    examples = [([{"role": "user", "content": "hi"}], "ok")]
    assert plumbing.tiny.tiny_model_name("t", examples, reading_steps=1400) != plumbing.tiny.tiny_model_name(
        "t", examples
    )


def test_a_build_with_a_reading_stage_records_its_probe_before_and_after_the_task_warm_up(tmp_path, monkeypatch):
    """The build path itself, at a toy size: the reading stage runs, then the warm-up with reading strings replayed,
    and build_info.json says what each left (a probe per kind of string, 0 to 1)."""
    monkeypatch.setenv("STARPO_CACHE", str(tmp_path))
    monkeypatch.setattr(plumbing.tiny, "SHIPPED_TINY", tmp_path / "none")
    examples = [
        ([{"role": "user", "content": f"say {w}"}], f"<think> {w} </think> <answer> {w} </answer>") for w in "ab"
    ]
    lines = []
    path = plumbing.tiny.build_tiny_model(
        "t", examples, vocab_size=300, hidden_size=32, num_layers=1, sft_steps=3, sft_batch_size=2,
        reading_steps=10, log=lines.append,
    )  # fmt: skip
    probe = json.loads((path / "build_info.json").read_text())["reading_probe"]
    assert set(probe) == {*plumbing.tiny.READING_KINDS, "seconds", "after_warmup"}
    assert set(probe["after_warmup"]) == set(plumbing.tiny.READING_KINDS)
    assert all(0.0 <= probe[k] <= 1.0 and 0.0 <= probe["after_warmup"][k] <= 1.0 for k in plumbing.tiny.READING_KINDS)
    assert sum("reading step" in line for line in lines) == 10  # a line every tenth of the stage
    assert path.name == plumbing.tiny.tiny_model_name(
        "t", examples, vocab_size=300, hidden_size=32, num_layers=1, sft_steps=3, sft_batch_size=2, reading_steps=10
    )


def test_a_second_build_reuses_the_reading_stage_and_ends_where_a_fresh_one_does(tmp_path, monkeypatch):
    """The reading stage draws random token ids, never what they spell: a second task's build whose tokenizer has as
    many ids reuses the first one's run (the log says so, build_info says "reused") and its model is the one a build
    in an empty cache makes, weight for weight."""
    monkeypatch.setattr(plumbing.tiny, "SHIPPED_TINY", tmp_path / "none")
    toy = dict(vocab_size=300, hidden_size=32, num_layers=1, sft_steps=3, sft_batch_size=2, reading_steps=10)
    say = lambda words: [  # noqa: E731
        ([{"role": "user", "content": f"say {w}"}], f"<think> {w} </think> <answer> {w} </answer>") for w in words
    ]
    monkeypatch.setenv("STARPO_CACHE", str(tmp_path / "shared"))
    first = plumbing.tiny.build_tiny_model("t", say("ab"), **toy, log=lambda line: None)
    lines = []
    second = plumbing.tiny.build_tiny_model("u", say("cd"), **toy, log=lines.append)
    vocab = lambda path: json.loads((path / "config.json").read_text())["vocab_size"]  # noqa: E731
    assert vocab(first) == vocab(second)  # same ids to draw from, so the same reading stage
    assert any("reading stage reused" in line for line in lines)
    assert not any("reading step" in line for line in lines)
    assert json.loads((second / "build_info.json").read_text())["reading_probe"]["reused"] is True
    monkeypatch.setenv("STARPO_CACHE", str(tmp_path / "fresh"))
    fresh = plumbing.tiny.build_tiny_model("u", say("cd"), **toy, log=lambda line: None)
    from safetensors.torch import load_file

    a, b = load_file(second / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "reused" not in json.loads((fresh / "build_info.json").read_text())["reading_probe"]


# ---- truncated importance sampling and the trainer / sampler mismatch ----------------------------------------------


def test_tis_weights_worked_case():
    train = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))  # ratios 2.0, 0.5, 9.0
    w = common.tis_weights(train, sampler, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 3.0]]), atol=1e-6, rtol=0)  # the last one capped
    assert not w.requires_grad
    huge = common.tis_weights(torch.tensor([[0.0]]), torch.tensor([[-1e6]]), cap=2.0)
    assert huge.item() == 2.0  # no overflow


def test_policy_loss_weights_scale_each_tokens_loss():
    logp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]])  # on-policy: ratio 1
    adv, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    plain, m1 = common.policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    weighted, m2 = common.policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, weights=torch.tensor([[2.0, 0.5]]))
    assert plain.item() == pytest.approx((-1.0 + 2.0) / 2)  # token-mean of -A * 1
    assert weighted.item() == pytest.approx((-1.0 * 2.0 + 2.0 * 0.5) / 2)
    assert m1["pg_clipfrac"] == m2["pg_clipfrac"]  # the clip statistics do not depend on the weights


def test_logprob_mismatch():
    a, b = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.1, -1.5, 9.0]])
    out = common.logprob_mismatch(a, b, torch.tensor([[1, 1, 0]]))  # the third token is not sampled: ignored
    assert out["mean"] == pytest.approx(0.3) and out["max"] == pytest.approx(0.5)
    assert common.logprob_mismatch(a, b, torch.zeros(1, 3)) == {"mean": 0.0, "max": 0.0}


# ---- model_is_reachable: fast and silent when the Hub is unreachable, unchanged when it answers ----------------


def probe_in_subprocess(tmp_path, endpoint: str, model_id: str = "someorg/somemodel"):
    """plumbing.flags.model_is_reachable(model_id) in a fresh interpreter (huggingface_hub reads its settings on import),
    online, against `endpoint`, with an empty cache; returns (result, seconds the call took, stderr)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    code = (
        "import time, common, plumbing.flags\n"
        "t = time.perf_counter()\n"
        f"ok = plumbing.flags.model_is_reachable({model_id!r})\n"
        "print(ok, time.perf_counter() - t)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    ok, seconds = res.stdout.split()
    return ok == "True", float(seconds), res.stderr


def test_model_is_reachable_fails_fast_and_silently_offline(tmp_path):
    ok, seconds, stderr = probe_in_subprocess(tmp_path, "http://127.0.0.1:9")  # nothing listens on port 9
    assert ok is False
    assert seconds < 10, seconds  # huggingface_hub's retries with backoff took ~25 s
    assert "Retry" not in stderr and "thrown while requesting" not in stderr, stderr


def test_model_is_reachable_downloads_the_config_from_a_hub(tmp_path):
    import http.server
    import threading

    body = b'{"model_type": "llama"}'

    class FakeHub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            found = self.path.startswith("/someorg/somemodel/resolve/main/config.json")
            self.send_response(200 if found else 404)
            self.send_header("X-Repo-Commit", "0" * 40)
            self.send_header("ETag", '"abc123"')
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            return found

        def do_GET(self):
            if self.do_HEAD():
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        assert probe_in_subprocess(tmp_path, endpoint)[0] is True
        assert list((tmp_path / "hf" / "hub").glob("models--someorg--somemodel/snapshots/*/config.json"))
        assert probe_in_subprocess(tmp_path / "other", endpoint, "someorg/missing")[0] is False  # a 404
    finally:
        server.shutdown()
        server.server_close()


# ---- CPU thread policy ---------------------------------------------------------------------------------------------


def test_thread_policy_yields_the_cores_other_processes_use(monkeypatch):
    monkeypatch.setattr(plumbing.cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    before = torch.get_num_threads()
    try:
        assert plumbing.cpu.thread_policy({}, lambda: 0.1).startswith("4 of 4 cores")  # idle: every core
        assert plumbing.cpu.thread_policy({}, lambda: 2.2).startswith("2 of 4 cores") and torch.get_num_threads() == 2
        assert plumbing.cpu.thread_policy({}, lambda: 7.5).startswith("1 of 4 cores")  # never fewer than one
        assert plumbing.cpu.thread_policy({}, lambda: None).startswith(
            "4 of 4 cores"
        )  # no /proc: torch's default count
        assert plumbing.cpu.thread_policy({"STARPO_THREADS": "3"}, lambda: 9.0) == "3 (STARPO_THREADS)"
        torch.set_num_threads(2)
        assert plumbing.cpu.thread_policy({"OMP_NUM_THREADS": "2"}, lambda: 9.0) == "2 (as set by the environment)"
        assert plumbing.cpu.thread_policy({"STARPO_THREADS": "off"}, lambda: 9.0).endswith(
            "(as set by the environment)"
        )
        assert torch.get_num_threads() == 2  # left alone
        with pytest.raises(SystemExit):
            plumbing.cpu.thread_policy({"STARPO_THREADS": "many"}, lambda: 0.0)
    finally:
        torch.set_num_threads(before)


class FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1

    def gnu_get_libc_version(self):
        return b"2.36"


def test_keep_freed_memory_sets_glibc_malloc_unless_the_environment_does():
    libc = FakeLibc()
    assert plumbing.cpu.keep_freed_memory({}, libc) is True
    assert libc.calls == [(-4, 0), (-1, 2**31 - 1)]  # M_MMAP_MAX 0, then M_TRIM_THRESHOLD
    for var in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        libc = FakeLibc()
        assert plumbing.cpu.keep_freed_memory({var: "65536"}, libc) is False and libc.calls == []  # yours wins
    assert plumbing.cpu.keep_freed_memory({}, object()) is False  # not glibc (macOS, musl): nothing to set


FAULTS = r"""
import resource, sys, torch
sys.path.insert(0, {root!r})
import plumbing.cpu
kept = plumbing.cpu.keep_freed_memory() if {keep} else False
counts = []
for _ in range(10):  # a 64 MB tensor written and freed, ten times (seen here: up to 6 repeats fault before reuse)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(2**24)
    x.fill_(1.0)
    del x
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, min(counts[1:]))  # the fewest of the repeats
"""


@pytest.mark.skipif(
    sys.platform != "linux" or os.environ.get("MALLOC_MMAP_MAX_") is not None, reason="glibc's malloc on Linux"
)
def test_kept_freed_memory_is_reused_without_new_page_faults():
    def run(keep: bool) -> tuple[str, int]:
        code = FAULTS.format(root=str(Path(common.__file__).parent), keep=keep)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        return out[0], int(out[1])

    kept, faults = run(True)
    if kept != "True":
        pytest.skip("not glibc")
    _, plain = run(False)
    assert plain > 4000  # glibc's default: every 64 MB block is a fresh mmap, its 16,384 pages faulted in again
    assert faults < 1000  # kept: blocks reuse the heap's pages (which of two places a block lands varies)


def test_seed_everything_keeps_the_cpu_deterministic_without_filling_new_tensors():
    plumbing.cpu.seed_everything(0, "cpu")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is False  # a debugging aid, 2.5% of a step


def test_resolve_precision_keeps_a_cpu_in_float32_unless_asked(monkeypatch):
    assert plumbing.cpu.resolve_precision("auto", "cpu") == "fp32"
    assert (
        plumbing.cpu.resolve_precision("bf16", "cpu") == "bf16"
        and plumbing.cpu.resolve_precision("fp32", "cuda") == "fp32"
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert plumbing.cpu.resolve_precision("auto", "cuda") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # pre-Ampere GPUs
    assert plumbing.cpu.resolve_precision("auto", "cuda") == "fp32"


def test_busy_cores_elsewhere_does_not_count_this_process():
    """A thread of our own spinning during the measurement must not show up as another process's load."""
    import threading

    base = plumbing.cpu.busy_cores_elsewhere(0.3)
    if base is None:
        pytest.skip("no /proc/stat here")
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(lambda: stop.is_set(), True)])
    spinner.start()
    try:
        busy = plumbing.cpu.busy_cores_elsewhere(0.3)
    finally:
        stop.set()
        spinner.join()
    assert busy < base + 0.5, (base, busy)  # counted as elsewhere, it would add about one core


def _decode_case(dtype, batch=5, heads=4, kv_heads=2, length=37, d=16, spare=9):
    """A decode step's inputs: keys and values as views into a bigger buffer (as append_in_place_cache keeps them),
    and a padding mask that hides a different left margin in each row."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, length + spare, d, generator=gen).to(dtype)[:, :, :length] for _ in "kv")
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    for row in range(batch):
        mask[row, ..., : 3 * row] = False  # row 0 attends everywhere
    return q, k, v, mask


def test_decode_attention_equals_torch_sdpa_with_gqa_padding_and_views():
    import torch.nn.functional as F

    q, k, v, mask = _decode_case(torch.float32)
    assert not k.is_contiguous()
    for m in (mask, mask[:1], None):  # per-row mask, one mask for the batch, no mask
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        torch.testing.assert_close(plumbing.engine.decode_attention(q, k, v, m), want, atol=1e-6, rtol=0)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
    torch.testing.assert_close(plumbing.engine.decode_attention(q, k, v, mask, scale=0.3), want, atol=1e-6, rtol=0)
    # a masked column does not count: changing its key and value changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 0], v2[1, :, 0] = 1e4, -1e4
    torch.testing.assert_close(
        plumbing.engine.decode_attention(q, k2, v2, mask), plumbing.engine.decode_attention(q, k, v, mask)
    )
    # bf16 inputs: float32 scores and softmax, within bf16's rounding of the float32 result
    qb, kb, vb, _ = _decode_case(torch.bfloat16)
    want = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), attn_mask=mask, enable_gqa=True)
    got = plumbing.engine.decode_attention(qb, kb, vb, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)


def test_sdpa_gqa_sends_only_low_precision_decode_steps_to_decode_attention(monkeypatch):
    import torch.nn.functional as F

    class Module:
        num_key_value_groups, is_causal = 2, True

    calls = []
    real = plumbing.engine.decode_attention
    monkeypatch.setattr(plumbing.engine, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, mask = _decode_case(dtype)
        out, _ = plumbing.engine._sdpa_gqa(Module(), q, k, v, mask, scaling=0.25)
        want = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True, scale=0.25
        )
        if dtype == torch.float32:  # float32 keeps torch's kernel, bit for bit
            assert torch.equal(
                out,
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.25).transpose(1, 2),
            )
        torch.testing.assert_close(out.float(), want.transpose(1, 2), atol=2e-2, rtol=0)
        assert out.shape == (q.shape[0], 1, q.shape[1], q.shape[3])
    assert len(calls) == 1  # the bf16 step only
    q, k, v, mask = _decode_case(torch.bfloat16)
    plumbing.engine._sdpa_gqa(Module(), q.expand(-1, -1, 3, -1), k, v, None)  # a 3-token prefill keeps torch's kernel
    assert len(calls) == 1


def test_turn_cache_finds_the_longest_stored_strict_prefix_from_the_last_call_only():
    kv = lambda n: [(torch.full((1, n, 2), float(n)), torch.full((1, n, 2), -float(n)))]  # noqa: E731
    c = plumbing.engine.TurnCache()
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5], [9] * 10):
        c.put(ids, kv(len(ids)))
    c.commit()
    assert c.take([1, 2, 3, 4, 5, 6])[0] == 5
    assert c.take([1, 2, 3, 7])[0] == 3
    assert c.take([1, 2, 3])[0] == 0  # a strict prefix only: something must be left to prefill
    assert c.take([9] * 10 + [1])[0] == 10
    assert c.take([8, 2, 3, 4])[0] == 0
    assert (c.hits, c.misses) == (3, 2)
    c.put([5, 5], kv(2))
    c.commit()
    assert c.take([1, 2, 3, 4, 5, 6]) == (0, None)  # what the previous call stored is gone
    n, stored = c.take([5, 5, 1])
    assert n == 2 and torch.equal(stored[0][0], kv(2)[0][0])


def test_a_cache_with_room_never_copies_mid_reply_and_a_released_turn_cache_forgets():
    """hf_generate's memory: the batch's cache is allocated once with room for the reply (no doubling), and the
    turn cache drops the previous turn's pasts once they are in the batch's cache."""
    cache = plumbing.engine.append_in_place_cache(room=4)
    k = torch.ones(2, 2, 7, 3)
    cache.update(k, -k, 0)
    start = cache.layers[0].keys.data_ptr()
    assert cache.layers[0].buffers[0].shape == (2, 2, 11, 3)
    for _ in range(4):
        cache.update(k[:, :, :1], -k[:, :, :1], 0)
    assert cache.layers[0].keys.data_ptr() == start and cache.get_seq_length() == 11
    cache.update(k[:, :, :1], -k[:, :, :1], 0)  # past the room: a new buffer, with room again
    assert cache.layers[0].buffers[0].shape == (2, 2, 16, 3) and (cache.layers[0].values == -1).all()
    c = plumbing.engine.TurnCache()
    c.put([5, 5], [(torch.zeros(2, 2, 3), torch.zeros(2, 2, 3))])
    c.commit()
    assert c.take([5, 5, 1])[0] == 2
    c.release()
    assert c.take([5, 5, 1]) == (0, None)


def test_cache_from_rows_left_pads_each_past_and_masks_the_padding():
    kv = lambda n: [(torch.full((2, n, 3), 1.0 + n), torch.full((2, n, 3), -1.0 - n))]  # noqa: E731
    cache, mask = plumbing.engine.cache_from_rows([(2, kv(2)), (0, None), (4, kv(4))], "cpu")
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert keys.shape == (3, 2, 4, 3) and cache.get_seq_length() == 4
    assert keys[0, :, :2].abs().sum() == 0 and (keys[0, :, 2:] == 3.0).all() and (values[2] == -5.0).all()
    assert keys[1].abs().sum() == 0
    empty, no_mask = plumbing.engine.cache_from_rows([(0, None)] * 2, "cpu")
    assert no_mask.shape == (2, 0) and empty.get_seq_length() == 0


########################################################################################################################
# 4b. micro_batch_plan: every row once, at most max_rows, the cheapest contiguous cut of the length order
########################################################################################################################


def _plan_cost(plan, first, rest, group, overhead):
    return plumbing.forward.padded_tokens(plan, first, rest, group) + overhead * len(plan)


def test_padded_tokens_counts_each_prompt_once_and_pads_each_rest():
    first, rest, group = [200, 200, 210], [40, 300, 45], [0, 0, 1]
    assert plumbing.forward.padded_tokens([torch.tensor([0, 1, 2])], first, rest, group) == 2 * 210 + 3 * 300
    assert plumbing.forward.padded_tokens([torch.tensor([0, 2]), torch.tensor([1])], first, rest, group) == (
        2 * 210 + 2 * 45 + 200 + 300
    )


def _cheapest_cut(first, rest, group, max_rows, overhead):
    """Brute force: every way to cut the length order into runs of at most max_rows."""
    order = sorted(range(len(rest)), key=lambda i: (rest[i], group[i]))
    best = math.inf
    for mask in range(2 ** (len(order) - 1)):
        runs, start = [], 0
        for k in range(1, len(order) + 1):
            if k == len(order) or mask >> (k - 1) & 1:
                runs.append(torch.tensor(order[start:k]))
                start = k
        if max(len(r) for r in runs) <= max_rows:
            best = min(best, _plan_cost(runs, first, rest, group, overhead))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_rows", [1, 3, 32])
def test_micro_batch_plan_is_a_cheapest_partition(seed, max_rows):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    group = [rng.randrange(3) for _ in range(n)]
    first = [[200, 210, 190][g] for g in group]  # a group shares its first prompt
    rest = [rng.choice([40, 45, 170, 300, 310, 570]) for _ in range(n)]
    plan = plumbing.forward.micro_batch_plan(torch.tensor(first), rest, group, max_rows, overhead=64)
    rows = sorted(i for p in plan for i in p.tolist())
    assert rows == list(range(n))  # every row exactly once
    assert all(1 <= len(p) <= max_rows and p.dtype == torch.long for p in plan)
    assert all([group[i] for i in p.tolist()] == sorted(group[i] for i in p.tolist()) for p in plan)
    assert _plan_cost(plan, first, rest, group, 64) == _cheapest_cut(first, rest, group, max_rows, 64)


def test_micro_batch_plan_splits_ragged_rows_and_keeps_even_ones_together():
    even = plumbing.forward.micro_batch_plan([200] * 16, [40] * 16, [i // 8 for i in range(16)], 32)
    assert [len(p) for p in even] == [16]  # the bandit's case: one pass, as before
    ragged = [40] * 7 + [300] * 6 + [570] * 3  # a multi-turn batch: one turn played, three, five
    plan = plumbing.forward.micro_batch_plan([205] * 16, ragged, [i % 2 for i in range(16)], 32)
    assert [len(p) for p in plan] == [7, 6, 3]
    assert _plan_cost(plan, [205] * 16, ragged, [i % 2 for i in range(16)], 64) < 2 * 205 + 16 * 570 + 64
    assert plumbing.forward.micro_batch_plan([], [], [], 4) == []
