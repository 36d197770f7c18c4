"""The shared maths of the StarPO scripts: advantages, GAE, whitening, clipping and the policy loss, the group
filter, KL, loss aggregation, truncated importance sampling and micro-batch weights.

Small pure torch functions that follow veRL's semantics (verl.trainer.ppo.core_algos); each is tested against a
plain-Python reference and hand-worked cases in tests/test_common.py. Read them: they are the algorithm. The
machinery a learner never edits (generation engine, run management, tiny models) lives in plumbing/.

Shapes: B = sequences in the batch, T = token positions, G = groups, n = group size, V = vocabulary.
"""

from __future__ import annotations

import math

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 up to float32; float32 and float64 as they are (a float64 check stays float64 throughout)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under softmax(logits / temperature).

    Dividing by the sampling temperature matters: the sampler drew tokens from the tempered distribution, so
    the ratio pi_new / pi_old is exactly 1 on-policy only if the update uses the same temperature.
    logits: (B, T, V), tokens: (B, T) -> (B, T).
    """
    z = at_least_float32(logits) / temperature  # (B, T, V)
    picked = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(z, dim=-1)  # (B, T); avoids materialising a second (B, T, V) tensor


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum(softmax(z) * z). (..., V) -> (...).

    Pass logits already divided by the temperature to get the entropy of the sampling distribution.
    """
    z = at_least_float32(logits)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask == 1; 0 (not NaN) when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar. Fully masked rows are ignored, never NaN.

    token-mean: every trained token weighs the same (long answers weigh more).  seq-mean-token-mean: every
    sequence weighs the same.  seq-mean-token-sum: sum per sequence, mean over sequences.
    seq-mean-token-sum-norm: total sum divided by the number of positions T (Dr. GRPO's length-unbiased form).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    row_sum = (loss_mat * mask).sum(-1)  # (B,)
    row_count = mask.sum(-1)  # (B,)
    has_tokens = (row_count > 0).to(loss_mat.dtype)  # (B,)
    n_rows = has_tokens.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (row_sum / row_count.clamp(min=1) * has_tokens).sum() / n_rows
    if mode == "seq-mean-token-sum":
        return (row_sum * has_tokens).sum() / n_rows
    if mode == "seq-mean-token-sum-norm":
        return row_sum.sum() / loss_mat.shape[-1]
    raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGG_MODES}")


def micro_batch_weight(micro_mask: torch.Tensor, mini_mask: torch.Tensor, mode: str = "token-mean") -> float:
    """Scale for one micro-batch's loss so that gradient accumulation reproduces the whole mini-batch's agg_loss.

    token-mean weighs by trained tokens, the seq-mean modes by sequences that have tokens, and sum-norm (already
    a plain sum divided by T) needs no scaling when micro- and mini-batch share the same T.
    """
    if mode == "token-mean":
        return (micro_mask.sum() / mini_mask.sum().clamp(min=1)).item()
    if mode == "seq-mean-token-sum-norm":
        return 1.0
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGG_MODES}")
    rows = lambda m: (m.sum(-1) > 0).sum().clamp(min=1)  # noqa: E731
    return (rows(micro_mask) / rows(mini_mask)).item()


