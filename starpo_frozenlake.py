"""StarPO and StarPO-S on RAGEN's slippery FrozenLake, a multi-turn task, in one file.

The agent sees a 4x4 frozen lake as text, thinks inside <think>...</think> and answers one to five moves
inside <answer>...</answer>, separated by "||" (e.g. "<answer> Down || Right </answer>"). The environment runs
the moves, shows the new lake, and the agent answers again: at most 5 turns and 10 moves per episode. Reaching
the goal pays +1; falling into a hole ends the episode. The ice is slippery: a move goes where it was meant to
only 1/3 of the time, so even a perfect agent fails often. On the evaluation maps the script prints, next to the
agent's success, what a uniformly random policy and the optimal policy score (exact dynamic programming): that is
the scale to read val/success on (RAGEN's Qwen2.5-0.5B ends near the random policy).

StarPO (RAGEN, arXiv 2504.20073) treats the whole episode as one token sequence: prompt, reply, observation,
reply, ... Only the model's own sampled tokens are trained; the observations are context. It updates with PPO
(critic + GAE) or GRPO. StarPO-S, the default, keeps the 25% of groups whose rewards disagree most, drops the KL
term, and clips asymmetrically (0.2 / 0.28) with a dual clip of 3 for negative advantages.

Run it:
    python starpo_frozenlake.py                                     # CPU: embedded tiny model, 20-30 minutes
    python starpo_frozenlake.py --model Qwen/Qwen2.5-0.5B-Instruct  # GPU: vLLM generation, RAGEN's defaults
    python starpo_frozenlake.py --max-context-turns 2               # show only the last 2 turns (long episodes)
    python starpo_frozenlake.py --resume --output-dir runs/frozenlake-...   # continue a stopped run
Outputs go to --output-dir: metrics.jsonl, rollouts.jsonl (every turn's lake, reply and reward), report.html
(curves with the random and optimal baselines, and a viewer that draws each turn's lake) and checkpoints/.

How it departs from the paper / RAGEN:
  * Maps and slips are pure functions of the reset seed, and a group shares its seed, so its members share the map,
    the start and the stream of slip draws (RAGEN's code seeds the same way): the i-th move of every member either
    goes where it was meant or slips to the same side. The group compares choices, not luck.
  * The grid is printed with a space between cells ("P _ _ O") so that every cell is one token; symbols are RAGEN's.
  * val/optimal_success is the closed-loop optimum over (cell, moves left): it sees the lake after every move. The
    agent sees it only between turns, up to 5 moves later, so the optimum is an upper bound on what it can score
    (answering two moves a turn loses little: the 10-move budget fits in 5 turns).
  * `--model tiny` (the CPU default) is a 3M-parameter Qwen2-architecture model built and format-warmed on first
    use (two uniformly random moves a turn: the task itself is left to RL); it uses CPU-sized defaults, printed at
    start. Paper defaults apply to any other model. Three of them matter beyond size:
      - GRPO, not PPO with a critic: a tiny critic learns values no faster than the policy learns moves, and it
        doubles the update's cost (--estimator gae gives RAGEN's choice back).
      - loss aggregation seq-mean-token-mean, not token-mean. Here failed episodes are long (all 5 turns) and
        successes short (they stop at the goal). With token-mean the many tokens of long failures outweigh the
        short successes, so the format tokens every reply shares get a net push down (watch
        train/action_is_valid with --loss-agg token-mean). Weighing every trajectory the same removes that bias;
        it does not make a high learning rate safe.
      - top_p 0.95 for training rollouts. A rare malformed reply inside a lucky (successful) episode gets a large
        positive update, because low-probability tokens have large gradients; with sparse, noisy rewards such
        tails spread until the format breaks. The nucleus cuts them while the four moves (each ~1/4) stay sampled.
    How far the tiny model gets is measured by bench/frozenlake_cpu.py (results in bench/results/): it stays at
    the random policy's level, and bench/tiny_probe.py shows why (even supervised, it does not learn to read moves
    off the lake in 300 steps).
  * The rubric (env reward + RAGEN's -0.1 format penalty per bad turn) is explicit and logged per component.

Echo-trap warnings (printed, and counted in `warn/echo_trap`): RAGEN observed that collapse is announced by the
in-group reward std falling first, then entropy, with gradient-norm spikes marking the point of no return. We warn
when (a) the mean in-group std over the last 3 steps falls below 10% of its best earlier value (from step 8), or
(b) the gradient norm exceeds 5x the median of the previous 10 steps. Slippery ice keeps rewards noisy, so (a)
rarely fires from convergence here: when it fires, suspect a collapse and read the printed samples.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

import common
from common import agg_loss, filter_groups, gae, group_advantages, kl_penalty, masked_whiten, policy_loss, value_loss
from report import build_report, read_jsonl


@dataclass
class Args:
    # ---- run ----
    seed: int = 0
    """random seed (training seeds, sampling, shuffling)"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, rollouts.jsonl, config.json and checkpoints go (default: a new runs/frozenlake-... folder)"""
    resume: bool = False
    """continue the run in --output-dir from its newest complete checkpoint"""
    overwrite: bool = False
    """replace the run already in --output-dir"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available"""
    # ---- model and generation ----
    model: str = "auto"
    """'tiny' (embedded, CPU), a Hugging Face id or a local directory; auto = Qwen2.5-0.5B-Instruct on CUDA, tiny on CPU"""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """generation engine; auto = vllm on CUDA when it is installed, else hf (transformers' generate)"""
    max_tokens: Optional[int] = None
    """max new tokens per turn (paper 400; tiny 24)"""
    max_model_len: int = 3600
    """longest prompt + reply the model may see; a turn that would not fit ends the episode"""
    temperature: float = 1.0
    """sampling temperature for training rollouts"""
    top_p: Optional[float] = None
    """nucleus sampling for training rollouts (paper 1.0; tiny 0.95: see the module docstring)"""
    val_temperature: float = 0.5
    """sampling temperature for evaluation"""
    gen_batch_size: int = 256
    """hf backend: replies generated per generate() call"""
    vllm_gpu_memory_utilization: float = 0.4
    """vllm backend: fraction of the whole GPU for weights + KV cache (leave room for training)"""
    # ---- environment and episode budget ----
    size: int = 4
    """the lake is size x size"""
    frozen_prob: float = 0.8
    """probability that a cell is frozen (else a hole) when the map is drawn"""
    slippery: bool = True
    """slippery ice: the chosen direction 1/3, each perpendicular one 1/3 (--no-slippery: moves always succeed)"""
    max_turns: int = 5
    """turns (replies) per episode"""
    max_actions_per_turn: int = 5
    """moves read from one answer (more are discarded)"""
    max_actions_per_traj: int = 10
    """moves per episode (moves beyond the budget are discarded)"""
    max_context_turns: Optional[int] = None
    """show the model only the first prompt and the last k turns (default: the whole history)"""
    # ---- algorithm ----
    algo: Literal["starpo", "starpo-s"] = "starpo-s"
    """starpo: KL 0.001, clip 0.2, no filter. starpo-s: top-25% group filter, no KL, clip 0.2/0.28, dual clip 3"""
    estimator: Optional[Literal["gae", "grpo"]] = None
    """gae = PPO with a critic; grpo = group-normalised trajectory reward (paper gae; tiny grpo)"""
    n_groups: Optional[int] = None
    """groups (distinct initial states) per step (paper 8; tiny 8)"""
    group_size: Optional[int] = None
    """rollouts per group, all from the same seed (paper 16; tiny 8)"""
    keep_ratio: Optional[float] = None
    """uncertainty filter: fraction of groups kept (starpo 1.0, starpo-s 0.25)"""
    filter_mode: Literal["std", "std_rev"] = "std"
    """keep the highest-std groups (std) or, as an ablation, the lowest (std_rev)"""
    kl_coef: Optional[float] = None
    """weight of the KL-to-reference loss (starpo 0.001, starpo-s 0)"""
    kl_kind: Literal["k1", "abs", "k2", "k3"] = "k1"
    """KL estimator"""
    clip_low: float = 0.2
    """PPO clip below 1"""
    clip_high: Optional[float] = None
    """PPO clip above 1 (starpo 0.2, starpo-s 0.28)"""
    dual_clip: Optional[float] = None
    """cap on the loss of negative-advantage tokens, > 1 (starpo off, starpo-s 3.0); 0 turns it off"""
    entropy_coef: float = 0.001
    """entropy bonus weight"""
    loss_agg: Optional[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]] = None
    """how per-token losses are reduced (paper token-mean; tiny seq-mean-token-mean: see the module docstring)"""
    norm_adv_by_std: bool = True
    """grpo: divide by the group std (off = Dr. GRPO)"""
    gamma: float = 1.0
    """gae discount"""
    lam: float = 1.0
    """gae lambda"""
    turn_rewards: bool = True
    """gae: each turn's reward on that turn's last sampled token (--no-turn-rewards: the trajectory score on the final one)"""
    value_clip: float = 0.5
    """critic value clip"""
    # ---- optimisation ----
    steps: Optional[int] = None
    """training steps (paper 200; tiny 80)"""
    lr: Optional[float] = None
    """actor learning rate (paper 1e-6; tiny 2e-4)"""
    critic_lr: Optional[float] = None
    """critic learning rate (paper 1e-5; tiny 1e-3)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """gradient-norm clip"""
    ppo_epochs: int = 1
    """passes over each batch"""
    mini_batch_size: int = 32
    """training rows per optimizer step (a row is a trajectory; with --max-context-turns, one turn)"""
    micro_batch_size: int = 32
    """training rows per forward/backward (gradient accumulation; lower it if memory runs out)"""
    # ---- evaluation and logging ----
    eval_every: Optional[int] = None
    """evaluate every N steps (and before training); 0 = only before and after (paper 10; tiny 20)"""
    val_size: Optional[int] = None
    """evaluation seeds (paper 256; tiny 256)"""
    save_every: int = 25
    """save a checkpoint every N steps (0 = only at the end and on Ctrl-C / SIGTERM)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""
    max_skipped: int = 3
    """stop after this many steps in a row whose updates were skipped for a non-finite loss or gradient"""
    mask_truncated: bool = False
    """do not train on trajectories with a reply cut at --max-tokens (their reward still counts in the group statistics)"""
    trust_remote_code: bool = False
    """allow a Hugging Face model to run its own Python code (off: only the transformers library's code runs)"""
    sample_every: int = 10
    """print one rollout with its rubric breakdown every N steps (0 = never)"""
    log_rollouts_every: int = 10
    """append one training rollout per group to rollouts.jsonl every N steps (0 = never); evals always log"""


