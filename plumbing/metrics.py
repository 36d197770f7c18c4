"""What the scripts log of their episodes, each metric defined once (the README's glossary names them; the schema
test holds the keys alike in every script): the episodes' outcomes and replies (multi-turn and one-turn), what the
filter saw and kept, and pass@k. They read the scripts' Trajectory and Turn fields by name: plumbing/contract.py lists
which, and every script checks them at start-up.
"""

from __future__ import annotations

import statistics

import torch

import common


def episode_stats(trajs: list, split: str) -> dict:
    """What a multi-turn script's episodes (Trajectory objects) did: the same keys for train/ and val/, the README's
    glossary defines them. The report draws these curves."""
    turns = [turn for t in trajs for turn in t.turns]
    played = [info for turn in turns for info in turn.infos]
    scores = [t.score for t in trajs]
    return {
        f"{split}/success": statistics.mean(t.success for t in trajs),
        f"{split}/reward": statistics.mean(scores),
        f"{split}/reward_min": min(scores),
        f"{split}/reward_max": max(scores),
        f"{split}/action_is_valid": statistics.mean(not turn.had_invalid for turn in turns)
        if turns
        else 0.0,  # per turn
        f"{split}/action_is_effective": statistics.mean(i["action_is_effective"] for i in played)
        if played
        else 0.0,  # per move
        f"{split}/num_actions": statistics.mean(t.num_actions for t in trajs),
        f"{split}/num_turns": statistics.mean(len(t.turns) for t in trajs),
        f"{split}/context_overflow": sum(t.context_overflow for t in trajs),
    }


def reply_stats(trajs: list) -> dict:
    """Reply lengths (per reply, i.e. per turn) and the rubric's components (summed per episode, averaged)."""
    replies = [t.turn_last_index[j] - t.turn_start[j] + 1 for t in trajs for j in range(len(t.turns))]
    thinks = [len(turn.think or "") for t in trajs for turn in t.turns]
    return {
        "rollout/truncated_frac": statistics.mean(t.truncated for t in trajs),
        "response_length/mean": statistics.mean(replies) if replies else 0.0,
        "think_length/mean": statistics.mean(thinks) if thinks else 0.0,
        "sequence_length/mean": statistics.mean(len(t.ids) for t in trajs),
        **rubric_means(trajs),
    }


def one_turn_episode_stats(trajs: list, split: str) -> dict:
    """episode_stats for the bandit's one-turn episodes (Trajectory.turn, .context_overflow): the keys that apply to them."""
    scores = [t.score for t in trajs]
    return {
        f"{split}/success": statistics.mean(t.turn.info["success"] for t in trajs),
        f"{split}/reward": statistics.mean(scores),
        f"{split}/reward_min": min(scores),
        f"{split}/reward_max": max(scores),
        f"{split}/action_is_valid": statistics.mean(t.turn.info["action_is_valid"] for t in trajs),
        f"{split}/context_overflow": sum(t.context_overflow for t in trajs),
    }


def one_turn_reply_stats(trajs: list) -> dict:
    """reply_stats for one-turn episodes (Trajectory.prompt_ids, .reply_ids): one reply per episode."""
    return {
        "rollout/truncated_frac": statistics.mean(t.truncated for t in trajs),
        "response_length/mean": statistics.mean(len(t.reply_ids) for t in trajs),
        "think_length/mean": statistics.mean(len(t.turn.think or "") for t in trajs),
        "sequence_length/mean": statistics.mean(len(t.prompt_ids) + len(t.reply_ids) for t in trajs),
        **rubric_means(trajs),
    }


def rubric_means(trajs: list) -> dict:
    """rubric/<name>: each component's per-episode value (summed over its turns), averaged over the episodes that have
    one: a judge's failed judgements (None) are left out, never counted as 0; a component with no value is not logged."""
    values = {k: [t.parts[k] for t in trajs if t.parts[k] is not None] for k in trajs[0].parts}
    return {f"rubric/{k}": statistics.mean(v) for k, v in values.items() if v}