def group_advantages(scores: torch.Tensor, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage per trajectory: (s - group mean) / (group std + eps). (G, n) -> (G, n).

    The std is the unbiased (n - 1) one, as in veRL. norm_std=False gives Dr. GRPO's s - mean.
    A group whose scores are all equal gets zeros (no signal), never NaN.
    This is the one place where GRPO normalises: skip it and "GRPO" quietly becomes REINFORCE on raw reward.
    """
    scores = scores.double()  # float64: a float32 mean of 16 x 0.15 is off by 1e-8, which eps would not absorb
    centred = scores - scores.mean(dim=1, keepdim=True)  # (G, n)
    all_equal = scores.amax(dim=1, keepdim=True) == scores.amin(dim=1, keepdim=True)  # (G, 1)
    if norm_std and scores.shape[1] >= 2:
        centred = centred / (scores.std(dim=1, keepdim=True, unbiased=True) + eps)
    return torch.where(all_equal, 0.0, centred).float()  # (G, n); equal scores carry no signal, exactly 0


def turn_group_advantages(
    turn_rewards: list[list[float]], gamma: float = 1.0, norm_std: bool = True, eps: float = 1e-6
):
    """Turn-level GRPO for ONE group: an advantage per turn of each member, [[A_i0, A_i1, ...] per member].

    Each turn's return-to-go G_ij = r_ij + gamma * G_i,j+1 (its own reward and the later turns'; gamma per turn)
    is compared with the same turn of the other members: A_ij = (G_ij - mean_j) / (std_j + eps), mean and unbiased
    std over the members that played turn j. So a turn is credited with what followed it, not with what came
    before, against a baseline that knows how far the episode got. Where fewer than two members played turn j, or
    they all got the same return, A_ij = 0 (no signal). norm_std=False: G_ij - mean_j (Dr. GRPO). With gamma = 1
    and one turn per episode this is group_advantages.
    """
    togo = []
    for rewards in turn_rewards:
        acc, out = 0.0, []
        for r in reversed(rewards):
            acc = r + gamma * acc
            out.append(acc)
        togo.append(out[::-1])
    adv = [[0.0] * len(g) for g in togo]
    for j in range(max((len(g) for g in togo), default=0)):
        who = [i for i, g in enumerate(togo) if len(g) > j]
        if len(who) < 2:
            continue
        x = torch.tensor([togo[i][j] for i in who], dtype=torch.float64)  # (members at turn j,)
        if x.max() == x.min():
            continue
        a = x - x.mean()
        if norm_std:
            a = a / (x.std(unbiased=True) + eps)
        for i, v in zip(who, a.tolist()):
            adv[i][j] = v
    return adv


def relative_to(x: torch.Tensor, pool: torch.Tensor, norm: str = "mean", eps: float = 1e-6) -> torch.Tensor:
    """(x - mean(pool)) / F, F = 1 ("mean") or pool's unbiased std + eps ("mean_std"): group_advantages' arithmetic.
    x: (m,), pool: (k,) -> (m,). A pool of fewer than two values, or of equal ones, gives zeros (no signal), never NaN."""
    if pool.numel() < 2 or pool.max() == pool.min():
        return torch.zeros_like(x)
    centred = x - pool.mean()  # (m,)
    return centred / (pool.std(unbiased=True) + eps) if norm == "mean_std" else centred  # (m,)


def gigpo_advantages(
    turn_rewards, anchors, gamma=0.95, omega=1.0, norm="mean", episode_baseline="trajectory", eps=1e-6
) -> tuple[list[list[float]], dict]:
    """GiGPO (Feng et al., arXiv 2505.10978) for ONE episode group of n members: [[A_i0, A_i1, ...] per member], stats.

    turn_rewards[i][t]: member i's reward at turn t; anchors[i][t]: a hashable key of the state shown at turn t (equal
    keys = one state; the caller builds them, e.g. the grid text plus the last k moves). F = 1 for norm="mean" (the
    paper's mean_norm, its default) or the unbiased std + eps for "mean_std" (mean_std_norm).
      A_E(i) = (R_i - mean R) / F over R_i = sum_t r_t(i) (Eq. 3): episode_baseline="trajectory" (the paper's) takes
        mean and std over the n members, "step" over every step-sample, R_i once per turn of i (verl-agent's default:
        longer episodes weigh more in the baseline). omega = 0 with "trajectory" is group_advantages exactly.
      R_t(i) = sum_{k>=t} gamma^(k-t) r_k(i) (Eq. 5); the anchor group G(s) = every (i, t) with anchors[i][t] == s
        (Eq. 6); A_S(i, t) = (R_t(i) - mean over G(s) of R) / F_G(s) (Eq. 7): 0 for a state seen once or equal returns.
      A(i, t) = A_E(i) + omega * A_S(i, t) (Eq. 8), one value per turn: place_turn_values puts it on the turn's tokens.
    stats: step_group_sizes (one per distinct state), singleton_share (share of step-samples alone in their group),
    mean_abs_step_adv[t] (mean |A_S| over the members that played turn t). verl-agent differs: its invalid-action
    penalty comes off that turn's R_t only (here a penalty inside r_t is discounted back), and a lone member keeps
    A_E = R_i (here 0, as group_advantages).
    """
    lengths = [len(r) for r in turn_rewards]
    if norm not in ("mean", "mean_std") or episode_baseline not in ("trajectory", "step"):
        raise ValueError(f"unknown norm {norm!r} or episode_baseline {episode_baseline!r}")
    if [len(a) for a in anchors] != lengths:
        raise ValueError("anchors[i] needs one key per turn of turn_rewards[i]")
    returns = torch.tensor([sum(r) for r in turn_rewards], dtype=torch.float64)  # (n,): R_i
    step_pool = returns.repeat_interleave(torch.tensor(lengths, dtype=torch.long))  # (sum of lengths,): R_i per turn
    pool = returns if episode_baseline == "trajectory" else step_pool
    episode_adv = relative_to(returns, pool, norm, eps).tolist()  # n floats: A_E, Eq. 3
    togo = [[sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))] for r in turn_rewards]
    groups = {}  # state -> [(i, t), ...]: the anchor groups, Eq. 6
    for i, keys in enumerate(anchors):
        for t, key in enumerate(keys):
            groups.setdefault(key, []).append((i, t))
    step_adv = [[0.0] * length for length in lengths]  # A_S, Eq. 7; singletons stay 0
    for members in groups.values():
        x = torch.tensor([togo[i][t] for i, t in members], dtype=torch.float64)  # (|G(s)|,): the group's R_t, Eq. 5
        for (i, t), a in zip(members, relative_to(x, x, norm, eps).tolist()):
            step_adv[i][t] = a
    adv = [[episode_adv[i] + omega * a for a in row] for i, row in enumerate(step_adv)]  # Eq. 8
    sizes = [len(members) for members in groups.values()]
    singleton_share = sizes.count(1) / max(sum(sizes), 1)  # each singleton group is one step-sample
    per_turn = [[abs(row[t]) for row in step_adv if len(row) > t] for t in range(max(lengths, default=0))]
    mean_abs = [sum(v) / len(v) for v in per_turn]  # one per turn index: how much A_S moves turn t
    return adv, {"step_group_sizes": sizes, "singleton_share": singleton_share, "mean_abs_step_adv": mean_abs}


def normalize_then_sum(per_component: list, weights: list[float], eps: float = 1e-6) -> list[list[float]]:
    """GDPO (arXiv 2601.05242): each rubric component's advantage on its own (z-scored within its group by the
    estimator), weighted and summed, then the sum normalised over the batch, (x - mean) / (std + eps) over every
    (episode, turn) entry: [component][episode][turn] -> [episode][turn]. Summing first and normalising after lets a
    large component hide a small one; here each moves the advantage by its weight. An all-equal sum gives zeros."""
    summed = [[sum(w * c[i][j] for w, c in zip(weights, per_component)) for j in range(len(row))]
              for i, row in enumerate(per_component[0])] if per_component else []  # fmt: skip
    flat = torch.tensor([v for row in summed for v in row], dtype=torch.float64)  # (entries,)
    if flat.numel() < 2 or flat.max() == flat.min():
        return [[0.0] * len(row) for row in summed]
    mean, std = flat.mean().item(), flat.std(unbiased=True).item()
    return [[(v - mean) / (std + eps) for v in row] for row in summed]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation over token positions, skipping masked (non-trained) positions.

    rewards, values, mask: (B, T). Returns (advantages, returns), both (B, T), advantages not yet whitened.
    Backward scan: delta_t = r_t + gamma * next_value - V_t, g_t = delta_t + gamma * lam * last_gae, and only
    where mask_t = 1 do we move next_value <- V_t and last_gae <- g_t. A masked position (e.g. an observation
    token between two turns) therefore carries the advantage from its right, so the turns chain together as
    if the observation were not there.
    """
    B, T = rewards.shape
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,)
    last_gae = torch.zeros_like(next_value)  # (B,)
    advantages = torch.zeros_like(values)  # (B, T)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        g = delta + gamma * lam * last_gae  # (B,)
        m = mask[:, t]  # (B,)
        next_value = m * values[:, t] + (1 - m) * next_value
        last_gae = m * g + (1 - m) * last_gae
        advantages[:, t] = last_gae
    returns = advantages + values
    return advantages, returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance); masked-out entries become 0."""
    mask = mask.to(x.dtype)
    count = mask.sum()
    mean = masked_mean(x, mask)
    centred = (x - mean) * mask
    if count < 2:  # one token has no variance: centre it, do not scale it
        return centred
    var = (centred**2).sum() / (count - 1)
    return centred * torch.rsqrt(var + eps)


def group_stat(scores: torch.Tensor, kind: str = "std") -> torch.Tensor:
    """RAGEN-2's per-group filter statistic, (G, n) episode returns -> (G,) float64.

    "std": the sample std (ddof 1), what RAGEN's code ranks by under the name reward_variance (rollout_filter.py
    `rm_scores.std(-1)`, ~L428); "var": its square, the sample variance of the authors' later upstream PRs.
    A group of one episode has no spread: zeros.
    """
    if kind not in ("std", "var"):
        raise ValueError(f"unknown filter statistic {kind!r}; choose 'std' or 'var'")
    x = scores.double()  # (G, n)
    if x.shape[1] < 2:
        return torch.zeros(x.shape[0], dtype=torch.float64)
    return x.std(dim=1, unbiased=True) if kind == "std" else x.var(dim=1, unbiased=True)  # (G,)


FILTER_STRATEGIES = ("none", "top_k", "top_k_abs", "top_p", "min_p")


def select_groups(stat, strategy="top_p", value=0.9, prob_mode="linear", include_zero=False, eps=0.01) -> list[int]:
    """RAGEN-2's rollout filter: the groups to train on, ascending. stat: G non-negative numbers (list or (G,)).

    RAGEN's _select_top_groups, filter_type "largest" (rollout_filter.py L68-185), in its float32 arithmetic:
      0. include_zero False drops groups with |stat| <= 1e-10 first; if none remain, keep nothing.
      top_p linear: walk the stats in descending order summing them until the sum reaches T = value * total - eps;
         keep the walked groups if it does, else nothing. eps is an absolute floor: a batch whose total signal is
         below eps / value is skipped outright, and value >= 1 keeps every remaining group.
      top_p softmax: p = softmax(stats); keep the fewest top groups whose cumulative p reaches value.
      top_k: k = int(value * G) of all G groups (at least 1, at most what remains); top_k_abs: k = int(value).
      min_p: keep stat >= value * max stat.
      none: keep every group (no filter).
    One departure: ties go to the lower group index (RAGEN's torch.sort / topk leave them unordered), judged on the
    stats rounded to 9 decimals so that equal groups summed in another order still tie. top_k's k is
    int(value * G + 1e-9), as StarPO-S's filter here always had it, so 0.29 * 100 keeps 29 where RAGEN's int() keeps 28.
    """
    if strategy not in FILTER_STRATEGIES:
        raise ValueError(f"unknown filter strategy {strategy!r}; choose from {FILTER_STRATEGIES}")
    if prob_mode not in ("linear", "softmax"):
        raise ValueError(f"unknown top_p prob_mode {prob_mode!r}; choose 'linear' or 'softmax'")
    if strategy == "top_k_abs" and not value >= 1:
        raise ValueError(f"top_k_abs keeps int(value) groups: value must be >= 1, got {value}")
    if strategy in ("top_k", "top_p", "min_p") and not 0 < value <= 1:
        raise ValueError(f"{strategy} value must be in (0, 1], got {value}")
    stat64 = torch.as_tensor(stat, dtype=torch.float64).reshape(-1)  # (G,)
    G = stat64.numel()
    if strategy == "none":
        return list(range(G))
    scores = stat64.float()  # (G,): RAGEN casts to float32, so its sums and thresholds are float32 ones
    alive = [g for g in range(G) if include_zero or scores[g].abs() > 1e-10]
    if not alive:
        return []
    rounded = stat64.tolist()
    order = sorted(alive, key=lambda g: (-round(rounded[g], 9), g))  # descending, ties to the lower index
    ranked = scores[order]  # (A,): the remaining stats, largest first
    if strategy == "top_p" and value >= 1:
        kept = alive
    elif strategy == "top_p" and prob_mode == "softmax":
        probs = torch.softmax(scores[alive], dim=0)  # (A,)
        cumulative = probs[[alive.index(g) for g in order]].cumsum(0)  # (A,), in ranked order
        k = min(torch.searchsorted(cumulative, value).item() + 1, len(alive))  # first cumulative p >= value
        kept = order[:k]
    elif strategy == "top_p":
        threshold = value * scores[alive].sum() - eps  # float32, as RAGEN's
        total, n = 0.0, 0
        for s in ranked.tolist():
            if total >= threshold or s <= 0:
                break
            total, n = total + s, n + 1
        kept = order[:n] if total >= threshold else []
    elif strategy in ("top_k", "top_k_abs"):
        k = int(value * G + 1e-9) if strategy == "top_k" else int(value)  # top_k: a share of ALL groups
        kept = order[: max(1, min(k, len(alive)))]
    else:  # min_p
        floor = ranked.max() * value - 1e-10  # float32
        kept = [g for g, s in zip(order, ranked) if s >= floor]
    return sorted(kept)


def filter_loss_scale(kept: int, total: int, mode: str = "none") -> float:
    """RAGEN's actor.filter_loss_scaling (agent_trainer.py L1403-1408): the factor on the policy's advantages after
    filtering, "none" 1, "linear" kept/total, "sqrt" sqrt(kept/total), so a step that trained on few groups moves
    the policy less. The critic's targets are not scaled."""
    if mode not in ("none", "linear", "sqrt"):
        raise ValueError(f"unknown filter loss scaling {mode!r}; choose 'none', 'linear' or 'sqrt'")
    if not 0 <= kept <= total or total < 1:
        raise ValueError(f"need 0 <= kept <= total and total >= 1, got kept={kept}, total={total}")
    ratio = kept / total
    return 1.0 if mode == "none" else ratio if mode == "linear" else math.sqrt(ratio)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeeded: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, Codex).

    The chance that k samples drawn without replacement from the n include a success. RAGEN logs only the k = n
    case ("any member succeeded", es_manager.py L349-361); this one is unbiased for every k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one correctly rounded division