PAPER_DEFAULTS = dict(max_tokens=400, top_p=1.0, estimator="gae", loss_agg="token-mean", n_groups=8, group_size=16,
                      steps=200, lr=1e-6, critic_lr=1e-5, eval_every=10, val_size=256)
# The tiny model learns from scratch-sized steps: far larger learning rates, short replies, fewer evaluations; GRPO
# because a tiny critic learns values no faster than the policy learns moves, and doubles the update's cost.
TINY_DEFAULTS = dict(max_tokens=24, top_p=0.95, estimator="grpo", loss_agg="seq-mean-token-mean", n_groups=8,
                     group_size=8, steps=80, lr=2e-4, critic_lr=1e-3, eval_every=20, val_size=256)
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"


########################################################################################################################
# ENVIRONMENT
########################################################################################################################

ACTIONS = ["Left", "Down", "Right", "Up"]  # gymnasium's order: action a slips to (a - 1) % 4 or (a + 1) % 4
MOVES = [(0, -1), (1, 0), (0, 1), (-1, 0)]  # (row, column) change of each action


def generate_map(seed: int, size: int = 4, p: float = 0.8) -> list[str]:
    """RAGEN's random map: each cell frozen 'F' with probability p, else a hole 'H'; then a random start 'S' and a
    distinct random goal 'G' are stamped on; redraw until a path of non-hole cells joins them. Pure in `seed`."""
    rng = np.random.default_rng(seed)
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])  # (size, size) array of one-letter strings
        while True:
            start, goal = (int(rng.integers(0, size)), int(rng.integers(0, size))), (int(rng.integers(0, size)), int(rng.integers(0, size)))
            if start != goal:
                break
        board[start], board[goal] = "S", "G"
        desc = ["".join(row) for row in board]
        if has_path(desc):
            return desc


def find(desc: list[str], letter: str) -> tuple[int, int]:
    return next((r, row.index(letter)) for r, row in enumerate(desc) if letter in row)


def has_path(desc: list[str]) -> bool:
    """Depth-first search from S to G over cells that are not holes."""
    n, goal = len(desc), find(desc, "G")
    seen, stack = {find(desc, "S")}, [find(desc, "S")]
    while stack:
        r, c = stack.pop()
        if (r, c) == goal:
            return True
        for dr, dc in MOVES:
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and desc[nxt[0]][nxt[1]] != "H" and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def transitions(desc: list[str], pos: tuple[int, int], action: int, slippery: bool = True) -> list[tuple[float, tuple[int, int]]]:
    """[(probability, next cell)] for one action: gymnasium's slippery rule. Bumping into the border = staying."""
    n = len(desc)

    def move(direction: int) -> tuple[int, int]:
        r, c = pos[0] + MOVES[direction][0], pos[1] + MOVES[direction][1]
        return (r, c) if 0 <= r < n and 0 <= c < n else pos

    if not slippery:
        return [(1.0, move(action))]
    return [(1 / 3, move(d)) for d in ((action - 1) % 4, action, (action + 1) % 4)]


def render(desc: list[str], pos: tuple[int, int]) -> str:
    """RAGEN's symbols: P player, _ frozen, O hole, G goal, X player in a hole, √ player on the goal."""
    rows = []
    for r, row in enumerate(desc):
        cells = []
        for c, letter in enumerate(row):
            if (r, c) == pos:
                cells.append({"H": "X", "G": "√"}.get(letter, "P"))
            else:
                cells.append({"H": "O", "G": "G"}.get(letter, "_"))
        rows.append(" ".join(cells))
    return "\n".join(rows)


class FrozenLakeEnv:
    """RAGEN's FrozenLake: a map drawn from the reset seed (or a fixed `desc`), one action word per step."""

    def __init__(self, size: int = 4, p: float = 0.8, slippery: bool = True, desc: Optional[list[str]] = None):
        self.size, self.p, self.slippery, self.fixed_desc = size, p, slippery, desc
        self.desc, self.pos, self.done = [], (0, 0), True
        self.rng = np.random.default_rng(0)

    def reset(self, seed: int) -> str:
        self.desc = list(self.fixed_desc) if self.fixed_desc else generate_map(seed, self.size, self.p)
        self.pos, self.done = find(self.desc, "S"), False
        # Slips come from their own generator seeded like the map's; gymnasium spends one draw choosing the start.
        self.rng = np.random.default_rng(seed)
        self.rng.random()
        return self.render()

    def render(self) -> str:
        return render(self.desc, self.pos)

    def cell(self) -> str:
        return self.desc[self.pos[0]][self.pos[1]]

    def step(self, action: str):
        """One action word (case-insensitive). -> (observation, reward, done, info)."""
        names = [a.lower() for a in ACTIONS]
        valid = action.strip().lower() in names
        before, reward = self.pos, 0.0
        if valid and not self.done:  # after the episode ends, or on an invalid word, nothing moves
            outcomes = transitions(self.desc, self.pos, names.index(action.strip().lower()), self.slippery)
            draw = self.rng.random()  # gymnasium's categorical sample: the first outcome whose cumulative prob > draw
            cumulative = np.cumsum([prob for prob, _ in outcomes])
            self.pos = outcomes[min(int(np.argmax(cumulative > draw)), len(outcomes) - 1)][1]
            self.done = self.cell() in "HG"
            reward = 1.0 if self.cell() == "G" else 0.0
        info = {"success": self.cell() == "G", "action_is_valid": valid, "action_is_effective": self.pos != before}
        return self.render(), reward, self.done, info


