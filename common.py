"""Shared maths and plumbing for the StarPO scripts.

Two halves, clearly separated:

* MATHS: small pure torch functions (advantages, clipping, filtering, KL, aggregation). They follow veRL's
  semantics (verl.trainer.ppo.core_algos) and each is tested against a plain-Python reference
  and hand-worked cases in `tests/test_common.py`. Read them; they are the algorithm.
* PLUMBING: flags (parse_args, from flags.py), faster KV caches for generation, the embedded tiny model, metrics
  files. Learners never need to edit these.

Shapes: B = sequences in the batch, T = token positions, G = groups, n = group size, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import typing
from pathlib import Path

import numpy as np
import torch

from flags import parse_args  # noqa: F401  (flag parsing lives in flags.py, which loads without torch)

########################################################################################################################
# MATHS
########################################################################################################################


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under softmax(logits / temperature).

    Dividing by the sampling temperature matters: the sampler drew tokens from the tempered distribution, so
    the ratio pi_new / pi_old is exactly 1 on-policy only if the update uses the same temperature.
    logits: (B, T, V), tokens: (B, T) -> (B, T).
    """
    z = logits.float() / temperature  # (B, T, V)
    picked = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(z, dim=-1)  # (B, T); avoids materialising a second (B, T, V) tensor


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum(softmax(z) * z). (..., V) -> (...).

    Pass logits already divided by the temperature to get the entropy of the sampling distribution.
    """
    z = logits.float()
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


def padded_tokens(plan: list[torch.Tensor], first_len, rest_len, group) -> int:
    """The tokens a plan's micro-batches run: each distinct first prompt once, every row padded to its micro-batch's
    longest rest (micro_batch_plan's cost, less its fixed cost per pass)."""
    first, rest, groups = (torch.as_tensor(x).tolist() for x in (first_len, rest_len, group))
    return sum(
        len({groups[i] for i in p.tolist()}) * max(first[i] for i in p.tolist())
        + len(p) * max(rest[i] for i in p.tolist())
        for p in plan
    )


def micro_batch_plan(first_len, rest_len, group, max_rows: int, overhead: int = 64) -> list[torch.Tensor]:
    """Cut rows into micro-batches of at most max_rows that pad the fewest tokens. Returns index tensors into the
    given rows (every row exactly once; each micro-batch's rows in group order).

    A micro-batch runs each distinct first prompt once and pads every row's rest to its longest, so it costs
    (distinct groups) x (longest first prompt) + rows x (longest rest) tokens, plus `overhead` tokens' worth of fixed
    cost per pass. Multi-turn rest lengths are ragged (one turn played or five: 40 to 570 tokens on the tiny
    FrozenLake), and one micro-batch of them is mostly padding (2-3x the real tokens). Rows sorted by rest length
    are cut into contiguous runs by dynamic programming: the cheapest cut of that order. The gradient is the same
    (micro_batch_weight makes any split add up to the mini-batch loss); only the float summation order changes.
    first_len, rest_len, group: (n,) each, tensors or lists.
    """
    first, rest, groups = (torch.as_tensor(x).tolist() for x in (first_len, rest_len, group))
    order = sorted(range(len(rest)), key=lambda i: (rest[i], groups[i]))
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)  # best[j]: cheapest plan of order[:j]
    for j in range(1, len(order) + 1):
        seen, longest_first = set(), 0
        for i in range(j - 1, max(j - max_rows, 0) - 1, -1):  # the last micro-batch is order[i:j]
            seen.add(groups[order[i]])
            longest_first = max(longest_first, first[order[i]])
            cost = best[i] + len(seen) * longest_first + (j - i) * rest[order[j - 1]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    plan, j = [], len(order)
    while j > 0:
        rows = sorted(order[cut[j] : j], key=lambda i: (groups[i], i))
        plan.append(torch.tensor(rows, dtype=torch.long))
        j = cut[j]
    return plan[::-1]


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


def filter_groups(scores: torch.Tensor, keep_ratio: float, mode: str = "std") -> torch.Tensor:
    """StarPO-S's uncertainty filter: indices (ascending) of the groups to train on. scores: (G, n).

    Groups are ranked by the std of trajectory reward inside the group (high std = the policy is unsure
    there, so there is something to learn). "std" keeps the top keep_ratio of groups, "std_rev" the lowest.
    At least one group is kept. Ties go to the lower group index, so the result is deterministic.
    """
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if mode not in ("std", "std_rev"):
        raise ValueError(f"unknown filter mode {mode!r}; choose 'std' or 'std_rev'")
    G, n = scores.shape
    std = scores.double().std(dim=1, unbiased=True).tolist() if n > 1 else [0.0] * G
    std = [round(x, 9) for x in std]  # equal groups in another order can differ in the last bit: keep them tied
    k = max(1, int(G * keep_ratio + 1e-9))  # the epsilon keeps 0.29 * 100 from flooring to 28
    sign = -1.0 if mode == "std" else 1.0
    ranked = sorted(range(G), key=lambda g: (sign * std[g], g))
    return torch.tensor(sorted(ranked[:k]), dtype=torch.long)


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


########################################################################################################################
# PLUMBING — learners never need to edit below this line
########################################################################################################################


def fail(flag: str, message: str) -> typing.NoReturn:
    """Print one line naming the bad flag and exit with status 2 (argparse's convention), before any model loads."""
    print(f"error: {flag}: {message}", file=sys.stderr)
    raise SystemExit(2)


def busy_cores_elsewhere(seconds: float = 0.5) -> float | None:
    """How many cores other processes kept busy over the next `seconds`: the machine's busy time (/proc/stat) minus
    this process's own. None where /proc is missing (macOS, Windows)."""

    def sample():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0), time.process_time()

    try:
        (busy0, own0), t0 = sample(), time.time()
        time.sleep(seconds)
        (busy1, own1), wall = sample(), time.time() - t0
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((busy1 - busy0) / hz - (own1 - own0)) / wall)