def collapse_metrics(cross_mean, cross_sum, cols, signatures=None, ema=None) -> dict[str, float]:
    """RAGEN-2's collapse diagnostics: how much the reasoning Z still depends on the prompt X (collapse_metrics.py
    L298-324, L566-718). cross_mean, cross_sum: (R, N) log p(z_i | x_j), per-token mean and sum over z_i's tokens.

    matched_i = L[i, cols[i]]; marginal_i = logsumexp_j L[i, j] - log N, z_i's log-density under the uniform mix of
    the N prompts. mi_estimate = mean(matched) - mean(marginal) <= log N: near 0 when every prompt explains every
    reasoning equally well ("template collapse"), even while the entropy H(Z|X) = -mean(matched) stays high.
    Retrieval: does argmax_j L[i, j] (the first maximum on ties, as torch.argmax) name row i's prompt? Columns with
    equal signatures[j] count as the same prompt; chance = mean_i (columns sharing i's signature) / N; @k looks in
    the top min(k, 8, N) columns. marginal_std: ddof-0 std of marginal over rows; mi_zscore = mean((matched -
    marginal) / (marginal_std + 1e-3)); the _ema variants divide by a running std s <- 0.9 s + 0.1 marginal_std kept
    in `ema` (updated in place; the first value starts it; None: no history). _seq: the same on the sums.
    Fewer than 2 prompts (or no rows): {} (RAGEN logs nothing then).
    """
    R, N = cross_mean.shape
    if N < 2 or R == 0:
        return {}
    cross_mean, cross_sum = cross_mean.double().cpu(), cross_sum.double().cpu()  # (R, N) each
    rows, col = torch.arange(R), torch.as_tensor(cols, dtype=torch.long)  # (R,), (R,)
    out = {"mi_upper_bound": math.log(N)}
    for tag, L in (("", cross_mean), ("_seq", cross_sum)):
        matched = L[rows, col]  # (R,)
        marginal = torch.logsumexp(L, dim=1) - math.log(N)  # (R,)
        gap = matched - marginal  # (R,): log p(z|x) / p_mix(z), the pointwise information
        std = marginal.std(unbiased=False).item()
        if ema is not None:
            key = "marginal_std" + tag
            ema[key] = std if key not in ema else 0.9 * ema[key] + 0.1 * std
        smooth = std if ema is None else ema["marginal_std" + tag]
        h = "_seq" if tag else ""  # RAGEN's names put _seq in the middle here
        out |= {
            f"mi{h}_estimate": gap.mean().item(),
            f"conditional_entropy{h}_est": -matched.mean().item(),
            f"reasoning_entropy{h}_est": -marginal.mean().item(),
            f"marginal_std{tag}": std,
            f"mi_zscore{tag}": (gap / (std + 1e-3)).mean().item(),
            f"marginal_std_ema{tag}": smooth,
            f"mi_zscore_ema{tag}": (gap / (smooth + 1e-3)).mean().item(),
        }
    out["matched_log_prob_mean"] = -out["conditional_entropy_est"]
    out["marginal_log_prob_mean"] = -out["reasoning_entropy_est"]
    ids = {}  # signature -> id: columns that hold equal prompts share one
    sig = torch.tensor([ids.setdefault(s, len(ids)) for s in (range(N) if signatures is None else signatures)])  # (N,)
    truth = sig[col]  # (R,)
    ranked = torch.sort(cross_mean, dim=1, descending=True, stable=True).indices  # (R, N); ties: lower j
    hit = sig[ranked] == truth[:, None]  # (R, N): does the column at rank r hold i's prompt?
    chance = (torch.bincount(sig)[truth] / N).double().mean().item()
    out |= {"retrieval_accuracy": hit[:, 0].double().mean().item(), "retrieval_chance_level": chance}
    out["retrieval_above_chance"] = out["retrieval_accuracy"] - chance
    for k in (2, 4, 8):
        k_eff = min(k, 8, N)
        out[f"retrieval_accuracy@{k}"] = hit[:, :k_eff].any(dim=1).double().mean().item()
        out[f"retrieval_chance_level@{k}"] = min(1.0, chance * k_eff)
        out[f"retrieval_above_chance@{k}"] = out[f"retrieval_accuracy@{k}"] - out[f"retrieval_chance_level@{k}"]
    return out