def success_dp(desc: list[str], budget: int, slippery: bool = True) -> tuple[float, float]:
    """Exact success probabilities from the start with `budget` actions: (uniformly random policy, optimal policy).

    Closed-loop dynamic programming over (cell, actions left): V_k(s) = max_a sum_s' P(s'|s,a) W_{k-1}(s') (the mean
    over the 4 actions for the random policy), W = 1 on the goal, 0 in a hole, V_{k-1} elsewhere, V_0 = 0.
    The optimum sees the lake after every action, so it bounds what an agent that answers several moves per turn
    can reach (see the module docstring).
    """
    n = len(desc)
    cells = [(r, c) for r in range(n) for c in range(n)]
    rand, best = {s: 0.0 for s in cells}, {s: 0.0 for s in cells}  # V_0: no actions left, no success

    def worth(values: dict, s) -> float:
        letter = desc[s[0]][s[1]]
        return 1.0 if letter == "G" else 0.0 if letter == "H" else values[s]

    for _ in range(budget):
        q_rand = {s: [sum(p * worth(rand, t) for p, t in transitions(desc, s, a, slippery)) for a in range(4)] for s in cells}
        q_best = {s: [sum(p * worth(best, t) for p, t in transitions(desc, s, a, slippery)) for a in range(4)] for s in cells}
        rand = {s: sum(q_rand[s]) / 4 for s in cells}
        best = {s: max(q_best[s]) for s in cells}
    start = find(desc, "S")
    return rand[start], best[start]


########################################################################################################################
# RUBRIC — edit me. Each function scores one turn; a trajectory's score is the sum over its turns of the weighted sum.
########################################################################################################################


@dataclass
class Turn:
    """One turn of an episode, as the rubric sees it."""

    state: str  # the lake shown before this turn
    text: str  # the raw reply, exactly as generated
    think: Optional[str]  # inside <think>...</think>, None if not well formed
    answer: Optional[str]  # inside <answer>...</answer>, None if missing, repeated or unclosed
    actions: list[str]  # the moves actually executed, in order
    had_invalid: bool  # the answer had a word that is not a move, or no move at all
    env_reward: float  # what the environment paid for this turn's moves
    info: dict  # success (on the goal after the turn), action_is_valid (no bad word), effective_moves (moves that moved)
    truncated: bool = False  # the reply hit --max-tokens before its end-of-turn token
    parts: dict = field(default_factory=dict)  # rubric components, unweighted
    score: float = 0.0  # weighted sum of the parts


def env_reward(t: Turn) -> float:
    """The lake's payout for this turn: +1 if one of its moves reached the goal, else 0."""
    return t.env_reward


def format_penalty(t: Turn) -> float:
    """-1 once per turn when the answer is missing or has a word that is not a move (RAGEN: weight 0.1 -> -0.1)."""
    return -1.0 if t.had_invalid else 0.0


FORMAT_RE = re.compile(
    r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*",
    re.DOTALL,  # without DOTALL, '.' stops at newlines and multi-line thinking would never match
)


def format_reward(t: Turn) -> float:
    """1 if the reply is exactly one <think>...</think> then one <answer>...</answer>, else 0 (logged only)."""
    return 1.0 if FORMAT_RE.fullmatch(t.text) else 0.0


# (function, weight). Weight 0 = computed and logged as rubric/<name>, but not part of the reward.
RUBRIC = [
    (env_reward, 1.0),
    (format_penalty, 0.1),
    (format_reward, 0.0),
]


def score(t: Turn) -> tuple[float, dict[str, float]]:
    """Turn reward = sum of weight * component; also returns each component's unweighted value for logging."""
    parts = {fn.__name__: float(fn(t)) for fn, _ in RUBRIC}
    total = sum(w * parts[fn.__name__] for fn, w in RUBRIC)
    return total, parts


########################################################################################################################
# PROMPT AND PARSING
########################################################################################################################

SYSTEM_PROMPT = "You're a helpful assistant. You always think before you answer."
RULES_PROMPT = (
    "FrozenLake: reach the goal, do not fall into a hole. The ice is slippery: a move goes the way you chose "
    "1/3 of the time, else to one of the two sides.\n"
    "Symbols: P you, _ ice, O hole, G goal, X you in a hole, √ you on the goal.\n"
    "Moves: Left, Down, Right, Up. Answer 1 to {per_turn} moves a turn, separated by ||. You have {budget} moves in all."
)
FORMAT_PROMPT = "Reply: <think> [your thoughts] </think> <answer> [your moves] </answer>"


def turn_prompt(turn: int, state: str, actions_left: int, last_reward: Optional[float] = None) -> str:
    """One turn's user message: the last turn's reward (from turn 2 on), the lake, the moves left, the format."""
    head = "" if last_reward is None else f"Reward: {last_reward:g}\n"
    return f"{head}Turn {turn}:\nState:\n{state}\nMoves left: {actions_left}\n{FORMAT_PROMPT}"


def first_messages(state: str, per_turn: int, budget: int) -> list[dict]:
    rules = RULES_PROMPT.format(per_turn=per_turn, budget=budget)
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": rules + "\n" + turn_prompt(1, state, budget)}]


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


def parse_actions(answer: Optional[str], max_actions: int) -> tuple[list[str], bool]:
    """RAGEN's rule: split on '||', match each piece to a move (case-insensitive). -> (moves, had_invalid).

    Pieces that are not moves (empty ones included) are dropped and set the flag; so does an answer with no move.
    At most max_actions moves are kept; the caller trims further to what is left of the episode's budget.
    """
    lookup = {a.lower(): a for a in ACTIONS}
    pieces = [p.strip().lower() for p in (answer or "").split("||")]
    actions = [lookup[p] for p in pieces if p in lookup]
    had_invalid = len(actions) < len(pieces) or not actions
    return actions[:max_actions], had_invalid


########################################################################################################################
# GENERATION — hf (transformers' generate, CPU or fallback) and vllm (in-process engine on a GPU)
########################################################################################################################


def stop_token_ids(tok) -> list[int]:
    """Token ids that end a reply: Qwen's <|im_end|> and <|endoftext|>, plus the tokenizer's eos."""
    ids = {tok.eos_token_id} | {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()}
    return sorted(i for i in ids if i is not None)


def cut_at_stop(ids: list[int], logps: list[float], stops: list[int]) -> tuple[list[int], list[float]]:
    """Keep tokens up to and including the first stop token (the model emitted it, so it is trained too)."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1], logps[: i + 1]
    return ids, logps


def top_p_filter(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p. z: (B, V) logits."""
    if top_p >= 1.0:
        return z
    sorted_z, order = z.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_z.softmax(-1)  # (B, V)
    drop = probs.cumsum(-1) - probs > top_p  # (B, V): the mass before this token already reached top_p
    return z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))


@torch.no_grad()
def hf_generate(model, tok, prompts, temperature, top_p, max_tokens, batch_size):
    """Sample one reply per prompt with a plain KV-cache loop. Returns [(reply token ids, their log-probs)].

    Same rules as vLLM here: temperature, top-p, no top-k, no penalties. Why not model.generate? Members of a
    group share their prompt, so we prefill each distinct prompt once and copy its KV cache to the group: the
    prompt is most of the compute on a CPU (the bandit's 8 x 8 batch has 8 distinct prompts). The log-probs are
    those of the tempered distribution, which is what the update pass recomputes.
    """
    stops = torch.tensor(stop_token_ids(tok))
    device = next(model.parameters()).device
    results = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        distinct = list(dict.fromkeys(tuple(p) for p in chunk))
        row = torch.tensor([distinct.index(tuple(p)) for p in chunk], device=device)  # (b,): chunk row -> distinct prompt
        width = max(len(p) for p in distinct)
        input_ids = torch.full((len(distinct), width), tok.pad_token_id, device=device)  # (u, P), left-padded
        attn = torch.zeros((len(distinct), width), dtype=torch.long, device=device)  # (u, P)
        for j, p in enumerate(distinct):
            input_ids[j, width - len(p) :] = torch.tensor(p)
            attn[j, width - len(p) :] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)  # (u, P): left padding must not shift positions
        cache = common.append_in_place_cache()
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache.batch_select_indices(row)  # (u, ...) -> (b, ...): every member of a group gets its prompt's cache
        logits, attn, pos = out.logits[row, -1], attn[row], positions[row, -1:]  # (b, V), (b, P), (b, 1)
        tokens, logps = [], []
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)  # (b,)
        for _ in range(max_tokens):
            logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (b, V)
            nxt = torch.multinomial(top_p_filter(logp_all, top_p).exp(), 1).squeeze(-1)  # (b,)
            nxt = nxt.masked_fill(done, tok.pad_token_id)  # finished rows only pad
            tokens.append(nxt)
            logps.append(logp_all.gather(-1, nxt[:, None]).squeeze(-1))
            done |= torch.isin(nxt, stops.to(device))
            if done.all():
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)  # (b, P + t)
            pos = pos + 1
            out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]  # (b, V)
        new, new_logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (b, R)
        results += [cut_at_stop(ids, lps, stops.tolist()) for ids, lps in zip(new, new_logps)]
    return results


