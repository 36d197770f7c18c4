"""RAGEN-2's template-collapse diagnostics (arXiv 2604.06268; ragen/trainer/collapse_metrics.py): does the reasoning
still depend on the prompt?

Entropy cannot see a reasoning template that ignores its input: the template can stay random and still say nothing
about the state it was shown. So, every --mi-every steps, every sampled reasoning Z of the batch's first turns is
scored under every prompt X of the batch (teacher-forced, the current policy, forward.cross_logprobs): a reasoning
that depends on its prompt scores best under its own (retrieval accuracy, against its chance level), and the gap
between its own prompt's log-prob and the batch's average is the mutual information I(X; Z) (common.collapse_metrics,
where the estimators are). RAGEN-2 found these MI proxies track success (Spearman +0.39) where entropy does not.
"""

from __future__ import annotations

import itertools
import random
import statistics

import torch

import common
from plumbing import dist, forward

MAX_PROMPTS, MAX_ROWS = 8, 64  # RAGEN-2's first-turn family: one prompt per group, at most 64 reasonings


def due(step: int, every: int) -> bool:
    """At step 1 and every `every` steps (RAGEN's should_compute); 0 = never. Under torchrun rank 0 alone measures:
    every rank holds the whole batch, and at most 8 prompts make a small pass (nothing trained depends on it)."""
    return bool(every) and (step == 1 or step % every == 0) and dist.is_main()


def think_ids(tok, reply_ids: list[int], texts: dict | None = None) -> list[int]:
    """The exact sampled token ids strictly between <think> and </think> (RAGEN-2's reasoning Z); [] when the reply
    has no closed think or it is blank. A token that straddles a tag is left out. (RAGEN re-tokenises the think's
    text; the sampled ids avoid its boundary effects.) texts: token id -> its text, shared by a batch's calls."""
    texts = {} if texts is None else texts
    for i in set(reply_ids) - texts.keys():
        texts[i] = tok.decode([i])
    pieces = [texts[i] for i in reply_ids]  # each token's text
    text = "".join(pieces)
    lo = text.find("<think>") + len("<think>")
    hi = text.find("</think>", lo)
    if lo < len("<think>") or hi < 0:
        return []
    ends = list(itertools.accumulate(len(p) for p in pieces))  # each token's end in the joined text
    ids = [i for i, p, end in zip(reply_ids, pieces, ends) if end - len(p) >= lo and end <= hi]
    return ids if tok.decode(ids).strip() else []


def first_turn_diagnostics(policy, tok, first_turns: list, thinks: list, run, step: int, autocast) -> dict:
    """The collapse/* metrics of one step, on the batch before the filter; the cross-scoring matrix goes to
    collapse.jsonl (run.log_collapse) for the report's heatmap.

    first_turns: (group, prompt ids, reply ids) of each episode's first turn; a group's members share its prompt.
    thinks: every turn's think text in the batch (None: no well-formed think), for collapse/valid_thinking_rate.
    Up to 8 groups' prompts (each followed by "<think>", as RAGEN builds X) and up to 64 of their members'
    reasonings are drawn with the step's own random stream, so a resumed run draws the same ones. The z-score's
    running std continues from the run's history (run.history); the scoring temperature is the rollouts' (SETTINGS).
    """
    texts = {}  # token id -> text, decoded once for the whole batch
    zs = [think_ids(tok, reply, texts) for _, _, reply in first_turns]  # the reasoning Z of each episode's first turn
    out = {
        "collapse/valid_thinking_rate": statistics.mean(bool(z and z.strip()) for z in thinks) if thinks else 0.0,
        "collapse/first_turn_num_total": len(zs),
        "collapse/first_turn_num_valid": sum(map(bool, zs)),
    }
    rng = random.Random(run.args.seed * 10**7 + step)
    groups = sorted({g for (g, _, _), z in zip(first_turns, zs) if z})
    groups = sorted(rng.sample(groups, min(MAX_PROMPTS, len(groups))))  # the columns: one prompt per group
    rows = [i for i, (g, _, _) in enumerate(first_turns) if zs[i] and g in groups]
    rows = sorted(rng.sample(rows, min(MAX_ROWS, len(rows))))
    if len(groups) < 2:
        return out  # one prompt: nothing to tell apart
    prompt_of = {g: p for g, p, _ in reversed(first_turns)}  # each group's first member's prompt
    open_think = tok("<think>", add_special_tokens=False)["input_ids"]
    prompts = [prompt_of[g] + open_think for g in groups]
    cols = [groups.index(first_turns[i][0]) for i in rows]  # (R,): each reasoning's own prompt
    with torch.no_grad(), autocast:
        cross_mean, cross_sum = forward.cross_logprobs(
            policy, prompts, [zs[i] for i in rows], run.settings["temperature"]
        )  # (R, N)
    last = next((h for h in reversed(run.history) if "collapse/marginal_std_ema" in h), None)  # the running std so far
    ema = {k: last[f"collapse/{k}".replace("std", "std_ema")] for k in ("marginal_std", "marginal_std_seq") if last}
    same = [tuple(p) for p in prompts]  # equal prompts (two groups shown the same arms) are one for retrieval
    out.update({f"collapse/{k}": v for k, v in common.collapse_metrics(cross_mean, cross_sum, cols, same, ema).items()})
    labels = [f"group {g}" for g in groups]
    run.log_collapse(
        step, dict(matrix=[[round(x, 4) for x in r] for r in cross_mean.tolist()], cols=cols, prompts=labels)
    )
    return out