def bi_level_gae(rewards, values, mask, turn_ends, gamma=1.0, lam=1.0, high_gamma=0.95):
    """RAGEN's bi-level GAE (core_algos.py compute_bi_level_gae_advantage_return): GAE over turns, then over tokens.

    rewards, values, mask: (B, T); turn_ends[b]: row b's turn-final columns, ascending, inside the mask, each turn's
    reward sitting there. Returns (advantages, returns), both (B, T), zero off the mask, advantages not whitened.
    High level, over row b's turn ends e_1 < ... < e_K (V(e_{K+1}) = 0, A_{K+1} = 0):
        A_k = r(e_k) + high_gamma * V(e_{k+1}) - V(e_k) + high_gamma * lam * A_{k+1},   G_k = A_k + V(e_k).
    Low level, backwards over the masked-in tokens: at a turn end A = G_k - V(e_k) (the scan restarts there);
    elsewhere delta_t = r_t + gamma * V(next masked-in token) - V_t, A_t = delta_t + gamma * lam * A_next.
    So with gamma = lam = 1 a token's advantage is its turn's discounted return minus its own value: high_gamma
    discounts between turns only. RAGEN finds turn ends as the tokens with reward != 0, so a turn that earned 0
    merges into the next one and escapes the discount, and a row with no reward crashes; here they are given,
    and a row with none gets zeros. Masked-in tokens after the last turn end end the episode (next value 0).
    """
    B, T = rewards.shape
    if len(turn_ends) != B:
        raise ValueError(f"turn_ends has {len(turn_ends)} rows, the rewards {B}")
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    is_end = torch.zeros_like(mask, dtype=torch.bool)  # (B, T)
    turn_return = torch.zeros_like(values)  # (B, T): G_k at each turn end
    for b, ends in enumerate(turn_ends):
        if any(mask[b, e] == 0 for e in ends) or list(ends) != sorted(set(ends)):
            raise ValueError(f"row {b}: turn ends {ends} must ascend, without repeats, on masked-in tokens")
        next_value, adv = 0.0, 0.0
        for e in reversed(ends):  # the high level: one step per turn, discounted by high_gamma
            adv = rewards[b, e] + high_gamma * next_value - values[b, e] + high_gamma * lam * adv
            turn_return[b, e], next_value = adv + values[b, e], values[b, e]
            is_end[b, e] = True
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    last = torch.zeros_like(next_value)  # (B,)
    advantages = torch.zeros_like(values)  # (B, T)
    for t in reversed(range(T)):  # the low level: token GAE inside each turn, its return as the final reward
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        g = torch.where(is_end[:, t], turn_return[:, t] - values[:, t], delta + gamma * lam * last)  # (B,)
        m = mask[:, t]  # (B,)
        next_value = m * values[:, t] + (1 - m) * next_value  # masked-out tokens are skipped, as in gae
        last = m * g + (1 - m) * last
        advantages[:, t] = m * g
    played = is_end.any(dim=1, keepdim=True).float()  # (B, 1): a row without turns learns nothing
    return advantages * played, (advantages + values) * mask * played