def vllm_engine_kwargs(args: Args, model_path: str) -> dict:
    """Keyword arguments for vllm.LLM (validated against the installed vllm by tests/test_vllm_args.py)."""
    return dict(model=model_path, tokenizer=model_path, dtype="bfloat16", seed=args.seed,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_model_len=args.max_model_len,
                enable_prefix_caching=True, trust_remote_code=args.trust_remote_code,
                logprobs_mode="processed_logprobs",  # log-probs of the tempered distribution actually sampled from
                generation_config="vllm")  # ignore the checkpoint's sampling defaults and extra eos ids


def vllm_sampling_kwargs(temperature: float, top_p: float, max_tokens: int, stops: list[int]) -> dict:
    """Keyword arguments for vllm.SamplingParams: same semantics as hf_generate (no top-k, no penalties)."""
    return dict(n=1, temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_tokens, stop_token_ids=stops,
                logprobs=0, skip_special_tokens=False)


def vllm_generate(llm, tok, prompts, temperature, top_p, max_tokens):
    from vllm import SamplingParams

    stops = stop_token_ids(tok)
    params = SamplingParams(**vllm_sampling_kwargs(temperature, top_p, max_tokens, stops))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        logps = [d[t].logprob for t, d in zip(ids, c.logprobs)] if c.logprobs else [0.0] * len(ids)
        if c.finish_reason == "stop" and ids and ids[-1] not in stops and c.stop_reason in stops:
            ids, logps = ids + [c.stop_reason], logps + [0.0]  # keep the stop token in the trained sequence
        results.append(cut_at_stop(ids, logps, stops))
    return results


def vllm_push_weights(llm, model) -> None:
    """Copy the freshly updated policy into vLLM's copy, then drop prefixes cached under the old weights."""
    runner = llm.llm_engine.model_executor.driver_worker.model_runner.model
    runner.load_weights((name, p.detach()) for name, p in model.state_dict().items())
    llm.reset_prefix_cache()


########################################################################################################################
# ROLLOUT — multi-turn: every episode is one growing token sequence
########################################################################################################################


@dataclass
class Trajectory:
    """One episode as ONE token sequence: first prompt, then per turn the sampled reply and the next observation.

    ids are the exact sampled tokens (never re-tokenised from text) with the observation tokens between them;
    mask is 1 exactly on the sampled tokens; gen_logprobs are the sampler's log-probs (0 where mask is 0).
    """

    seed: int
    ids: list[int]
    mask: list[int]
    gen_logprobs: list[float]
    first_len: int  # length of the first prompt (system + rules + first lake)
    turn_starts: list[int] = field(default_factory=list)  # index in ids of each turn's first reply token
    turn_last_index: list[int] = field(default_factory=list)  # index in ids of each turn's last sampled token
    turns: list[Turn] = field(default_factory=list)
    score: float = 0.0  # sum of the turns' scores
    parts: dict = field(default_factory=dict)  # each rubric component summed over the turns
    success: bool = False
    context_overflow: bool = False  # ended because the next turn would not fit in max_model_len

    @property
    def truncated(self) -> bool:
        """Some reply of this episode hit --max-tokens (--mask-truncated leaves such trajectories untrained)."""
        return any(turn.truncated for turn in self.turns)


def rollout_record(t: Trajectory, step: int, split: str) -> dict:
    """One line of rollouts.jsonl: the trajectory turn by turn, for the report viewer (it draws each turn's lake)."""
    turns = [dict(state=turn.state, text=turn.text, think=turn.think, answer=turn.answer, reward=turn.env_reward,
                  rubric=turn.parts, actions=turn.actions) for turn in t.turns]
    return dict(step=step, split=split, task="frozenlake", seed=t.seed, success=bool(t.success), reward=t.score,
                turns=turns)


def context_ids(t: Trajectory, j: int, max_context_turns: Optional[int]) -> list[int]:
    """The prompt for turn j (0-based): the whole history, or the first prompt plus the last k turns."""
    end = t.turn_starts[j] if j < len(t.turn_starts) else len(t.ids)
    if max_context_turns is None or j <= max_context_turns:
        return t.ids[:end]
    return t.ids[: t.first_len] + t.ids[t.turn_starts[j - max_context_turns] : end]