def thread_policy(environ=os.environ, busy_elsewhere=busy_cores_elsewhere) -> str:
    """Choose torch's CPU threads at start and say what was chosen (the start-up line prints it).

    torch's default, one thread per core with OpenMP's spin-waiting, is fastest on an idle machine but collapses
    beside other jobs: threads that spin while waiting for a descheduled sibling make a step 3-4x slower than one
    thread (bench/results/threads_cpu.json). So: measure for half a second how many cores other processes keep
    busy, and use the cores this process may run on minus those (at least one). OMP_NUM_THREADS or
    STARPO_THREADS=N (a number, or 'off' to leave torch alone) override it. The choice is made once, at start.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    forced = environ.get("STARPO_THREADS", "")
    if forced == "off" or (not forced and environ.get("OMP_NUM_THREADS")):
        return f"{torch.get_num_threads()} (as set by the environment)"
    if forced:
        try:
            n = max(1, int(forced))
        except ValueError:
            fail("STARPO_THREADS", f"must be a number of threads or 'off', got {forced!r}")
        torch.set_num_threads(n)
        return f"{n} (STARPO_THREADS)"
    busy = busy_elsewhere() if cores > 1 else None
    n = cores if busy is None else max(1, min(cores, round(cores - busy)))
    torch.set_num_threads(n)
    seen = "" if busy is None else f", other processes busy on {busy:.1f}"
    return f"{n} of {cores} cores{seen}"


def keep_freed_memory(environ=os.environ, libc=None) -> bool:
    """Tell glibc's malloc to keep freed memory in the process instead of handing it back to the system.

    glibc serves a large block (the KV caches, the update's activations) with a fresh mmap and unmaps it when freed,
    so the next step's tensors land on new pages, each faulted in and zeroed by the kernel; on a virtual machine
    that returns freed pages to its host (this project's), the first touch costs more still. With mmap off
    (M_MMAP_MAX 0) and no trimming below 2 GiB free (M_TRIM_THRESHOLD), the process reuses its own heap: with the
    NaN fill off too (seed_everything), default steps 6% (FrozenLake), 7% (Sokoban) and 4% (bandit) faster, the same
    episodes bit for bit, peak memory up to 9% higher (bench/results/cpu_memory.json). A malloc setting of your own
    (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_) wins; without glibc
    (macOS, musl, Windows) nothing changes. Returns whether the setting was made.
    """
    if any(
        environ.get(k)
        for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
    ):
        return False
    if libc is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return False
    mallopt = getattr(libc, "mallopt", None)  # glibc only
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def seed_everything(seed: int, device: str | None = None) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device == "cpu":  # bit-for-bit reproducible CPU runs (resume == uninterrupted, tested): without this the
        torch.use_deterministic_algorithms(True)  # backward of an index with repeats sums in thread order
        # ... but not its debugging aid, which writes NaN into every new tensor before use (each KV-cache buffer,
        # every activation): 2.5% of a FrozenLake step (bench/results/cpu_memory.json). Nothing reads memory it did
        # not write, so the results are the same bits (the resume tests; the benchmark's runs play the same episodes).
        torch.utils.deterministic.fill_uninitialized_memory = False


def model_is_reachable(model_id: str) -> bool:
    """True if `model_id` is a local directory, is in the Hugging Face cache, or (when online) its config downloads."""
    if os.path.isdir(model_id):
        return True
    try:
        from huggingface_hub import hf_hub_download

        hf_hub_download(model_id, "config.json", local_files_only=True)
        return True
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    # One quick HEAD first, with no retries and huggingface_hub's logger and warnings muted: offline, hf_hub_download
    # alone retries with backoff for about 25 s and prints ~11 "Retrying in ..." lines before the caller's one-line
    # error. get_hf_file_metadata does not retry (and sends the saved token, so gated models behave as before).
    import logging
    import warnings

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        hub_logger.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            get_hf_file_metadata(hf_hub_url(model_id, "config.json"), timeout=5)
    except Exception:
        return False
    finally:
        hub_logger.setLevel(level)
    try:  # reachable: download the config as before (it lands in the cache)
        from huggingface_hub import hf_hub_download

        hf_hub_download(model_id, "config.json", etag_timeout=5)
        return True
    except Exception:
        return False


class Metrics:
    """Appends one JSON object per line to `path` (flushed every write so a crashed run keeps its history)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        clean = {k: (float(v) if isinstance(v, (np.floating, torch.Tensor)) else v) for k, v in record.items()}
        self._f.write(json.dumps(clean, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


#### Generation plumbing ###############################################################################################


def append_in_place_cache():
    """A transformers DynamicCache whose layers append each new token in place, into a buffer with room to spare.

    transformers' DynamicLayer appends with torch.cat, which copies the whole cache at every generated token; on the
    bandit's 32-reply batch that copy was 55% of generation time (torch.profiler, CPU). Here a layer copies only
    when its buffer doubles, and `keys` / `values` stay what transformers reads: the filled part, as a view. Any
    other change to them (batch_select_indices) is noticed and starts a new buffer. Used for generation only.
    """
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    class AppendInPlace(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.get_seq_length()
            new = n + key_states.shape[-2]
            buf = getattr(self, "buffers", None)
            if buf is None or self.keys.data_ptr() != buf[0].data_ptr() or new > buf[0].shape[-2] or n == 0:
                old = (self.keys, self.values) if n else (key_states[..., :0, :], value_states[..., :0, :])
                buf = tuple(x.new_empty(*x.shape[:-2], 2 * new, x.shape[-1]) for x in (key_states, value_states))
                for b, o in zip(buf, old):
                    b[..., :n, :] = o
                self.buffers = buf
            buf[0][..., n:new, :], buf[1][..., n:new, :] = key_states, value_states
            self.keys, self.values = buf[0][..., :new, :], buf[1][..., :new, :]
            return self.keys, self.values

    cache = DynamicCache()
    Cache.__init__(cache, layer_class_to_replicate=AppendInPlace)
    return cache


def decode_attention(query, key, value, mask=None, scale=None) -> torch.Tensor:
    """Attention of one new token per row over its KV cache, as two batched matrix products with grouped-query heads.

    query (B, H, 1, d); key, value (B, K, L, d) with H a multiple of K; mask (B or 1, 1, 1, L) bool, True = attend,
    or None. Returns (B, H, 1, d); the scores and their softmax are float32. Used for bf16 decode steps on a CPU:
    there torch's flash kernel (scaled_dot_product_attention) took 4.6-10.6 ms for one step of 64 rows x 300-700
    cached tokens, this 0.8-2.1 ms (float32's kernel: 1.0-2.2 ms; bench/decode_attention.py). The keys and values are views into append_in_place_cache's
    bigger buffer, and a bf16 matrix product copies such a view into a contiguous block first (what is left of a bf16
    rollout is mostly those copies); key @ q measured faster than q @ key^T here.
    """
    b, h, _, d = query.shape
    k = key.shape[1]
    q = query.reshape(b, k, h // k, d)  # (B, K, g, d): the g query heads that share key/value head K
    scores = (key @ q.transpose(-1, -2)).transpose(-1, -2).float()  # (B, K, g, L)
    scores = scores * (d**-0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, -1), float("-inf"))  # (B or 1, 1, 1, L)
    return (scores.softmax(-1).to(value.dtype) @ value).reshape(b, h, 1, d)  # (B, H, 1, d)


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, with grouped-query attention left to torch (enable_gqa) instead of repeat_kv.

    A bf16 (or fp16) decode step goes to decode_attention instead: torch's CPU kernel is 2.4-5x slower there."""
    decode = query.shape[2] == 1 and query.dtype != torch.float32 and dropout == 0.0
    if decode and (attention_mask is None or attention_mask.dtype == torch.bool):
        out = decode_attention(query, key, value, attention_mask, scaling)  # (B, H, 1, d)
        return out.transpose(1, 2).contiguous(), None
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    groups = getattr(module, "num_key_value_groups", 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=groups > 1,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def attention_implementation(device: str) -> str:
    """The attention the scripts load their models with (attn_implementation=): "sdpa_gqa" on a CPU, else "sdpa".

    With a padding mask, transformers' sdpa copies every key/value head once per query head (repeat_kv) in every
    layer at every step; in a decode step that copy is the whole KV cache. On a CPU torch's own grouped-query
    attention (enable_gqa) needs no copy: one tiny-model decode step's attention (64 episodes x 500 tokens) took
    5.5 ms instead of 35 ms. On CUDA torch would fall back to its slow math kernel with a mask, so "sdpa" stays.
    """
    if device != "cpu":
        return "sdpa"
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("sdpa_gqa", _sdpa_gqa)
    AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)  # the same boolean masks sdpa gets
    return "sdpa_gqa"


def resolve_precision(precision: str, device: str) -> str:
    """--precision auto -> "bf16" on a CUDA device that supports it, else "fp32"; "bf16" and "fp32" pass through.

    A CPU stays in float32 unless you ask: on this project's 2-core Xeon (AMX-BF16) bf16 made the tiny model's update
    2.2x and a turn's generation 1.8x faster in isolation, yet 20 real FrozenLake training steps took 10.6 s each in
    bf16 against 10.4 s in float32, and the bandit's 0.79 s against 0.86 s (bench/results/cpu_bf16.json,
    frozenlake_20steps_*.json, bandit_cpu*.json). CPUs without AMX-BF16 or AVX512-BF16 emulate bf16, slower still.
    """
    if precision != "auto":
        return precision
    return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


class TurnCache:
    """Each live episode's KV cache from one turn to the next of a multi-turn rollout (hf backend).

    A turn's prompt is the previous turn's prompt + its reply + the new observation, so hf_generate needs to prefill
    only the observation: it stores every reply's cache here (`put`) and looks a prompt up before prefilling it
    (`take`: the longest stored token sequence that is a strict prefix of the prompt). The cache stays exact: the
    keys and values are those the model computed for the same tokens at the same positions. One rollout owns one
    TurnCache, so a cache never outlives the weights that made it. What one generate call stores replaces
    everything stored before (`commit`): only the episodes that just got a reply can continue. With
    --max-context-turns the prompt drops old turns and is no longer an extension: it misses and is prefilled whole.
    """

    TAIL = 8  # entries are found by (length, last TAIL ids), then compared in full

    def __init__(self):
        self.entries: dict = {}  # (len, tail) -> [(ids, [(keys, values) per layer])]
        self.pending: dict = {}  # what the current generate call stores
        self.hits = self.misses = 0  # prompts continued from a stored cache / prefilled whole

    def take(self, prompt: list[int]) -> tuple[int, list | None]:
        """(c, per-layer [(K (heads, c, d), V)]) for the longest stored strict prefix of prompt, or (0, None)."""
        for n in sorted({n for n, _ in self.entries if n < len(prompt)}, reverse=True):
            for ids, kv in self.entries.get((n, tuple(prompt[max(0, n - self.TAIL) : n])), ()):
                if prompt[:n] == ids:
                    self.hits += 1
                    return n, kv
        self.misses += 1
        return 0, None

    def put(self, ids: list[int], kv: list) -> None:
        """Store the cache of `ids` (kv: per layer (K (heads, len(ids), d), V)) for the next call."""
        self.pending.setdefault((len(ids), tuple(ids[-self.TAIL :])), []).append((list(ids), kv))

    def commit(self) -> None:
        self.entries, self.pending = self.pending, {}


def cache_from_rows(rows: list[tuple[int, list | None]], device) -> tuple[object, torch.Tensor]:
    """A generation cache holding each row's stored past, left-padded to the longest: (cache, past mask (u, W)).

    rows: what TurnCache.take returned for each prompt of the batch ((0, None) where nothing was stored). Padding
    columns are zeros, masked out. W == 0 (no row has a past) gives an empty cache.
    """
    width = max(n for n, _ in rows)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # (u, W)
    cache = append_in_place_cache()
    if width == 0:
        return cache, mask
    some = next(kv for _, kv in rows if kv is not None)
    for layer, (k0, v0) in enumerate(some):
        keys = k0.new_zeros((len(rows), k0.shape[0], width, k0.shape[-1]))  # (u, heads, W, d)
        values = v0.new_zeros((len(rows), v0.shape[0], width, v0.shape[-1]))
        for j, (n, kv) in enumerate(rows):
            if kv is not None:
                keys[j, :, width - n :], values[j, :, width - n :] = kv[layer]
        cache.update(keys, values, layer)
    for j, (n, _) in enumerate(rows):
        mask[j, width - n :] = 1
    return cache, mask


def cache_row(cache, row: int, columns: torch.Tensor) -> list:
    """One row's keys and values at the given cache columns, per layer: [(K (heads, len(columns), d), V)].

    Indexing with a tensor copies, so the row no longer holds the batch's buffers alive."""
    return [(layer.keys[row][:, columns], layer.values[row][:, columns]) for layer in cache.layers]


#### The embedded tiny model ###########################################################################################
# A few-million-parameter Qwen2-architecture causal LM with a byte-level BPE tokenizer trained on the task's own
# text and Qwen's chat format (<|im_start|>role ... <|im_end|>). It is saved with save_pretrained, so
# AutoModelForCausalLM, AutoTokenizer and vLLM load it like any Hugging Face model. Each script hands in warm-up
# transcripts whose answers are uniformly random valid ones: the model learns the reply format, not the task.

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VERSION = 2  # bump when the recipe changes so stale caches are rebuilt


# The multi-turn tiny models ship with the repository (tiny/, written by `python tools/ship_tiny.py`): their builds
# take 6-10 minutes on two cores; the bandit's, 1.5 minutes, happens on first use. A shipped model is used only
# when its name carries the key of today's recipe and warm-up data, so an edited prompt still builds its own.
SHIPPED_TINY = Path(__file__).resolve().parent / "tiny"


def tiny_cache_root() -> Path:
    return Path(os.environ.get("STARPO_CACHE", Path.home() / ".cache" / "starpo"))


def tiny_recipe(
    seed, vocab_size, hidden_size, num_layers, sft_steps, sft_batch_size, sft_lr, reading_steps=0, reading_lr=1e-3
) -> dict:
    """What a tiny model's build depends on besides its warm-up data (TINY_VERSION and torch's version included)."""
    spec = dict(seed=seed, vocab=vocab_size, hidden=hidden_size, layers=num_layers)
    recipe = dict(
        v=TINY_VERSION, **spec, steps=sft_steps, bs=sft_batch_size, lr=sft_lr, torch=torch.__version__.split("+")[0]
    )
    if reading_steps:  # only then: the keys of models built without a reading stage stay what they were
        recipe["reading"] = dict(
            steps=reading_steps,
            bs=READING_BATCH,
            lr=reading_lr,
            len=READING_LEN,
            replay=READING_REPLAY,
            plain=READING_PLAIN,
        )
    return recipe


# The reading stage: before its task warm-up, a tiny model can be pretrained on random token strings that only
# in-context copying answers, so that it can read its prompt at all. A from-scratch model warmed up on the task alone
# learns the reply's shape, not its content: it has no induction heads (no way to say "the token that followed this
# one last time"), and restating a cell or looking up a move needs exactly that. Task-agnostic: strings of random
# ordinary tokens of the model's own vocabulary, never the task's text, its states or its moves.
READING_BATCH, READING_LEN = 32, 160  # strings per step, longest string (tokens)
READING_REPLAY = 16  # reading strings added to every step of the task warm-up that follows
READING_PLAIN = 0.7  # share of the stage's first steps without induction strings (see reading_stage)


def reading_sample(rng: random.Random, vocab: list[int], sep: int, arrow: int, length: int = READING_LEN, kinds=3):
    """One reading string and its 0/1 loss mask (1 exactly where in-context copying determines the next token).

    One of the first `kinds` of READING_KINDS, equally likely: copy, `s <sep> s` with s random (the second s is
    trained); recall, key-value pairs of random tokens, `<sep>`, then queries `k <arrow> v` for some of the keys
    (each v trained); induction, random tokens in which a few bigrams `k v` (k seen nowhere else) recur in the
    second half, the recurring v trained: "the token that followed this one last time", with no marker to lean on.
    `vocab`: the ordinary token ids the strings are drawn from; `sep` and `arrow`: markers outside it."""
    kind = rng.randrange(kinds)
    if kind == 0:
        n = rng.randint(4, (length - 1) // 2)
        s = [rng.choice(vocab) for _ in range(n)]
        return s + [sep] + s, [0] * (n + 1) + [1] * n
    if kind == 1:
        n = rng.randint(2, min(24, (length - 1) // 5, len(vocab)))
        keys, values = rng.sample(vocab, n), [rng.choice(vocab) for _ in range(n)]
        ids = [x for kv in zip(keys, values) for x in kv] + [sep]
        mask = [0] * len(ids)
        for q in rng.sample(range(n), min(n, 6)):
            ids, mask = ids + [keys[q], arrow, values[q]], mask + [0, 0, 1]
        return ids, mask
    n = rng.randint(30, length)
    slots = range(0, n // 2 - 1, 2)  # even slots in the first half: two first occurrences never overlap
    m = rng.randint(2, min(8, len(slots), len(vocab) // 2))
    keys = rng.sample(vocab, m)
    others = [t for t in vocab if t not in keys]
    ids, mask = [rng.choice(others) for _ in range(n)], [0] * n
    values = [rng.choice(others) for _ in range(m)]
    for k, i, v in zip(keys, rng.sample(slots, m), values):
        ids[i], ids[i + 1] = k, v
    for k, v in zip(keys, values):
        j = rng.randrange(n // 2, n - 1)
        if {ids[j - 1], ids[j], ids[j + 1]} & set(keys) or mask[j] or mask[j + 1]:
            continue  # a slot another recurrence already uses
        ids[j], ids[j + 1], mask[j + 1] = k, v, 1
    if not any(mask):
        ids[n - 2], ids[n - 1], mask[n - 1] = keys[0], values[0], 1
    return ids, mask


READING_KINDS = ("copy", "recall", "induction")


def reading_kind(ids: list[int], sep: int, arrow: int) -> str:
    return "recall" if arrow in ids else "copy" if sep in ids else "induction"


def reading_probe(model, vocab: list[int], sep: int, arrow: int, n: int = 128, seed: int = 10**6) -> dict:
    """Held-out in-context copying, teacher-forced: for each kind of reading string (READING_KINDS), the share of
    the trained tokens of n strings (drawn from their own seed, never trained on) whose most likely next token is right."""
    rng, device, out = random.Random(seed), next(model.parameters()).device, {}
    strings = {kind: [] for kind in READING_KINDS}
    while min(len(v) for v in strings.values()) < n:
        ids, mask = reading_sample(rng, vocab, sep, arrow)
        kind = strings[reading_kind(ids, sep, arrow)]
        if len(kind) < n:
            kind.append((ids, mask))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for kind, rows in strings.items():
            input_ids, labels, attn = (x.to(device) for x in sft_batch(rows, 0))
            guess = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1].argmax(-1)  # (B, T - 1)
            target = labels[:, 1:]
            trained = target != -100
            out[kind] = round(((guess == target) & trained).sum().item() / trained.sum().item(), 4)
    model.train(was_training)
    return out


def reading_stage(model, vocab: list[int], sep: int, arrow: int, steps: int, lr: float, seed: int = 0, log=print):
    """Train on fresh reading strings (reading_sample), READING_BATCH a step: AdamW, 50 warm-up steps, then a constant
    rate (copying forms abruptly, late: a decaying rate would delay it). Copy and recall strings only for the first
    READING_PLAIN of the steps, then induction strings too: mixed in from the start they slow everything down (a
    trial: copy 0.25 after 1,800 steps), once copying has formed they are learned in a few hundred. Returns
    reading_probe's figures at the end.

    A scratch trial on the 3.3M FrozenLake model (idle 2-core CPU, 0.56 s a step), copy and recall only: held-out copy
    accuracy 0.07 at step 600, 0.54 at 1,000, 0.98 at 1,200 (recall 0.04, 0.09, 0.98): a phase change, as induction
    heads form; plain induction was then 0.27, and 0.81 after 400 more steps with induction strings."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    rng, t0 = random.Random(seed), time.time()
    model.train()
    for step in range(1, steps + 1):
        kinds = 2 if step <= READING_PLAIN * steps else 3
        rows = [reading_sample(rng, vocab, sep, arrow, kinds=kinds) for _ in range(READING_BATCH)]
        input_ids, labels, attn = (x.to(device) for x in sft_batch(rows, 0))
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, steps // 10) == 0 or step == steps:
            spent = time.time() - t0
            probe = reading_probe(model, vocab, sep, arrow, n=32)
            scores = "  ".join(f"{kind} {probe[kind]:.2f}" for kind in READING_KINDS)
            log(
                f"  reading step {step:5d}/{steps}  loss {loss.item():.3f}  {scores}  "
                f"({spent:.0f}s, ~{spent / step * (steps - step):.0f}s left)"
            )
    model.eval()
    return reading_probe(model, vocab, sep, arrow)


def cached_reading_stage(model, recipe: dict, vocab: list[int], marks: tuple[int, int], log=print) -> dict:
    """reading_stage(model, vocab, *marks, ...) with the recipe's steps, rate and seed, run once per cache.

    What it leaves depends only on the model's shape, the seed, the recipe and the token ids it draws (random
    strings: never what the tokens spell), so every task whose tokenizer has as many ids reuses one run: a task's
    second build (a new warm-up, another script) costs the warm-up alone. Kept in the cache as
    reading-<hash>/weights.pt and reading.json (the probe, the seconds the stage took); on reuse the figures say
    "reused": true. Returns reading_probe's figures and the seconds."""
    spec = {k: v for k, v in recipe.items() if k not in ("steps", "bs", "lr")}  # not the task warm-up's
    digest = hashlib.sha256(json.dumps([spec, list(marks), vocab], sort_keys=True).encode()).hexdigest()[:12]
    folder = tiny_cache_root() / f"reading-{digest}"
    if (folder / "reading.json").exists():
        model.load_state_dict(torch.load(folder / "weights.pt", map_location="cpu", weights_only=True))
        model.eval()
        log(f"  reading stage reused from {folder}")
        return dict(json.loads((folder / "reading.json").read_text()), reused=True)
    r0, reading = time.time(), spec["reading"]
    result = dict(reading_stage(model, vocab, *marks, reading["steps"], reading["lr"], spec["seed"], log))
    result["seconds"] = round(time.time() - r0, 1)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(model.state_dict(), tmp / "weights.pt")
    (tmp / "reading.json").write_text(json.dumps(result, indent=1))  # written last: it marks the folder whole
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _tiny_folder(name: str, recipe: dict, examples: list) -> str:
    return f"tiny-{name}-{hashlib.sha256(json.dumps([recipe, examples], sort_keys=True).encode()).hexdigest()[:12]}"


def tiny_model_name(name: str, examples: list, **build_kwargs) -> str:
    """The folder build_tiny_model(name, examples, **build_kwargs) builds into: tiny-<name>-<hash of recipe + data>."""
    bound = inspect.signature(build_tiny_model).bind(name, examples, **build_kwargs)
    bound.apply_defaults()
    kw = {k: v for k, v in bound.arguments.items() if k not in ("name", "examples", "log")}
    return _tiny_folder(name, tiny_recipe(**kw), examples)


def sft_batch(rows: list[tuple[list[int], int | list[int]]], pad_id: int):
    """(token ids, prompt length or 0/1 loss mask) rows -> right-padded input_ids, labels, attention_mask, (B, T)
    each. Labels are -100 (ignored by the loss) on the prompt (or where the mask is 0) and on the padding."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, trained) in enumerate(rows):
        mask = [int(j >= trained) for j in range(len(ids))] if isinstance(trained, int) else trained
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        attn[i, : len(ids)] = 1
    return input_ids, labels, attn


def sft_rows(tok, examples: list[tuple[list[dict], str]]) -> list[tuple[list[int], list[int]]]:
    """Warm-up (chat messages, reply) pairs -> (token ids, 0/1 loss mask) rows, tokenized piece by piece exactly as
    the scripts' rollouts build a conversation: the chat template up to the first reply, then each reply plus
    <|im_end|>, and each later message as "\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n". So the ids
    are the ones RL will see, boundaries included. The loss sees every reply (earlier ones in the messages too)
    and its <|im_end|>, nothing else: a multi-turn episode is one row."""
    im_end, rows = tok.convert_tokens_to_ids("<|im_end|>"), []
    for msgs, reply in examples:
        chat = list(msgs) + [{"role": "assistant", "content": reply}]
        first = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
        prompt = tok.apply_chat_template(chat[:first], add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
        for m in chat[first:]:
            if m["role"] == "assistant":
                piece, trained = tok(m["content"], add_special_tokens=False)["input_ids"] + [im_end], 1
            else:
                text = f"\n<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n<|im_start|>assistant\n"
                piece, trained = tok(text, add_special_tokens=False)["input_ids"], 0
            ids, mask = ids + piece, mask + [trained] * len(piece)
        rows.append((ids, mask))
    return rows


def token_ids_digest(rows: list[tuple[list[int], list[int]]]) -> str:
    """A hash of tokenized warm-up rows, kept in build_info.json: a test re-tokenizes with the scripts' tokenizer."""
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def sft(
    model,
    rows,
    steps: int,
    batch_size: int,
    lr: float,
    pad_id: int,
    seed: int = 0,
    log=print,
    device="cpu",
    replay=None,
):
    """Supervised fine-tuning on sft_batch rows (token ids, prompt length or 0/1 loss mask): AdamW, 10 warm-up steps,
    cosine decay, gradient clip 1. Batches are drawn with replacement from random.Random(seed). Logs a line every
    tenth of the steps with the time left; returns the last loss. Used by the tiny-model build and --warmup-steps.
    replay: None, or a function returning more rows whose loss joins every step's gradient (the reading stage's
    strings during a tiny model's task warm-up: without them the task wipes the copying out)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    rng, t0, loss = random.Random(seed), time.time(), torch.tensor(float("nan"))
    model.train()
    for step in range(steps):
        input_ids, labels, attn = (
            x.to(device) for x in sft_batch([rows[rng.randrange(len(rows))] for _ in range(batch_size)], pad_id)
        )
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        if replay is not None:  # a pass of its own: short strings are not padded to the task's length
            input_ids, labels, attn = (x.to(device) for x in sft_batch(replay(), pad_id))
            model(input_ids=input_ids, attention_mask=attn, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, steps // 10) == 0 or step == steps - 1:  # a line every tenth: never silent for long
            spent = time.time() - t0
            left = spent / (step + 1) * (steps - step - 1)
            log(f"  warm-up step {step + 1:4d}/{steps}  loss {loss.item():.3f}  ({spent:.0f}s, ~{left:.0f}s left)")
    model.eval()
    return loss


def build_tiny_model(
    name: str,
    examples: list[tuple[list[dict], str]],
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 256,
    num_layers: int = 4,
    sft_steps: int = 60,
    sft_batch_size: int = 32,
    sft_lr: float = 3e-3,
    reading_steps: int = 0,
    reading_lr: float = 1e-3,
    log=print,
) -> Path:
    """Build (or reuse from the cache) the embedded tiny model for one task and return its directory.

    examples: (chat messages, assistant reply) pairs for the format warm-up. The cache key hashes the examples
    and the recipe, so editing the prompt rebuilds the model; the build is deterministic from `seed`. A build in
    the cache wins; else one shipped in the repository's tiny/ under the same name; else it is built here.
    """
    recipe = tiny_recipe(
        seed, vocab_size, hidden_size, num_layers, sft_steps, sft_batch_size, sft_lr, reading_steps, reading_lr
    )
    out = tiny_cache_root() / _tiny_folder(name, recipe, examples)
    for found in (out, SHIPPED_TINY / out.name):  # a build of your own first, then the repository's
        if (found / "build_info.json").exists():
            return found

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    transformers.utils.logging.disable_progress_bar()  # our own lines say how far the build is

    t0 = time.time()
    log(f"building the embedded tiny model '{name}' in {out} (first run only) ...")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Tokenizer: byte-level BPE (any string, even model garbage, round-trips exactly), trained with the normaliser
    # and pre-tokeniser of Qwen2Tokenizer, which is what AutoTokenizer returns for this model: one digit per piece,
    # a space before a digit a piece of its own. Training with GPT-2's regex instead learns merges such as " 10"
    # that the loaded tokenizer never applies, so the numbers RL sees would be token sequences the warm-up never showed.
    qwen = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer, bpe.pre_tokenizer, bpe.decoder = qwen.normalizer, qwen.pre_tokenizer, decoders.ByteLevel()
    corpus = [m["content"] for msgs, _ in examples for m in msgs] + [reply for _, reply in examples]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tmp.mkdir(parents=True)
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TINY_CHAT_TEMPLATE
    ).save_pretrained(tmp)
    specials = {t: bpe.token_to_id(t) for t in TINY_SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=specials["<|endoftext|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
    )
    config.save_pretrained(tmp)  # before loading the tokenizer back: AutoTokenizer picks its class from it
    # One tokenizer: the warm-up is tokenized by exactly what the scripts load (AutoTokenizer on the saved folder).
    tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    for text in corpus[:: max(1, len(corpus) // 200)]:
        if tok(text, add_special_tokens=False)["input_ids"] != bpe.encode(text).ids:
            raise RuntimeError(f"the reloaded tokenizer ({type(tok).__name__}) disagrees with the trained one")

    rows = sft_rows(tok, examples)
    max_len = max(len(ids) for ids, _ in rows)

    seed_everything(seed)
    model = Qwen2ForCausalLM(config)
    reading, replay = {}, None
    if reading_steps:  # in-context copying first (see reading_stage), on random strings of the ordinary tokens
        vocab = [i for i in range(config.vocab_size) if i not in specials.values()]
        marks = specials["<|endoftext|>"], specials["<|im_start|>"]
        reading = cached_reading_stage(model, recipe, vocab, marks, log)
        replay_rng = random.Random(seed + 1)  # then replayed during the task warm-up, which would wipe it out
        replay = lambda: [reading_sample(replay_rng, vocab, *marks) for _ in range(READING_REPLAY)]  # noqa: E731
    loss = sft(model, rows, sft_steps, sft_batch_size, sft_lr, tok.pad_token_id, seed, log, replay=replay)
    if reading_steps:  # what the task warm-up left of it
        reading["after_warmup"] = reading_probe(model, vocab, *marks)

    # Neutral sampling defaults: scripts always pass their own temperature / top_p / top_k.
    model.generation_config.do_sample = True
    model.generation_config.temperature, model.generation_config.top_p, model.generation_config.top_k = 1.0, 1.0, 0
    model.save_pretrained(tmp)
    info = dict(
        recipe,
        name=name,
        params=sum(p.numel() for p in model.parameters()),
        max_len=max_len,
        warmup_ids_sha256=token_ids_digest(rows),
        final_sft_loss=round(loss.item(), 4),
        **({"reading_probe": reading} if reading else {}),
        build_seconds=round(time.time() - t0, 1),
    )
    (tmp / "build_info.json").write_text(json.dumps(info, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)  # atomic: a half-built model never sits at the final path
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"  tiny model ready: {info['params'] / 1e6:.1f}M parameters, {info['build_seconds']}s")
    return out


#### Run directory, checkpoints and resume #############################################################################
# checkpoints/step-000040/ holds policy/ (a save_pretrained model + tokenizer, loadable on its own), state.pt (critic,
# optimizers, RNG states, step, history) and COMPLETE, written last. It is built under a temporary name and renamed
# into place, so a crash mid-save never leaves a half checkpoint that looks whole.


def prepare_run_dir(out_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run. Refuses to mix two runs in one directory."""
    out_dir = Path(out_dir)
    has_run = (out_dir / "metrics.jsonl").exists() or (out_dir / "checkpoints").exists()
    if resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            fail("--resume", f"no complete checkpoint under {out_dir / 'checkpoints'}")
        return ckpt
    if has_run and not overwrite:
        fail(
            "--output-dir", f"{out_dir} already holds a run; pass --resume to continue it or --overwrite to replace it"
        )
    for name in ("metrics.jsonl", "rollouts.jsonl", "report.html", "config.json"):
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    shutil.rmtree(out_dir / "warmup", ignore_errors=True)
    return None


def _load_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)  # weights_only: a checkpoint cannot run code


def latest_checkpoint(out_dir: Path) -> Path | None:
    """Newest complete checkpoint; torn or partial ones are skipped with a warning."""
    root = Path(out_dir) / "checkpoints"
    for ckpt in sorted(root.glob("step-*"), reverse=True) if root.exists() else []:
        try:
            if not (ckpt / "COMPLETE").exists() or not (ckpt / "policy" / "config.json").exists():
                raise ValueError("incomplete")
            _load_state(ckpt / "state.pt")
            return ckpt
        except Exception as e:  # noqa: BLE001 - any damage means: do not resume from this one
            print(f"warning: skipping damaged checkpoint {ckpt} ({type(e).__name__}: {e})", file=sys.stderr)
    return None


def rng_state(*generators: torch.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": [torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
        "generators": [g.get_state() for g in generators],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, *generators: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(tuple(x.numpy() if torch.is_tensor(x) else x for x in state["numpy"]))
    torch.set_rng_state(state["torch"])
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, step: int, policy, tok, state: dict, keep: int = 2) -> Path:
    """Write checkpoints/step-<step> atomically and keep only the newest `keep` checkpoints."""
    root = Path(out_dir) / "checkpoints"
    final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    torch.save(state, tmp / "state.pt")
    (tmp / "COMPLETE").write_text(f"{step}\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint_state(ckpt: Path) -> dict:
    return _load_state(Path(ckpt) / "state.pt")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of a metrics/rollouts file up to `last_step` (and drop a torn last line): on resume, the
    steps after the checkpoint are run again, so they must not appear twice."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to checkpoint and stop at the next step boundary; a second Ctrl-C stops now."""

    def __init__(self):
        self.requested: str | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(
            f"\n{self.requested}: finishing this step, then saving a checkpoint and stopping "
            "(press Ctrl-C again to stop at once)",
            file=sys.stderr,
        )


#### The run: everything in main() that is not the algorithm ##########################################################


class Run:
    """Start or resume a run, and after every step write its metrics, checkpoint it, and stop cleanly on a signal.

    main() builds the models, then hands this object what a checkpoint must hold; from there main() reads as the
    algorithm (rollout -> filter -> old log-probs -> advantages -> update -> log) and this object does the rest:
      * start: config.json (fresh run), or resume: optimizer / critic / RNG state back, metrics.jsonl and
        rollouts.jsonl cut back to the checkpoint's step, time_s continuing where it stopped;
      * per step: phase timers (`with run.timer("gen"):`), the echo-trap check, metrics.jsonl, report.html after
        every evaluation (and every evaluation printed), the progress bar, the non-finite-update guard,
        checkpoints every --save-every steps, and the Ctrl-C / SIGTERM stop with a copy-pasteable resume command.
    """

    def __init__(self, args, task: str, resume_from: Path | None, policy, tok, state: dict, config: dict, warnings_fn):
        """state: what a checkpoint holds besides the policy, by name: optimizers, the critic (None: nothing),
        torch.Generators (saved with the RNG states). config: extra entries for config.json."""
        from report import build_report  # report.py is plumbing too; imported here so common.py stands alone

        self.args, self.script, self.policy, self.tok = args, f"starpo_{task}.py", policy, tok
        self.generators = [v for v in state.values() if isinstance(v, torch.Generator)]
        self.state = {k: v for k, v in state.items() if v is not None and not isinstance(v, torch.Generator)}
        self.warnings_fn, self.build_report = warnings_fn, build_report
        self.out_dir = Path(args.output_dir)
        self.resume_from = resume_from
        self.start_step, self.history, self.warned, self.skipped_in_a_row, self.time_before = 1, [], set(), 0, 0.0
        if resume_from is None:
            (self.out_dir / "config.json").write_text(json.dumps(dict(dataclasses.asdict(args), **config), indent=1))
        else:
            saved = load_checkpoint_state(resume_from)
            for name, obj in self.state.items():
                obj.load_state_dict(saved[name])
            set_rng_state(saved["rng"], *self.generators)
            self.start_step, self.history = saved["step"] + 1, saved["history"]
            self.warned, self.skipped_in_a_row = set(saved["warned"]), saved["skipped_in_a_row"]
            self.time_before = float(saved.get("time_s", 0.0))
            for name in ("metrics.jsonl", "rollouts.jsonl"):  # the steps after the checkpoint will be run again
                truncate_jsonl(self.out_dir / name, saved["step"])
            write_line(f"resumed from {resume_from} at step {saved['step']}")
        self.metrics = Metrics(self.out_dir / "metrics.jsonl")
        self.rollouts = Metrics(self.out_dir / "rollouts.jsonl")
        self.stop = GracefulStop()
        self.t_start = time.time()
        self.timings: dict[str, float] = {}
        self._running: list[str] = []
        self.last_val = float("nan")
        self.bar = None

    @property
    def fresh(self) -> bool:
        return self.resume_from is None

    def time_s(self) -> float:
        """Seconds of this run so far, earlier segments (before a resume) included."""
        return self.time_before + time.time() - self.t_start

    def timer(self, name: str):
        """`with run.timer("update"):` adds the block's seconds to timing_s/update. Time inside `eval` counts only
        there (evaluation generates too, and that is not training-rollout generation)."""
        run = self

        class _Timer:
            def __enter__(self):
                self.t = time.time()
                run._running.append(name)

            def __exit__(self, *exc):
                run._running.pop()
                if "eval" not in run._running:
                    run.timings[name] = run.timings.get(name, 0.0) + time.time() - self.t

        return _Timer()

    def eval_due(self, step: int) -> bool:
        return step == self.args.steps or bool(self.args.eval_every and step % self.args.eval_every == 0)

    def write_rollouts(self, records) -> None:
        for r in records:
            self.rollouts.write(r)

    def steps(self, desc: str):
        """The training steps still to run, under a progress bar; phase timers start afresh each step."""
        self.bar = tqdm_bar(
            range(self.start_step, self.args.steps + 1), desc=desc, initial=self.start_step - 1, total=self.args.steps
        )
        for step in self.bar:
            self.timings, self.t_step = {}, time.time()
            yield step

    def log_eval(self, step: int, val: dict, records) -> None:
        """Step 0's evaluation (before any update): its own metrics line, rollouts and a first report."""
        self.write_rollouts(records)
        self.metrics.write({"step": step, **val, "time_s": self.time_s(), "timestamp": time.time()})
        self._print_eval(step, val)
        self.build_report(self.out_dir)

    def _print_eval(self, step: int, record: dict) -> None:
        self.last_val = record["val/success"]
        shown = "  ".join(f"{k} {record[k]:.3f}" for k in ("val/success", "val/reward") if k in record)
        write_line(f"step {step}  {shown}")

    def end_step(self, step: int, record: dict, skipped: int) -> None:
        """Everything after the update: timers, warnings, metrics line, report, bar, guards, checkpoint, stop."""
        args = self.args
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        timings = dict(self.timings)
        if "rollout" in timings:  # the rollout's time that was not generation: the environment and tokenising
            timings["env"] = timings.pop("rollout") - timings.get("gen", 0.0)
        record.update({f"timing_s/{k}": v for k, v in timings.items()})
        self.history.append({k: v for k, v in record.items() if k in ("rollout/in_group_std", "actor/grad_norm")})
        if skipped:
            write_line(
                f"[step {step}] skipped {skipped} update(s): non-finite loss or gradient "
                f"({self.skipped_in_a_row} step(s) in a row)"
            )
        for msg in self.warnings_fn(self.history, self.warned):
            write_line(f"[echo-trap warning, step {step}] {msg}")
            record["warn/echo_trap"] = 1
        record["timing_s/step"] = time.time() - self.t_step
        record["time_s"], record["timestamp"] = self.time_s(), time.time()
        self.metrics.write(record)
        if "val/success" in record:
            self._print_eval(step, record)
            self.build_report(self.out_dir)
        self.bar.set_postfix(
            {
                "succ": f"{record['train/success']:.2f}",
                "val": f"{self.last_val:.2f}",
                "std": f"{record['rollout/in_group_std']:.3f}",
                "ent": f"{record.get('actor/entropy', 0):.2f}",
            }
        )
        if self.skipped_in_a_row >= args.max_skipped:
            fail(
                "--max-skipped",
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient; stopped "
                f"without saving. Last good checkpoint: {latest_checkpoint(self.out_dir) or 'none'}",
            )
        if step == args.steps or (args.save_every and step % args.save_every == 0) or self.stop.requested:
            path = self.checkpoint(step)
            if self.stop.requested and step < args.steps:
                write_line(
                    f"stopped by {self.stop.requested} after step {step}; checkpoint {path}. Continue with: "
                    f"python {self.script} --resume --output-dir {self.out_dir}"
                )
                raise SystemExit(130 if self.stop.requested == "SIGINT" else 143)

    def checkpoint(self, step: int) -> Path:
        state = dict(
            step=step,
            rng=rng_state(*self.generators),
            history=self.history,
            warned=sorted(self.warned),
            skipped_in_a_row=self.skipped_in_a_row,
            time_s=self.time_s(),
        )
        state.update({name: obj.state_dict() for name, obj in self.state.items()})
        return save_checkpoint(self.out_dir, step, self.policy, self.tok, state, self.args.keep_checkpoints)

    def finish(self, extra: str = "") -> None:
        """Close the files and print the final line: steps, time, last val/success, where the policy and report are."""
        self.metrics.close()
        self.rollouts.close()
        from report import read_jsonl

        evals = [r for r in read_jsonl(self.out_dir / "metrics.jsonl") if "val/success" in r]
        last = latest_checkpoint(self.out_dir)  # none when --steps 0
        write_line(
            f"done: {self.args.steps} steps in {self.time_s():.0f}s, final val/success "
            f"{evals[-1]['val/success']:.3f}{extra}; policy: {last / 'policy' if last else 'none saved'}; "
            f"report: {self.build_report(self.out_dir)}"
        )


def tqdm_bar(iterable, **kw):
    from tqdm import tqdm

    return tqdm(iterable, dynamic_ncols=True, **kw)


def write_line(text: str) -> None:
    """Print above the progress bar (tqdm.write), so the bar stays on the last line."""
    from tqdm import tqdm

    tqdm.write(text)


def given_fields(args) -> frozenset:
    """The fields set on the command line (parse_args records them as `args.given`); for an instance built in code,
    the fields whose value differs from the dataclass default."""
    given = getattr(args, "given", None)
    if given is not None:
        return frozenset(given)
    return frozenset(f.name for f in dataclasses.fields(args) if getattr(args, f.name) != f.default)