def policy_loss(
    logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean", weights=None
):
    """PPO clipped surrogate with decoupled clip (DAPO) and dual clip for negative advantages.

    All tensors (B, T). Returns (loss, metrics). L1 = -A * rho, L2 = -A * clip(rho, 1 - clip_low, 1 + clip_high),
    Lc = max(L1, L2); where A < 0 the dual clip caps the loss at -A * dual_clip so that one token whose ratio
    exploded cannot dominate the batch. dual_clip=None turns it off. weights (B, T), optional: each token's loss is
    multiplied by its weight before aggregation (truncated importance sampling, see tis_weights).
    """
    mask = mask.float()
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    loss1 = -advantages * ratio  # (B, T)
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    clipped = torch.maximum(loss1, loss2)  # (B, T)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).float(), mask).item()}
    if dual_clip is not None:
        loss3 = -advantages * dual_clip  # (B, T)
        negative = advantages < 0
        clipped_lower = (clipped > loss3) & negative  # (B, T)
        loss_mat = torch.where(negative, torch.minimum(clipped, loss3), clipped)  # (B, T)
        metrics["pg_clipfrac_lower"] = masked_mean(clipped_lower.float(), mask).item()
    else:
        loss_mat = clipped
        metrics["pg_clipfrac_lower"] = 0.0
    metrics["ppo_kl"] = masked_mean(-log_ratio, mask).item()
    if weights is not None:
        loss_mat = loss_mat * weights  # (B, T)
    loss = agg_loss(loss_mat, mask, agg)
    metrics["pg_loss"] = loss.item()
    return loss, metrics