def rollout(generate, tok, seeds: list[int], env_kwargs: dict, temperature: float, args: Args) -> list[Trajectory]:
    """Play one episode per seed, all episodes advancing together: ONE batched generate call per turn.

    An episode ends at the goal, in a hole, when its move budget is spent, after --max-turns, or when its next turn
    would not fit under --max-model-len (counted in train/context_overflow; a first prompt that does not fit gets no
    turn at all) instead of crashing the model mid-batch.
    """
    envs = [FrozenLakeEnv(**env_kwargs) for _ in seeds]
    budget = args.max_actions_per_traj
    trajs = []
    for env, seed in zip(envs, seeds):
        text = tok.apply_chat_template(first_messages(env.reset(seed), args.max_actions_per_turn, budget),
                                       add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        trajs.append(Trajectory(seed, ids, [0] * len(ids), [0.0] * len(ids), len(ids)))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stops = set(stop_token_ids(tok))
    active = [i for i, t in enumerate(trajs) if len(t.ids) + args.max_tokens <= args.max_model_len]
    for i in set(range(len(trajs))) - set(active):
        trajs[i].context_overflow = True
    for j in range(args.max_turns):
        if not active:
            break
        replies = generate([context_ids(trajs[i], j, args.max_context_turns) for i in active], temperature)
        still = []
        for i, (r_ids, r_logps) in zip(active, replies):
            t, env = trajs[i], envs[i]
            state = env.render()
            # ---- append the exact sampled tokens: they are what the update trains on ----
            t.turn_starts.append(len(t.ids))
            t.ids += r_ids
            t.mask += [1] * len(r_ids)
            t.gen_logprobs += r_logps
            t.turn_last_index.append(len(t.ids) - 1)  # (an empty reply: the untrained token before it)
            truncated = bool(r_ids) and r_ids[-1] not in stops
            if not r_ids or r_ids[-1] != im_end:  # cut at max_tokens (or another stop): close the turn, not trained
                t.ids.append(im_end)
                t.mask.append(0)
                t.gen_logprobs.append(0.0)
            # ---- parse and act: invalid words dropped, moves beyond the budget discarded ----
            text = tok.decode([x for x in r_ids if x not in stops], skip_special_tokens=False)
            think, answer = parse_reply(text)
            actions, had_invalid = parse_actions(answer, args.max_actions_per_turn)
            used = sum(len(turn.actions) for turn in t.turns)
            executed, reward, done, effective = [], 0.0, False, 0
            for a in actions[: budget - used]:
                _, r, done, step_info = env.step(a)
                executed.append(a)
                reward += r  # a reward earned on the last allowed action counts: it is added before any budget check
                effective += step_info["action_is_effective"]
                if done:
                    break
            info = {"success": env.cell() == "G", "action_is_valid": not had_invalid, "effective_moves": effective}
            turn = Turn(state, text, think, answer, executed, had_invalid, reward, info, truncated=truncated)
            turn.score, turn.parts = score(turn)
            t.turns.append(turn)
            t.score += turn.score
            for k, v in turn.parts.items():
                t.parts[k] = t.parts.get(k, 0.0) + v
            t.success = info["success"]
            left = budget - used - len(executed)
            if done or left <= 0 or j + 1 == args.max_turns:
                continue  # episode over: no observation after the final turn
            # ---- the observation: reward of the last turn, the new lake, moves left ----
            obs = "\n<|im_start|>user\n" + turn_prompt(j + 2, env.render(), left, turn.score) + "<|im_end|>\n<|im_start|>assistant\n"
            obs_ids = tok(obs, add_special_tokens=False)["input_ids"]
            if len(context_ids(t, j + 1, args.max_context_turns)) + len(obs_ids) + args.max_tokens > args.max_model_len:
                t.context_overflow = True  # the next turn would not fit: end the episode here
                continue
            t.ids += obs_ids
            t.mask += [0] * len(obs_ids)
            t.gen_logprobs += [0.0] * len(obs_ids)
            still.append(i)
        active = still
    return trajs


@dataclass
class Row:
    """One training sequence: a whole trajectory, or (with --max-context-turns) one turn with the context it saw."""

    traj: int  # index of its trajectory in the batch
    ids: list[int]
    mask: list[int]
    gen_logprobs: list[float]
    rewards: dict  # {index in ids of a sampled token: reward placed on it} (gae)


def training_rows(trajs: list[Trajectory], max_context_turns: Optional[int], turn_rewards: bool) -> list[Row]:
    """Trajectories -> rows. Rewards for gae: each turn's score on its last sampled token, or the trajectory score on
    the final one. A windowed row (one turn) gets the return-to-go from its turn on (gamma = 1)."""
    rows = []
    for k, t in enumerate(trajs):
        n = len(t.turns)
        rewards = [turn.score for turn in t.turns] if turn_rewards else [0.0] * (n - 1) + [t.score]
        if max_context_turns is None or n == 0:  # (no turn at all, after a context overflow: one untrained row)
            rows.append(Row(k, t.ids, t.mask, t.gen_logprobs, dict(zip(t.turn_last_index, rewards))))
            continue
        for j in range(n):
            ctx = context_ids(t, j, max_context_turns)
            s, e = t.turn_starts[j], t.turn_last_index[j] + 1
            rows.append(Row(k, ctx + t.ids[s:e], [0] * len(ctx) + t.mask[s:e], [0.0] * len(ctx) + t.gen_logprobs[s:e],
                            {len(ctx) + e - 1 - s: sum(rewards[j:])}))
    return rows


def collate(rows: list[Row], pad_id: int, device) -> dict:
    """Right-pad the rows. Position t of the shifted tensors is about predicting ids[t + 1]:

        input_ids  (B, L):      [p p p r r o o r r pad]
        loss_mask  (B, L - 1):    [0 0 1 1 0 0 1 1 0  ]   = mask[1:]: only sampled tokens are trained
    """
    L = max(len(r.ids) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L))
    gen_logp = torch.zeros((B, L))
    rewards = torch.zeros((B, L))
    for i, r in enumerate(rows):
        input_ids[i, : len(r.ids)] = torch.tensor(r.ids)
        attn[i, : len(r.ids)] = 1
        mask[i, : len(r.ids)] = torch.tensor(r.mask, dtype=torch.float)
        gen_logp[i, : len(r.ids)] = torch.tensor(r.gen_logprobs)
        for pos, value in r.rewards.items():
            rewards[i, pos] = value
    batch = dict(input_ids=input_ids, attention_mask=attn, targets=input_ids[:, 1:], loss_mask=mask[:, 1:],
                 gen_logp=gen_logp[:, 1:], token_rewards=rewards[:, 1:], length=attn.sum(-1))
    return {k: v.to(device) for k, v in batch.items()}


def micro_view(batch: dict, idx: torch.Tensor) -> dict:
    """Rows idx of the batch, with columns trimmed to the longest row among them."""
    L = int(batch["length"][idx].max())
    view = {k: batch[k][idx, :L] for k in ("input_ids", "attention_mask")}
    view.update({k: batch[k][idx, : L - 1] for k in ("targets", "loss_mask")}, L=L, idx=idx)
    return view


########################################################################################################################
# UPDATE — policy, critic and the forward passes they share
########################################################################################################################


