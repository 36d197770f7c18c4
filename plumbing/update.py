"""The update's machinery, so that a script's old_logprobs and ppo_update read as the maths: which rows each
micro-batch holds and how much of its mini-batch's loss it carries, the optimizer step (processes agreeing that the
loss was finite, gradients summed across processes, clipped, stepped or skipped), veRL's on-policy shortcut, and the
update's metrics. Under torchrun each process trains only its own rows (the `mine` column of a batch, plumbing/dist.py);
in one process every row is its own.
"""

from __future__ import annotations

import math
import statistics

import torch

import common
from plumbing import dist, forward


def micro_batches(batch: dict, rows, size: int, view, mask=None, agg: str = "token-mean"):
    """(mb, weight) for each micro-batch of `rows` (a tensor of row indices; None = all) that this process owns, at
    most `size` rows each, rows of like length together (forward.micro_batch_plan, which also keeps a group's rows
    together so their shared prompt runs once). mb = view(batch, indices) (the script's micro_view: mb["idx"] its rows,
    mb["cols"] its columns). weight: the micro-batch's share of the loss of all of `rows` under `agg`
    (common.micro_batch_weight), so that the micro-batches' gradients add up to the mini-batch's; None without a mask."""
    rows = torch.arange(len(batch["group"]), device=batch["group"].device) if rows is None else rows
    mine = rows[batch["mine"][rows]] if "mine" in batch else rows  # (M,): this process's rows among them
    for idx in forward.micro_batch_plan(*(batch[k][mine] for k in ("first_len", "rest_len", "group")), size):
        mb = view(batch, mine[idx])
        weight = None if mask is None else common.micro_batch_weight(mask[mb["idx"], : mb["cols"]], mask[rows], agg)
        yield mb, weight


def all_rows(batch: dict, *tensors) -> None:
    """After a no-grad pass over this process's rows (micro_batches): every process gets every process's rows of each
    tensor (N, ...), in place (None is skipped). A no-op in one process."""
    for t in tensors:
        if t is not None and "mine" in batch:
            dist.share_rows(t, batch["mine"])


def backward(loss: torch.Tensor, weight: float, finite: bool) -> bool:
    """Accumulate loss * weight's gradient while every loss of this mini-batch has been finite; False from the first
    that is not (the optimizer step will then be skipped)."""
    finite = finite and bool(torch.isfinite(loss))
    if finite:
        (loss * weight).backward()
    return finite


def step(finite: bool, *nets, max_norm: float = 1.0) -> float | None:
    """One optimizer step for each (model, optimizer) pair (a None model is skipped), on every process or on none:
    the processes agree that every loss was finite, sum their gradients, clip each model's to max_norm and step.
    Returns the first model's gradient norm before clipping, or None when the step was skipped (a loss or that
    gradient norm not finite, on any process). The gradients are zeroed afterwards."""
    pairs = [(net, opt) for net, opt in nets if net is not None]
    finite = dist.all_agree(finite)  # torchrun: every process steps, or none does
    if finite:
        dist.sum_grads(*(net for net, _ in pairs))  # torchrun: the whole mini-batch's gradient, on every process
    norms = [torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).item() for net, _ in pairs]
    stepped = finite and math.isfinite(norms[0])
    for _, opt in pairs:
        if stepped:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return norms[0] if stepped else None


def sampler_gap(train_logp: torch.Tensor, batch: dict, mask: torch.Tensor, prefix: str = "") -> dict:
    """rollout/logprob_diff_mean and _max: how far the sampler's log-probs (batch["gen_logprobs"]) are from the
    trainer's on the sampled tokens: the train / inference mismatch of a bf16 or vLLM sampler. prefix "stale_": from
    the current policy's, on a batch sampled some updates ago (--rollout-reuse)."""
    gap = common.logprob_mismatch(train_logp, batch["gen_logprobs"], mask)
    return {f"rollout/{prefix}logprob_diff_mean": gap["mean"], f"rollout/{prefix}logprob_diff_max": gap["max"]}


class OnPolicy:
    """veRL's on-policy shortcut. An update that is one optimizer step (--ppo-epochs 1, every row in one mini-batch)
    cannot move the weights before its own forward pass, so that pass gives the old log-probs (every ratio 1) and the
    no-grad pass need not compute them. `applies` says when; an instance keeps the update pass's log-probs as the old
    ones, and afterwards their gap to the sampler's (what the no-grad pass would have logged)."""

    @staticmethod
    def applies(ppo_epochs: int, rows: int, mini_batch_size: int) -> bool:
        return ppo_epochs == 1 and rows <= mini_batch_size

    def __init__(self, mask: torch.Tensor):
        self.logp = torch.zeros_like(mask)  # (N, C)

    def old(self, logp: torch.Tensor, idx: torch.Tensor, cols: int) -> torch.Tensor:
        """The old log-probs of rows idx: this pass's own, (b, cols), without gradient."""
        old = logp.detach()
        self.logp[idx, :cols] = old
        return old

    def sampler_gap(self, batch: dict, mask: torch.Tensor) -> dict:
        all_rows(batch, self.logp)
        return sampler_gap(self.logp, batch, mask)


def means(stats: dict[str, list]) -> dict:
    """Every process's per-micro-batch values, averaged by name: critic/vf_... for the critic's, actor/... for the rest."""
    stats = dist.merge_lists(stats)
    return {("critic/" if k.startswith("vf_") else "actor/") + k: statistics.mean(v) for k, v in stats.items()}