def tis_weights(train_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS, as TRL's vLLM correction): min(pi_train / pi_sampler, cap) per token, (B, T).

    The sampler (vLLM, in bf16, with its own kernels) and the trainer give the same tokens slightly different
    probabilities, so the samples are a little off-policy for the trainer; weighting each token's loss by the ratio
    corrects that, and the cap bounds the variance a rare large ratio would add. No gradient flows through it.
    """
    return (train_logp - sampler_logp).clamp(-20.0, 20.0).exp().clamp(max=cap).detach()


def logprob_mismatch(train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |trainer log-prob - sampler log-prob| over the masked (sampled) tokens: how far apart they are."""
    diff = (train_logp - sampler_logp).abs()[mask.bool()]
    if diff.numel() == 0:
        return {"mean": 0.0, "max": 0.0}
    return {"mean": diff.mean().item(), "max": diff.max().item()}


def value_loss(values, old_values, returns, mask, clip=0.5, agg="token-mean"):
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (v_clip - R)^2)), v_clip = old + clip(v - old, -c, c).

    All tensors (B, T). Returns (loss, metrics).
    """
    mask = mask.float()
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)  # (B, T)
    err = (values - returns) ** 2  # (B, T)
    err_clipped = (v_clipped - returns) ** 2  # (B, T)
    loss = 0.5 * agg_loss(torch.maximum(err, err_clipped), mask, agg)
    metrics = {"vf_loss": loss.item(), "vf_clipfrac": masked_mean((err_clipped > err).float(), mask).item()}
    return loss, metrics


KL_KINDS = ("k1", "abs", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference. (B, T) -> (B, T).

    k1 = logp - ref (unbiased, can be negative), abs = |logp - ref|, k2 = 0.5 (logp - ref)^2,
    k3 = exp(x) - x - 1 with x = ref - logp (Schulman's low-variance, always >= 0), clamped for safety.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "k3":
        x = (ref_logp - logp).clamp(-20.0, 20.0)
        return (x.exp() - x - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_KINDS}")