class Critic(nn.Module):
    """A separate copy of the language model's body with a scalar value head (RAGEN's PPO critic)."""

    def __init__(self, path: str, dtype, trust_remote_code: bool = False):
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.head = nn.Linear(self.body.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: advantages begin as plain returns
        nn.init.zeros_(self.head.bias)

    def forward(self, mb: dict) -> torch.Tensor:
        h = self.body(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).last_hidden_state  # (b, L, H)
        return self.head(h[:, :-1].float()).squeeze(-1)  # (b, L - 1): the state just before each next token


def policy_forward(model, mb: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the sampled tokens, (b, L - 1), zero elsewhere.

    Only the trained positions go through the LM head: observation tokens get no logits at all, so they can never
    leak into the policy loss or the entropy (and a 150k-word vocabulary never meets 3600 positions at once).
    """
    h = model.base_model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).last_hidden_state  # (b, L, H)
    trained = mb["loss_mask"].bool()  # (b, L - 1)
    logits = model.get_output_embeddings()(h[:, :-1][trained]).float() / temperature  # (M, V): M trained tokens
    logp = torch.zeros(trained.shape, device=h.device)  # (b, L - 1)
    entropy = torch.zeros(trained.shape, device=h.device)  # (b, L - 1)
    logp[trained] = common.token_logprobs(logits[None], mb["targets"][trained][None], 1.0)[0]  # (M,)
    entropy[trained] = common.entropy_from_logits(logits)  # (M,)
    return logp, entropy


def micro_batches(n: int, size: int, generator=None):
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    return [order[i : i + size] for i in range(0, n, size)]


########################################################################################################################
# MAIN
########################################################################################################################


def resolve_args(args: Args):
    """Check every flag and fill the derived defaults. Runs before any model loads; bad input exits with one line."""
    if args.resume:  # continue with the saved settings; a flag given now (other than its default) still wins
        if not args.output_dir:
            common.fail("--resume", "needs --output-dir, the folder of the run to continue")
        saved_path = Path(args.output_dir) / "config.json"
        if not saved_path.exists():
            common.fail("--resume", f"no config.json in {args.output_dir}: nothing to resume")
        saved, defaults = json.loads(saved_path.read_text()), Args()
        for f in fields(Args):
            if f.name in saved and f.name not in ("resume", "overwrite") and getattr(args, f.name) == getattr(defaults, f.name):
                setattr(args, f.name, saved[f.name])
    if args.device == "cuda" and not torch.cuda.is_available():
        common.fail("--device", "cuda requested but no CUDA device is visible")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    model = args.model if args.model != "auto" else (QWEN if device == "cuda" else "tiny")
    if model != "tiny" and not common.model_is_reachable(model):
        common.fail("--model", f"{model!r} is neither a local directory nor reachable on the Hugging Face Hub "
                               f"(offline?); use --model tiny for the embedded model")
    backend = args.backend
    if backend in ("auto", "vllm"):
        try:
            import vllm  # noqa: F401

            has_vllm = device == "cuda"
        except Exception:
            has_vllm = False
        if backend == "vllm" and not has_vllm:
            common.fail("--backend", "vllm needs a CUDA device and the vLLM extra (pip install -r requirements-vllm.txt); use --backend hf")
        backend = "vllm" if has_vllm else "hf"
    defaults = TINY_DEFAULTS if model == "tiny" else PAPER_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    s = args.algo == "starpo-s"
    args.keep_ratio = args.keep_ratio if args.keep_ratio is not None else (0.25 if s else 1.0)
    args.kl_coef = args.kl_coef if args.kl_coef is not None else (0.0 if s else 0.001)
    args.clip_high = args.clip_high if args.clip_high is not None else (0.28 if s else 0.2)
    args.dual_clip = args.dual_clip if args.dual_clip is not None else (3.0 if s else 0.0)
    args.output_dir = args.output_dir or f"runs/frozenlake-{args.algo}-{args.estimator}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"

    checks = [
        ("--group-size", args.group_size >= 2 or args.estimator != "grpo", "must be >= 2 with --estimator grpo (a group of one has no baseline)"),
        ("--group-size", args.group_size >= 1, "must be >= 1"),
        ("--n-groups", args.n_groups >= 1, "must be >= 1"),
        ("--keep-ratio", 0 < args.keep_ratio <= 1, f"must be in (0, 1], got {args.keep_ratio}"),
        ("--dual-clip", args.dual_clip == 0 or args.dual_clip > 1, f"must be > 1 (or 0 = off), got {args.dual_clip}"),
        ("--clip-low", 0 <= args.clip_low < 1, f"must be in [0, 1), got {args.clip_low}"),
        ("--clip-high", args.clip_high >= 0, f"must be >= 0, got {args.clip_high}"),
        ("--kl-coef", args.kl_coef >= 0, f"must be >= 0, got {args.kl_coef}"),
        ("--temperature", args.temperature > 0, "must be > 0"),
        ("--val-temperature", args.val_temperature > 0, "must be > 0"),
        ("--top-p", 0 < args.top_p <= 1, "must be in (0, 1]"),
        ("--lr", args.lr > 0, "must be > 0"),
        ("--critic-lr", args.critic_lr > 0, "must be > 0"),
        ("--steps", args.steps >= 0, "must be >= 0"),
        ("--max-tokens", args.max_tokens >= 1, "must be >= 1"),
        ("--max-tokens", args.max_tokens < args.max_model_len, "must be < --max-model-len"),
        ("--val-size", args.val_size >= 1, "must be >= 1"),
        ("--ppo-epochs", args.ppo_epochs >= 1, "must be >= 1"),
        ("--mini-batch-size", args.mini_batch_size >= 1, "must be >= 1"),
        ("--micro-batch-size", args.micro_batch_size >= 1, "must be >= 1"),
        ("--gen-batch-size", args.gen_batch_size >= 1, "must be >= 1"),
        ("--eval-every", args.eval_every >= 0, "must be >= 0"),
        ("--save-every", args.save_every >= 0, "must be >= 0"),
        ("--keep-checkpoints", args.keep_checkpoints >= 1, "must be >= 1"),
        ("--max-skipped", args.max_skipped >= 1, "must be >= 1"),
        ("--overwrite", not (args.overwrite and args.resume), "cannot be combined with --resume"),
        ("--size", 2 <= args.size <= 16, "must be in [2, 16]"),
        ("--frozen-prob", 0 < args.frozen_prob <= 1, "must be in (0, 1]"),
        ("--max-turns", args.max_turns >= 1, "must be >= 1"),
        ("--max-actions-per-turn", args.max_actions_per_turn >= 1, "must be >= 1"),
        ("--max-actions-per-traj", args.max_actions_per_traj >= 1, "must be >= 1"),
        ("--max-context-turns", args.max_context_turns is None or args.max_context_turns >= 1, "must be >= 1 (omit it for the whole history)"),
        ("--log-rollouts-every", args.log_rollouts_every >= 0, "must be >= 0"),
        ("--sample-every", args.sample_every >= 0, "must be >= 0"),
        ("--vllm-gpu-memory-utilization", 0 < args.vllm_gpu_memory_utilization < 1, "must be in (0, 1)"),
    ]
    for flag, ok, msg in checks:
        if not ok:
            common.fail(flag, msg)
    resume_from = common.prepare_run_dir(Path(args.output_dir), args.resume, args.overwrite)  # last: it may delete files
    return args, device, model, backend, resume_from


def env_kwargs_of(args: Args) -> dict:
    return dict(size=args.size, p=args.frozen_prob, slippery=args.slippery)


TINY_WARMUP_MOVES = 2  # moves in every warm-up answer (see tiny_warmup_examples)
# Tiny-model recipe (keyword arguments of common.build_tiny_model): a longer warm-up than the bandit's, because
# the format now spans several turns; small batches keep the build short.
TINY_BUILD = dict(sft_steps=100, sft_batch_size=16)


def tiny_warmup_examples(args: Args, n: int = 600, seed: int = 0) -> list[tuple[list[dict], str]]:
    """Format-correct transcripts with uniformly random valid moves: the tiny model learns the format only.

    Real episodes on maps from seeds no run trains or evaluates on, played with TINY_WARMUP_MOVES uniformly random
    moves a turn; every turn gives one (chat messages so far, reply) pair, built exactly like the rollout builds
    them. Nothing here looks at the goal or the holes, so which move is good is left to RL. Two moves a turn (not
    1 to 5) keeps replies short, uses the whole 10-move budget in 5 turns, and leaves room to react to slips:
    the best agent that answers two moves a turn scores almost what the closed-loop optimum does.
    """
    # Always the default episode budget, whatever this run's flags: one cached tiny model then serves every budget
    # (e.g. WORKSHOP.md's --max-actions-per-turn 1); it learns the format, and RL adapts it to the rules it is shown.
    d = Args()
    args = replace(args, max_turns=d.max_turns, max_actions_per_turn=d.max_actions_per_turn,
                   max_actions_per_traj=d.max_actions_per_traj)
    rng = random.Random(seed)
    thoughts = ["I move.", "Next move.", "Let me move."]  # a few words: long thoughts would only cost time here
    budget = args.max_actions_per_traj
    examples = []
    for e in range(n):
        env = FrozenLakeEnv(**env_kwargs_of(args))
        messages = first_messages(env.reset(3 * 10**9 + e), args.max_actions_per_turn, budget)
        left = budget
        for j in range(args.max_turns):
            k = min(TINY_WARMUP_MOVES, args.max_actions_per_turn, left)
            moves = [rng.choice(ACTIONS) for _ in range(k)]
            reply = f"<think> {rng.choice(thoughts)} </think> <answer> {' || '.join(moves)} </answer>"
            examples.append((list(messages), reply))
            reward, done = 0.0, False
            for a in moves:
                _, r, done, _ = env.step(a)
                reward += r
                if done:
                    break
            left -= k
            if done or left <= 0 or j + 1 == args.max_turns:
                break
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": turn_prompt(j + 2, env.render(), left, reward)}]
    return examples


def baselines(args: Args) -> dict:
    """Exact success of the uniformly random and the optimal policy on the evaluation maps (same budget)."""
    budget = min(args.max_actions_per_traj, args.max_turns * args.max_actions_per_turn)
    env = FrozenLakeEnv(**env_kwargs_of(args))
    pairs = []
    for i in range(args.val_size):
        env.reset(10**9 + i)
        pairs.append(success_dp(env.desc, budget, args.slippery))
    return {"val/random_success": statistics.mean(p[0] for p in pairs), "val/optimal_success": statistics.mean(p[1] for p in pairs)}


def episode_stats(trajs: list[Trajectory], prefix: str) -> dict:
    """Success, reward and the per-move statistics RAGEN logs, averaged over the trajectories of one batch."""
    turns = [turn for t in trajs for turn in t.turns]
    n_actions = sum(len(turn.actions) for turn in turns)
    return {
        f"{prefix}/success": float(statistics.mean(t.success for t in trajs)),
        f"{prefix}/reward": statistics.mean(t.score for t in trajs),
        f"{prefix}/action_is_valid": float(statistics.mean([turn.info["action_is_valid"] for turn in turns] or [0])),  # share of turns
        f"{prefix}/action_is_effective": sum(turn.info["effective_moves"] for turn in turns) / max(n_actions, 1),  # share of moves
        f"{prefix}/num_actions": n_actions / len(trajs),
        f"{prefix}/num_turns": len(turns) / len(trajs),
    }


def evaluate(generate, tok, args: Args) -> tuple[dict, list[Trajectory]]:
    seeds = [10**9 + i for i in range(args.val_size)]  # fixed, never used for training
    trajs = rollout(generate, tok, seeds, env_kwargs_of(args), args.val_temperature, args)
    return episode_stats(trajs, "val"), trajs


def echo_trap_warnings(history: list[dict], warned: set) -> list[str]:
    """The rule in the module docstring: std collapse, or a gradient-norm spike."""
    out = []
    stds = [h["rollout/in_group_std"] for h in history]
    if len(stds) >= 8 and "std" not in warned:
        best, recent = max(stds[:-3]), statistics.mean(stds[-3:])
        if best > 0 and recent < 0.1 * best:
            warned.add("std")
            out.append(f"in-group reward std collapsed ({best:.3f} -> {recent:.3f}): echo trap, or convergence; check val/success")
    norms = [h["actor/grad_norm"] for h in history if math.isfinite(h.get("actor/grad_norm", float("nan")))]
    if len(norms) >= 6:
        med = statistics.median(norms[-11:-1])
        if med > 0 and norms[-1] > 5 * med:
            out.append(f"gradient norm spiked to {norms[-1]:.3g} (median of the last 10: {med:.3g}): a collapse marker")
    return out


def print_sample(t: Trajectory, step: int) -> None:
    tqdm.write(f"--- step {step} sample (seed {t.seed}): score {t.score:+.3f} success {t.success} "
               + " ".join(f"{k}={v:+.2f}" for k, v in t.parts.items()))
    for j, turn in enumerate(t.turns):
        tqdm.write(f"  turn {j + 1}: " + turn.state.replace("\n", " / ") + f"  ->  {turn.text[:160]!r}")
        tqdm.write(f"          moves {turn.actions}  reward {turn.score:+.2f}")


def main(argv=None):
    args, device, model_name, backend, resume_from = resolve_args(common.parse_args(Args, argv, description=__doc__.split("\n")[0]))
    common.seed_everything(args.seed, device)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # keep stdout to our own progress bar
    model_path = model_name
    if model_name == "tiny":
        model_path = str(common.build_tiny_model("frozenlake", tiny_warmup_examples(args), **TINY_BUILD))
    tqdm.write(f"model: {model_name} ({model_path})  device: {device}  backend: {backend}  algo: {args.algo}  estimator: {args.estimator}")
    if model_name == "tiny":
        tqdm.write("tiny model: CPU-sized defaults " + ", ".join(f"{k}={getattr(args, k)}" for k in TINY_DEFAULTS))
    if resume_from is None:
        (out_dir / "config.json").write_text(json.dumps(dict(asdict(args), task="frozenlake", model_path=model_path, device=device, backend=backend), indent=1))
    # On resume the policy comes from the checkpoint; the reference model (KL) always from the original weights.
    policy_path = str(resume_from / "policy") if resume_from else model_path
    remote = args.trust_remote_code

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=remote)
    tok.pad_token = tok.pad_token or tok.eos_token
    llm = None
    if backend == "vllm":  # build the engine before the optimizer state takes GPU memory
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        llm = LLM(**vllm_engine_kwargs(args, policy_path))
    dtype = torch.float32  # fp32 master weights; bf16 autocast on CUDA
    policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype, trust_remote_code=remote).to(device)
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=remote).to(device).eval() if args.kl_coef > 0 else None
    critic = Critic(model_path, dtype, remote).to(device) if args.estimator == "gae" else None
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay) if critic else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    shuffle_gen = torch.Generator().manual_seed(args.seed)
    start_step, history, warned, skipped_in_a_row = 1, [], set(), 0
    if resume_from is not None:
        state = common.load_checkpoint_state(resume_from)
        opt.load_state_dict(state["opt"])
        if critic is not None:
            critic.load_state_dict(state["critic"])
            critic_opt.load_state_dict(state["critic_opt"])
        common.set_rng_state(state["rng"], shuffle_gen)
        start_step, history, warned, skipped_in_a_row = state["step"] + 1, state["history"], set(state["warned"]), state["skipped_in_a_row"]
        for name in ("metrics.jsonl", "rollouts.jsonl"):  # steps after the checkpoint will be run again
            common.truncate_jsonl(out_dir / name, state["step"])
        tqdm.write(f"resumed from {resume_from} at step {state['step']}")

    def checkpoint(step: int) -> Path:
        state = dict(step=step, opt=opt.state_dict(), rng=common.rng_state(shuffle_gen), history=history,
                     warned=sorted(warned), skipped_in_a_row=skipped_in_a_row)
        if critic is not None:
            state.update(critic=critic.state_dict(), critic_opt=critic_opt.state_dict())
        return common.save_checkpoint(out_dir, step, policy, tok, state, args.keep_checkpoints)

    gen_seconds = [0.0]  # generation time, accumulated by the closure below (the rest of a rollout is the env)

    def generate(prompts, temperature):
        t = time.time()
        policy.eval()
        if llm is not None:
            out = vllm_generate(llm, tok, prompts, temperature, args.top_p, args.max_tokens)
        else:
            with autocast:
                out = hf_generate(policy, tok, prompts, temperature, args.top_p, args.max_tokens, args.gen_batch_size)
        gen_seconds[0] += time.time() - t
        return out

    env_kwargs = env_kwargs_of(args)
    metrics_file = common.Metrics(out_dir / "metrics.jsonl")
    rollouts_file = common.Metrics(out_dir / "rollouts.jsonl")
    stop = common.GracefulStop()
    t_start = time.time()
    scale = baselines(args)  # exact random- and optimal-policy success on the evaluation maps: computed once
    tqdm.write(f"evaluation maps: random policy {scale['val/random_success']:.3f}, optimal policy {scale['val/optimal_success']:.3f} success")
    if resume_from is None:
        val, val_trajs = evaluate(generate, tok, args)
        val.update(scale)
        for t in val_trajs[:64]:
            rollouts_file.write(rollout_record(t, 0, "val"))
        metrics_file.write({"step": 0, **val, "time_s": time.time() - t_start, "timestamp": time.time()})
        tqdm.write(f"step 0  val/success {val['val/success']:.3f}  val/reward {val['val/reward']:.3f}")
        build_report(out_dir)  # report.html: rewritten at every evaluation and at the end
    bar = tqdm(range(start_step, args.steps + 1), desc="starpo-frozenlake", dynamic_ncols=True, initial=start_step - 1, total=args.steps)
    for step in bar:
        t0, gen_seconds[0] = time.time(), 0.0
        # ---- rollout: n_groups fresh seeds, each shared by group_size episodes, all played together --------------
        G, n = args.n_groups, args.group_size
        group_seeds = [args.seed * 10**7 + (step - 1) * G + g for g in range(G)]  # new every step, never repeated
        trajs = rollout(generate, tok, [s for s in group_seeds for _ in range(n)], env_kwargs, args.temperature, args)
        t_gen, t_env = gen_seconds[0], time.time() - t0 - gen_seconds[0]
        scores = torch.tensor([t.score for t in trajs], dtype=torch.float64).view(G, n)  # (G, n)

        # ---- uncertainty filter: train only on the groups whose rewards disagree most -------------------------------
        group_std = scores.std(dim=1) if n > 1 else torch.zeros(G)  # (G,)
        kept = filter_groups(scores, args.keep_ratio, args.filter_mode)  # (K,)
        kept_trajs = [trajs[g * n + m] for g in kept.tolist() for m in range(n)]
        rows = training_rows(kept_trajs, args.max_context_turns, args.turn_rewards)
        batch = collate(rows, tok.pad_token_id, device)
        N = len(rows)
        row_traj = torch.tensor([r.traj for r in rows], device=device)  # (N,): which kept trajectory each row is from
        truncated = torch.tensor([kept_trajs[r.traj].truncated for r in rows], device=device)  # (N,)
        mask = batch["loss_mask"] * (~truncated if args.mask_truncated else torch.ones_like(truncated))[:, None]  # (N, L - 1)

        # ---- old log-probs, reference log-probs, values (no grad) ---------------------------------------------------
        # The hf sampler already scored its tokens with these very weights (tests check the match to 1e-4), so we
        # reuse those log-probs; vLLM's kernels and bf16 differ slightly, so there we recompute them, as veRL does.
        t1 = time.time()
        old_logp = batch["gen_logp"].clone()  # (N, L - 1): the sampler's log-prob of each sampled token, 0 elsewhere
        ref_logp, old_values = torch.zeros_like(old_logp), torch.zeros_like(old_logp)  # (N, L - 1) each
        policy.eval()
        with torch.no_grad(), autocast:
            for idx in micro_batches(N, args.micro_batch_size):
                mb = micro_view(batch, idx)
                if llm is not None:
                    old_logp[idx, : mb["L"] - 1] = policy_forward(policy, mb, args.temperature)[0]
                if ref is not None:
                    ref_logp[idx, : mb["L"] - 1] = policy_forward(ref, mb, args.temperature)[0]
                if critic is not None:
                    old_values[idx, : mb["L"] - 1] = critic(mb).float()
        t_logprob = time.time() - t1

        # ---- advantages -----------------------------------------------------------------------------------------
        kept_scores = scores[kept]  # (K, n)
        if args.estimator == "grpo":
            adv_traj = group_advantages(kept_scores, norm_std=args.norm_adv_by_std).view(-1).float().to(device)  # (K * n,)
            advantages = adv_traj[row_traj][:, None] * mask  # (N, L - 1): the trajectory's value on every sampled token
            returns = None
        else:
            # Each turn's reward sits on its last sampled token; the observation tokens between turns are masked,
            # so gae carries the advantage across them and the turns chain into one sequence.
            advantages, returns = gae(batch["token_rewards"], old_values, mask, args.gamma, args.lam)  # (N, L - 1) each
            advantages = masked_whiten(advantages, mask)

        # ---- PPO update --------------------------------------------------------------------------------------------
        t2 = time.time()
        policy.train()
        stats: dict[str, list] = {}
        skipped = 0
        for _ in range(args.ppo_epochs):
            for mini in micro_batches(N, args.mini_batch_size, shuffle_gen):
                opt.zero_grad(set_to_none=True)
                if critic_opt:
                    critic_opt.zero_grad(set_to_none=True)
                mini_mask, finite = mask[mini], True
                for idx in micro_batches(len(mini), args.micro_batch_size):
                    mb = micro_view(batch, mini[idx])
                    i, cols = mb["idx"], mb["L"] - 1
                    m = mask[i, :cols]  # (b, L - 1)
                    w = common.micro_batch_weight(m, mini_mask, args.loss_agg)  # micro-batches add up to the mini-batch loss
                    with autocast:
                        logp, entropy = policy_forward(policy, mb, args.temperature)  # (b, L - 1) each
                    pg, pg_stats = policy_loss(logp, old_logp[i, :cols], advantages[i, :cols], m, args.clip_low,
                                               args.clip_high, args.dual_clip or None, args.loss_agg)
                    ent = agg_loss(entropy, m, args.loss_agg)
                    loss = pg - args.entropy_coef * ent
                    if ref is not None:
                        kl = agg_loss(kl_penalty(logp, ref_logp[i, :cols], args.kl_kind), m, args.loss_agg)
                        loss = loss + args.kl_coef * kl
                        pg_stats["kl_loss"] = kl.item()
                    if critic is not None:
                        with autocast:
                            values = critic(mb)  # (b, L - 1)
                        vf, vf_stats = value_loss(values, old_values[i, :cols], returns[i, :cols], m, args.value_clip, args.loss_agg)
                        loss = loss + vf  # separate parameters and optimizers: one backward serves both
                        pg_stats.update(vf_stats)
                    finite = finite and bool(torch.isfinite(loss))
                    if finite:
                        (loss * w).backward()
                    pg_stats["entropy"] = ent.item()
                    for k, v in pg_stats.items():
                        stats.setdefault(k, []).append(v)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip).item()
                if critic is not None:
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
                if finite and math.isfinite(grad_norm):
                    stats.setdefault("grad_norm", []).append(grad_norm)
                    opt.step()
                    if critic_opt:
                        critic_opt.step()
                else:  # one NaN/inf would poison the weights and the Adam state: skip this update entirely
                    skipped += 1
        skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
        if llm is not None:
            vllm_push_weights(llm, policy)
        t_update = time.time() - t2

        # ---- log -------------------------------------------------------------------------------------------------
        replies = [turn for t in trajs for turn in t.turns]
        record = {
            "step": step,
            **episode_stats(trajs, "train"),
            "train/context_overflow": sum(t.context_overflow for t in trajs),
            "rollout/in_group_std": group_std.mean().item(),
            "rollout/chosen_in_group_std": group_std[kept].mean().item(),
            "rollout/zero_std_frac": (group_std < 1e-6).float().mean().item(),
            "rollout/kept_groups": len(kept),
            "rollout/trained_rows": N,
            "rollout/truncated_frac": statistics.mean(t.truncated for t in trajs),
            "response_length/mean": statistics.mean([t.turn_last_index[j] - t.turn_starts[j] + 1 for t in trajs for j in range(len(t.turns))] or [0]),
            "sequence_length/mean": statistics.mean(len(t.ids) for t in trajs),
            "think_length/mean": statistics.mean([len(turn.think or "") for turn in replies] or [0]),
            **{f"rubric/{fn.__name__}": statistics.mean(t.parts.get(fn.__name__, 0.0) for t in trajs) for fn, _ in RUBRIC},
            **{("critic/" if k.startswith("vf_") else "actor/") + k: statistics.mean(v) for k, v in stats.items()},
            "actor/skipped_updates": skipped,
            "timing_s/gen": t_gen,
            "timing_s/env": t_env,
            "timing_s/logprob": t_logprob,
            "timing_s/update": t_update,
        }
        if critic is not None:
            ret, val_old = returns[mask.bool()], old_values[mask.bool()]
            record["critic/vf_explained_var"] = (1 - (ret - val_old).var() / (ret.var() + 1e-8)).item() if ret.numel() > 1 else 0.0
        history.append({k: v for k, v in record.items() if k in ("rollout/in_group_std", "actor/grad_norm")})
        if skipped:
            tqdm.write(f"[step {step}] skipped {skipped} update(s): non-finite loss or gradient ({skipped_in_a_row} step(s) in a row)")
        for w_msg in echo_trap_warnings(history, warned):
            tqdm.write(f"[echo-trap warning, step {step}] {w_msg}")
            record["warn/echo_trap"] = 1
        if args.sample_every and step % args.sample_every == 0:
            print_sample(trajs[0], step)
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            te = time.time()
            val, val_trajs = evaluate(generate, tok, args)
            record.update(val, **scale, **{"timing_s/eval": time.time() - te})
            for t in val_trajs[:64]:
                rollouts_file.write(rollout_record(t, step, "val"))
        if args.log_rollouts_every and step % args.log_rollouts_every == 0:
            for t in trajs[::n]:
                rollouts_file.write(rollout_record(t, step, "train"))
        record["timing_s/step"] = time.time() - t0
        record["time_s"], record["timestamp"] = time.time() - t_start, time.time()
        metrics_file.write(record)
        if "val/success" in record:
            build_report(out_dir)
        bar.set_postfix({"succ": f"{record['train/success']:.2f}", "val": f"{record.get('val/success', float('nan')):.2f}",
                         "std": f"{record['rollout/in_group_std']:.3f}", "ent": f"{record.get('actor/entropy', 0):.2f}"})
        if skipped_in_a_row >= args.max_skipped:
            last = common.latest_checkpoint(out_dir)
            common.fail("--max-skipped", f"{skipped_in_a_row} steps in a row had a non-finite loss or gradient; stopped "
                                         f"without saving. Last good checkpoint: {last or 'none'}")
        if step == args.steps or (args.save_every and step % args.save_every == 0) or stop.requested:
            path = checkpoint(step)
            if stop.requested and step < args.steps:
                tqdm.write(f"stopped by {stop.requested} after step {step}; checkpoint {path}. Continue with: "
                           f"python starpo_frozenlake.py --resume --output-dir {out_dir}")
                raise SystemExit(130 if stop.requested == "SIGINT" else 143)
    metrics_file.close()
    rollouts_file.close()
    evals = [r for r in read_jsonl(out_dir / "metrics.jsonl") if "val/success" in r]
    last = common.latest_checkpoint(out_dir)  # None after --steps 0
    tqdm.write(f"done: {args.steps} steps in {time.time() - t_start:.0f}s, final val/success {evals[-1]['val/success']:.3f} "
               f"(random {scale['val/random_success']:.3f}, optimal {scale['val/optimal_success']:.3f}); "
               f"policy: {last / 'policy' if last else 'none saved'}; report: {build_report(out_dir)}")


if __name__ == "__main__":
    main()
