"""Several processes: `torchrun --nproc_per_node N starpo_x.py ...` (nanoGPT's pattern; across machines, torchrun's
--nnodes / --rdzv-endpoint). Without torchrun, or with N = 1, every function here returns at once and the scripts run
exactly as in one process.

What a step does with N ranks (the script reads the same; these functions do the talking):
  * each rank plays its block of the G groups (`block`), on its own engine, with request seeds that depend on the
    episode and never on N (--request-seeds, on whenever N > 1);
  * the episodes are gathered (`gather`): every rank holds the whole G x K batch, so every rank applies the same
    filter, the same group statistics and the same advantages, and skips an empty step together;
  * each rank scores and trains only the rows of its own groups; the no-grad passes' rows are summed across ranks
    (`share_rows`), and each optimizer step's gradients are summed (`sum_grads`), weighted by the global mini-batch's
    token count: the gradient is the one-process gradient. That is DDP's all-reduce, done once per optimizer step
    instead of per bucket during backward: one collective per optimizer step whatever each rank's row count, so a
    rank with fewer kept rows (or none) never leaves another waiting, and LoRA's frozen weights need no care;
  * rank 0 writes the metrics, rollouts, report and checkpoints (`is_main`); the others wait at a barrier.
On GPUs each rank uses the GPU LOCAL_RANK (nccl); on CPUs gloo.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    return int(os.environ.get("RANK", 0)) if world() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def active() -> bool:
    return world() > 1 and dist.is_available() and dist.is_initialized()


def init(device: str) -> None:
    """Join the process group (torchrun set RANK, WORLD_SIZE, MASTER_ADDR/PORT); a no-op in one process."""
    if world() == 1 or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def block(n: int) -> range:
    """This rank's share of n items, a contiguous block: ranks in order cover 0..n-1 (all of it in one process)."""
    r, w = rank(), world()
    return range(r * n // w, (r + 1) * n // w)


def played_here(groups: list[int], n_groups: int, device=None) -> torch.Tensor:
    """(rows,) bool: the rows this process trains, those of the groups (of the step's n_groups) it played (`block`);
    every row in one process. groups: each row's group."""
    mine = block(n_groups)
    return torch.tensor([g in mine for g in groups], dtype=torch.bool, device=device)


def gather(items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (pickled: episodes, metric lists)."""
    if not active():
        return items
    out = [None] * world()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def _device(t: torch.Tensor) -> torch.Tensor:
    return t if dist.get_backend() == "gloo" or t.is_cuda else t.cuda()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks, in place (SUM: portable to gloo, unlike AVG)."""
    if active():
        moved = _device(t)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        if moved is not t:
            t.copy_(moved)
    return t


def share_rows(t: torch.Tensor | None, mine: torch.Tensor) -> torch.Tensor | None:
    """t (N, ...) holds this rank's rows (mine: (N,) bool) and stale values elsewhere: every rank gets every rank's
    rows. Each row is filled on exactly one rank and zero on the others, so the sum is exact."""
    if t is None or not active():
        return t
    t[~mine] = 0
    return all_sum(t)


def all_agree(flag: bool) -> bool:
    """True on every rank when it is true on every rank (an update is made everywhere or nowhere)."""
    return not any_rank(not flag)


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on some rank (a stop signal seen by one rank stops all)."""
    if not active():
        return flag
    return bool(all_sum(torch.tensor([1.0 if flag else 0.0])).item() > 0)


def sum_grads(*nets) -> None:
    """Sum the trainable parameters' gradients over ranks, flattened into one buffer (one collective). A rank that
    trained no row contributes zeros."""
    if not active():
        return
    params = [p for net in nets if net is not None for p in net.parameters() if p.requires_grad]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    all_sum(flat)
    offset = 0
    for p in params:
        g = flat[offset : offset + p.numel()].view_as(p)
        p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
        offset += p.numel()


def merge_lists(stats: dict[str, list]) -> dict[str, list]:
    """Per-micro-batch metric lists from every rank, merged by key."""
    if not active():
        return stats
    merged: dict[str, list] = {}
    for part in gather([stats]):
        for k, v in part.items():
            merged.setdefault(k, []).extend(v)
    return merged


def barrier() -> None:
    if active():
        dist.barrier()


# Means over micro-batches (their split follows the rows each process holds) and the gradient norm (the order of a
# float sum): these differ with the number of processes; every other metric of a step does not.
VARY_WITH_PROCESSES = ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/pg_clipfrac", "critic/vf_loss")
VARY_WITH_PROCESSES += ("actor/grad_norm",)  # compared to a tolerance instead (tests/test_torchrun.py)
# The updated policy's log-probs on a reused batch (--rollout-reuse): its weights carry the float order of the sum.
VARY_WITH_PROCESSES += ("rollout/stale_logprob_diff_mean", "rollout/stale_logprob_diff_max")


# the metrics a run measures of its process (seconds, the clock, memory), not of its maths: never compared across runs
MEASURED = ("timing_s/", "time_s", "timestamp", "memory_gb/")


def differing_metrics(a: dict, b: dict) -> dict:
    """{key: (a's, b's)} for the metrics of row a that row b does not repeat, timings and VARY_WITH_PROCESSES aside:
    empty when two runs on different process counts agree as they should."""
    varies = lambda k: k.startswith(MEASURED) or k in VARY_WITH_PROCESSES
    return {k: (a[k], b.get(k)) for k in a if not varies(k) and a[k] != b.get(k)}


def launcher(processes: int) -> list[str]:
    """The command prefix that runs a script on `processes` local processes: torchrun for 2 or more (as `python -m
    torch.distributed.run`, so this venv's torch runs it), plain python for 1 (the tests and bench/gpu_smoke.py)."""
    if processes < 2:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def finish() -> None:
    if active():
        dist.barrier()
        vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
        if vllm_groups is None or not vllm_groups.model_parallel_is_initialized():
            dist.destroy_process_group()  # else the in-process vLLM engine destroys it with its own groups at exit