def filter_stats(scores: torch.Tensor, stat: torch.Tensor, kept: list[int]) -> dict:
    """What the filter saw and kept, under RAGEN's names (rollout_filter.py): each group's reward std, mean and max,
    averaged over all groups and over the kept ones; how many groups were kept, and how many had a zero statistic."""
    G, n = scores.shape
    by = dict(std=scores.std(dim=1) if n > 1 else torch.zeros(G), mean=scores.mean(dim=1), max=scores.amax(dim=1))
    out = {f"rollout/in_group_{k}": v.mean().item() for k, v in by.items()}  # each v: (G,)
    out.update({f"rollout/chosen_in_group_{k}": v[kept].mean().item() for k, v in by.items() if kept})
    return {
        **out,
        "rollout/zero_std_frac": (by["std"] < 1e-6).float().mean().item(),
        "rollout/filter_kept_count": len(kept),
        "rollout/filter_kept_ratio": len(kept) / G,
        "rollout/filter_zero_count": int((stat.abs() <= 1e-10).sum()),
        "rollout/empty_after_filter": int(not kept),
    }


def pass_stats(successes: list, n: int, split: str) -> dict:
    """pass@k over groups of n consecutive episodes of one initial state: the unbiased 1 - C(n-c, k) / C(n, k)
    (common.pass_at_k) for k = 1, 2, 4, ... up to n; pass@n is RAGEN's (any success in the group)."""
    if n < 2:
        return {}
    wins = [sum(successes[i : i + n]) for i in range(0, len(successes), n)]  # c: successes per initial state
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n} | {n})
    return {f"{split}/pass@{k}": statistics.mean(common.pass_at_k(n, c, k) for c in wins) for k in ks}


def gigpo_stats(groups: list[dict]) -> dict:
    """What GiGPO's state groups held this step, over the kept episode groups (common.gigpo_advantages' stats, one
    dict per episode group): how many state groups, their mean and largest size, the share of turns alone in their
    state (their step advantage is 0), the mean |A_S| over all turns and, per turn index j, gigpo/abs_step_adv_turn_j
    (how much the step advantage moves turn j: the episode's end, where states diverge, or its start)."""
    sizes = [s for g in groups for s in g["step_group_sizes"]]
    per_turn: dict[int, list[float]] = {}
    for g in groups:
        for j, v in enumerate(g["mean_abs_step_adv"], 1):
            per_turn.setdefault(j, []).append(v)
    if not sizes:
        return {}
    out = {
        "gigpo/step_groups": len(sizes),
        "gigpo/step_group_size_mean": statistics.mean(sizes),
        "gigpo/step_group_size_max": max(sizes),
        "gigpo/singleton_frac": sizes.count(1) / sum(sizes),
        "gigpo/abs_step_adv_mean": statistics.mean(v for vs in per_turn.values() for v in vs),
    }
    return out | {f"gigpo/abs_step_adv_turn_{j}": statistics.mean(vs) for j, vs in sorted(per_turn.items())}


def advantage_shares(per_component: list, weighted: list[tuple[str, float]]) -> dict:
    """adv_share/<name>: each weighted component's share of the advantage, mean |w * A_c| over every (episode, turn)
    entry divided by the sum of those means over the components (A_c: the component's advantage on its own; under
    sum_then_normalize its group-centred part of the total, under GDPO's normalize_then_sum its z-score). A component
    a sum hides shows here as a share near 0."""
    flat = [[abs(v) for row in adv for v in row] for adv in per_component]  # each component's |A| entries
    means = [abs(w) * sum(a) / len(a) if a else 0.0 for (_, w), a in zip(weighted, flat)]
    total = sum(means)
    return {f"adv_share/{name}": m / total if total else 0.0 for (name, _), m in zip(weighted, means)}
