"""starpo_frozenlake.py: environment, budget and penalty rules, dynamic-programming baselines, multi-turn token
accounting (mask, log-prob consistency, no gradient through observations), flags and a smoke run."""

import contextlib
import copy
import json
import unittest.mock
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from fractions import Fraction
from pathlib import Path
from unittest import mock

import pytest
import torch

import common
import plumbing.engine
import plumbing.flags
import plumbing.forward
import plumbing.run
import plumbing.tiny
from plumbing import report
import starpo_frozenlake as fl
from conftest import ROOT, TURN_RECORD_KEYS, FakeTok, run_script_file, scripted

OPEN_4X4 = ["FFFF", "FSFF", "FFFF", "FFFG"]  # no holes: the player at (1, 1)
UNUSED_DIR = str(Path(tempfile.gettempdir()) / "frozenlake-test-args-never-written")  # resolve_args needs a run dir


def args_for(*flags) -> fl.Args:
    return fl.resolve_args(plumbing.flags.parse_args(fl.Args, ["--model", "tiny", "--output-dir", UNUSED_DIR, *flags]))[
        0
    ]


def test_the_tiny_preset_beats_the_default_algorithm_and_a_typed_one_beats_the_preset():
    """keep_ratio is named by both the tiny preset (0.5) and StarPO-S (0.25): the preset wins over the default
    --algo, an --algo you type wins over the preset, a flag you type wins over both; the paper preset leaves the
    Moves line off (RAGEN's observation)."""
    tiny = args_for()
    assert (tiny.keep_ratio, tiny.algo, tiny.outcomes, tiny.estimator) == (0.5, "starpo-s", True, "turn-grpo")
    assert tiny.kl_coef == 0.0 and tiny.filter == "top_k"  # the rest of StarPO-S still applies
    assert args_for("--algo", "starpo-s").keep_ratio == 0.25
    assert (args_for("--algo", "starpo").keep_ratio, args_for("--algo", "starpo").kl_coef) == (1.0, 0.001)
    assert args_for("--algo", "starpo", "--keep-ratio", "0.75").keep_ratio == 0.75
    paper = args_for("--preset", "paper")
    assert (paper.keep_ratio, paper.outcomes, paper.max_turns, paper.estimator) == (0.25, False, 5, "gae")


def test_a_fork_whose_rubric_lacks_progress_runs_on_the_tiny_preset(monkeypatch):
    """The tiny preset sets no rubric weight (progress's 0.5 is written in RUBRIC), so a fork whose RUBRIC has no
    `progress` runs on the preset unchanged, while a weight you type for a missing component is still an error."""
    assert args_for().rubric_weights == ""
    monkeypatch.setattr(fl, "RUBRIC", [(fl.env_reward, 1.0), (fl.format_penalty, 0.1)])
    assert args_for().rubric_weights == ""
    with pytest.raises(SystemExit):
        args_for("--rubric-weights", "progress=0.5")


# ---- environment ------------------------------------------------------------------------------------------------


def chi_square(counts: Counter, expected: dict, n: int) -> float:
    assert set(counts) <= set(expected), counts
    return sum((counts.get(k, 0) - p * n) ** 2 / (p * n) for k, p in expected.items())


@pytest.mark.parametrize(
    "desc,action,expected",
    [
        # from (1, 1): the chosen direction and the two perpendicular ones, 1/3 each (gymnasium's rule)
        (OPEN_4X4, "Down", {(2, 1): 1 / 3, (1, 0): 1 / 3, (1, 2): 1 / 3}),
        (OPEN_4X4, "Left", {(1, 0): 1 / 3, (0, 1): 1 / 3, (2, 1): 1 / 3}),
        # from the corner (0, 0): Up and its perpendicular Left bump into the border (stay), Right moves
        (["SFFF", "FFFF", "FFFF", "FFFG"], "Up", {(0, 0): 2 / 3, (0, 1): 1 / 3}),
    ],
)
def test_slippery_transition_statistics(desc, action, expected):
    """Chi-square goodness of fit over 3000 seeded episodes; 13.8 is the 0.1% critical value with 2 degrees of freedom
    (10.8 with 1). The draws are seeded, so the test is deterministic."""
    env = fl.FrozenLakeEnv(desc=desc)
    n, counts = 3000, Counter()
    for seed in range(n):
        env.reset(seed)
        env.step(action)
        counts[env.pos] += 1
    critical = 13.8 if len(expected) == 3 else 10.8
    assert chi_square(counts, expected, n) < critical, counts


def test_slips_are_a_pure_function_of_the_seed():
    env = fl.FrozenLakeEnv(desc=OPEN_4X4)
    paths = []
    for _ in range(2):
        env.reset(7)
        paths.append([env.step(a)[0] for a in ["Down", "Right", "Down", "Left"]])
    assert paths[0] == paths[1]


def test_not_slippery_moves_exactly():
    env = fl.FrozenLakeEnv(desc=OPEN_4X4, slippery=False)
    for seed in range(20):
        env.reset(seed)
        env.step("Down")
        assert env.pos == (2, 1)


def independent_path_exists(desc):
    """Breadth-first search written separately from the script's depth-first has_path."""
    n = len(desc)
    start = next((r, c) for r in range(n) for c in range(n) if desc[r][c] == "S")
    frontier, seen = [start], {start}
    while frontier:
        nxt = []
        for r, c in frontier:
            if desc[r][c] == "G":
                return True
            for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= rr < n and 0 <= cc < n and desc[rr][cc] != "H" and (rr, cc) not in seen:
                    seen.add((rr, cc))
                    nxt.append((rr, cc))
        frontier = nxt
    return False


def test_maps_are_deterministic_connected_and_varied():
    maps = [fl.generate_map(seed) for seed in range(1500)]
    holes = []
    for seed, desc in enumerate(maps[:200]):
        assert fl.generate_map(seed) == desc  # a pure function of the seed
        env = fl.FrozenLakeEnv()
        assert env.reset(seed) == env.reset(seed)
    for desc in maps:
        cells = "".join(desc)
        assert len(desc) == 4 and all(len(row) == 4 for row in desc)
        assert set(cells) <= set("SFHG") and cells.count("S") == 1 and cells.count("G") == 1
        assert independent_path_exists(desc)
        holes.append(cells.count("H") / 14)
    assert len({tuple(m) for m in maps}) > 1400  # random start, goal and holes: almost never the same map
    assert 0.12 < statistics.mean(holes) < 0.2  # 0.2 a priori, fewer once unconnected maps are redrawn
    starts = Counter(fl.find(m, "S") for m in maps)
    assert len(starts) == 16  # the start is anywhere, not a fixed corner


def test_symbols_and_rendering():
    env = fl.FrozenLakeEnv(desc=["SH", "FG"], slippery=False, positions=False)
    assert env.reset(0) == "P O\n_ G"
    obs, reward, done, info = env.step("Right")
    assert obs == "_ X\n_ G" and reward == 0.0 and done and not info["success"]
    env.reset(0)
    env.step("Down")
    assert env.render() == "_ O\nP G"
    obs, reward, done, info = env.step("right")  # case-insensitive
    assert obs == "_ O\n_ √" and reward == 1.0 and done and info["success"]
    coords = fl.FrozenLakeEnv(desc=["SH", "FG"], slippery=False)  # --positions, the default: coordinates under it
    assert coords.reset(0) == "P O\n_ G\nPlayer at row 0, column 0. Goal at row 1, column 1."
    assert coords.step("Down")[0].endswith("Player at row 1, column 0. Goal at row 1, column 1.")


def test_outcomes_line_names_what_each_move_reaches_and_matches_a_step():
    """--outcomes: a line under the lake, in the order Left, Down, Right, Up, checked against real moves."""
    env = fl.FrozenLakeEnv(desc=["FFH", "FSF", "FFG"], slippery=False, positions=False, outcomes=True)
    assert env.reset(0).endswith("\nMoves: Left ice, Down to, Right to, Up ice.")
    env.pos = (0, 1)  # the top row: Up bumps into the border, Right is the hole
    assert [env.outcome(a) for a in fl.ACTIONS] == ["ice", "to", "hole", "wall"] and env.pos == (0, 1)
    env.pos = (1, 2)
    assert env.outcome("down") == "goal"
    lake = fl.FrozenLakeEnv(slippery=False, outcomes=True)
    for seed in range(40):
        lake.reset(seed)
        (gr, gc), (r, c) = fl.find(lake.desc, "G"), lake.pos
        for a in fl.ACTIONS:
            said, sim = lake.outcome(a), copy.deepcopy(lake)
            _, _, _, info = sim.step(a)
            nearer = abs(gr - sim.pos[0]) + abs(gc - sim.pos[1]) < abs(gr - r) + abs(gc - c)
            truth = (
                "wall"
                if not info["action_is_effective"]
                else "goal"
                if info["success"]
                else "hole"
                if sim.cell() == "H"
                else "to"
                if nearer
                else "ice"
            )
            assert said == truth, (seed, a)
    assert "Moves:" not in fl.FrozenLakeEnv().reset(0)  # off by default: RAGEN's observation


def test_termination_rewards_validity_and_effectiveness():
    env = fl.FrozenLakeEnv(desc=["SFG", "FFF", "FFF"], slippery=False)
    env.reset(0)
    _, r, done, info = env.step("Up")  # into the border: valid, not effective
    assert (r, done, info["action_is_valid"], info["action_is_effective"]) == (0.0, False, True, False)
    _, r, done, info = env.step("jump")  # not a move: nothing happens
    assert (r, done, info["action_is_valid"], info["action_is_effective"]) == (0.0, False, False, False)
    _, r, done, info = env.step("Right")
    assert (r, done, info["action_is_effective"]) == (0.0, False, True)
    _, r, done, info = env.step("Right")
    assert (r, done, info["success"]) == (1.0, True, True)
    _, r, done, info = env.step("Left")  # after the end: no move, no second reward
    assert (r, done, info["action_is_effective"], env.pos) == (0.0, True, False, (0, 2))


# ---- parsing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer,actions,invalid",
    [
        ("Left || Down", ["Left", "Down"], False),
        (" up||RIGHT ||  down ", ["Up", "Right", "Down"], False),
        ("Left || Jump || Down", ["Left", "Down"], True),  # the bad word is dropped, the turn is flagged
        ("Left ||", ["Left"], True),  # an empty piece is not a move
        ("go left", [], True),
        ("", [], True),
        (None, [], True),  # no <answer> at all
        (
            "Left || Left || Left || Left || Left || Left || Left",
            ["Left"] * 5,
            False,
        ),  # beyond 5: discarded, no penalty
        ("Left Down", [], True),  # the separator is ||
    ],
)
def test_parse_actions(answer, actions, invalid):
    assert fl.parse_actions(answer, 5) == (actions, invalid)


@pytest.mark.parametrize(
    "text,think,answer",
    [
        ("<think> go </think> <answer> Left || Up </answer>", "go", "Left || Up"),
        ("<answer>Down</answer>", None, "Down"),
        ("<think>x</think><answer>Down</answer><answer>Up</answer>", "x", None),
        ("", None, None),
    ],
)
def test_parse_reply(text, think, answer):
    assert fl.parse_reply(text) == (think, answer)


# ---- budget and penalty rules: a scripted "model" replays fixed texts ------------------------------------------------


@contextlib.contextmanager
def on_map(desc, slippery=False):
    """Every episode on one fixed lake (the script draws its maps from seeds: make_env is patched)."""
    with mock.patch.object(fl, "make_env", lambda args: fl.FrozenLakeEnv(desc=desc, slippery=slippery)):
        yield


def run_on(desc, generate, tok, args, seeds=(0,), temperature=1.0, slippery=False):
    with on_map(desc, slippery):
        return fl.rollout(
            generate, tok, list(seeds), args, temperature, plumbing.flags.weighted_rubric(fl.RUBRIC, "paper")[0]
        )


# The rollout's mechanics are tested on RAGEN's observation, budget and rubric, whatever the tiny preset turns on.
MECHANICS = ("--max-turns", "5", "--no-outcomes", "--rubric-weights", "progress=0")


def play(answers, desc, *flags, slippery=False):
    args = args_for(*MECHANICS, *flags)
    generate, tok, calls = scripted(answers)
    return run_on(desc, generate, tok, args, slippery=slippery)[0], calls


CORRIDOR = ["SFFG", "FFFF", "FFFF", "FFFF"]


def test_invalid_words_dropped_and_penalised_once_per_turn():
    t, _ = play(["Right || Jump || fly || Down", "Left"], OPEN_4X4, "--max-turns", "2")
    assert t.turns[0].actions == ["Right", "Down"] and t.turns[0].parts["format_penalty"] == -1.0
    assert t.turns[0].reward == pytest.approx(-0.1)  # once for the turn, not per bad word
    assert t.turns[1].parts["format_penalty"] == 0.0
    assert t.score == pytest.approx(-0.1) and t.parts["format_penalty"] == -1.0


def test_missing_answer_is_penalised_and_the_episode_goes_on():
    args = args_for("--max-turns", "2")
    tok, n = FakeTok(), []

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        n.append(1)
        text = "I just talk" if len(n) == 1 else "<think> t </think> <answer> Right </answer>"
        return [(tok(text)["input_ids"] + [1], [0.0] * (len(text) + 1)) for _ in prompts]

    t = run_on(OPEN_4X4, generate, tok, args)[0]
    assert [turn.actions for turn in t.turns] == [[], ["Right"]]
    assert [turn.parts["format_penalty"] for turn in t.turns] == [-1.0, 0.0]


def test_moves_beyond_the_budget_are_discarded():
    t, calls = play(["Down || Down", "Right || Right || Right"], OPEN_4X4, "--max-actions-per-traj", "3")
    assert [turn.actions for turn in t.turns] == [["Down", "Down"], ["Right"]]
    assert len(calls) == 2 and not t.turns[1].had_invalid  # the budget is not a format error
    # moves beyond --max-actions-per-turn are discarded too
    t, _ = play(
        ["Down || Down || Right || Right || Up || Up"], OPEN_4X4, "--max-actions-per-turn", "3", "--max-turns", "1"
    )
    assert t.turns[0].actions == ["Down", "Down", "Right"]


def test_reward_on_the_last_allowed_action_counts():
    # the goal is 3 moves away and the budget is 3: the third move, the last allowed one, pays
    t, _ = play(["Right || Right", "Right || Down"], CORRIDOR, "--max-actions-per-traj", "3")
    assert t.success and t.turns[1].actions == ["Right"] and t.turns[1].payout == 1.0 and t.score == 1.0
    # ... also on the last allowed turn
    t, _ = play(["Right", "Right", "Right"], CORRIDOR, "--max-turns", "3")
    assert t.success and t.score == 1.0 and len(t.turns) == 3


def test_episode_ends_at_the_goal_in_a_hole_and_after_max_turns():
    t, calls = play(["Right || Right || Right || Down", "Left"], CORRIDOR)
    assert t.turns[0].actions == ["Right", "Right", "Right"] and len(t.turns) == 1 and len(calls) == 1  # goal
    t, _ = play(["Right || Left"], ["SHFG", "FFFF", "FFFF", "FFFF"])
    assert t.turns[0].actions == ["Right"] and not t.success and len(t.turns) == 1  # hole
    t, calls = play(["Up"] * 5, OPEN_4X4)
    assert len(t.turns) == 5 and len(calls) == 5  # max_turns
    assert sum(t.mask) == 5 * (len("<think> t </think> <answer> Up </answer>") + 1)


def test_progress_counts_steps_nearer_the_goal_and_a_hole_as_minus_one():
    moves = ["Right || Right", "Left", "Up", "Down || Down"]  # from (1, 1), the goal at (3, 3)
    t, _ = play(moves, OPEN_4X4, "--max-turns", "4")
    assert [turn.parts["progress"] for turn in t.turns] == [2.0, -1.0, -1.0, 2.0]
    t, _ = play(["Right || Left"], ["SHFG", "FFFF", "FFFF", "FFFF"])
    assert t.turns[0].parts["progress"] == -1.0  # into the hole (one step nearer the goal, but it ends there)
    paper, tiny = (dict(plumbing.flags.weighted_rubric(fl.RUBRIC, preset)[0]) for preset in ("paper", "tiny"))
    assert paper[fl.progress] == 0.0 and tiny[fl.progress] == 0.5  # log only with the paper preset, 0.5 with tiny


def test_observation_shows_reward_lake_and_moves_left():
    t, calls = play(["Right || Jump", "Down"], OPEN_4X4, "--max-turns", "2")
    tok = FakeTok()
    second_prompt = tok.decode(calls[1][0])
    assert "Reward: -0.1\nTurn 2:\nState:\n_ _ _ _\n_ _ P _\n" in second_prompt and "Moves left: 9" in second_prompt
    assert second_prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "Symbols:" in second_prompt and second_prompt.count("Symbols:") == 1  # the rules only once, in turn 1
    assert tok.decode(t.ids).count("<|im_start|>user") == 2  # no observation after the final turn


def test_context_overflow_ends_the_episode():
    args = args_for("--max-model-len", "700", "--max-tokens", "20")
    generate, tok, calls = scripted(["Up"] * 5)
    t = run_on(OPEN_4X4, generate, tok, args)[0]
    assert t.context_overflow and len(t.turns) < 5
    assert all(len(p) + 20 <= 700 for prompts in calls for p in prompts)


def test_max_context_turns_shows_first_prompt_and_last_k_turns():
    _, calls = play(["Up", "Up", "Up", "Up"], OPEN_4X4, "--max-turns", "4", "--max-context-turns", "1")
    tok = FakeTok()
    prompts = [tok.decode(c[0]) for c in calls]
    assert (
        "Turn 1:" in prompts[3]
        and "Turn 4:" in prompts[3]
        and "Turn 2:" not in prompts[3]
        and "Turn 3:" not in prompts[3]
    )
    assert prompts[3].count("<|im_start|>assistant") == 2  # the first prompt's header (+ the last reply), the new one
    assert "Turn 1:" in prompts[2] and "Turn 3:" in prompts[2] and "Turn 2:" not in prompts[2]
    assert "Turn 1:" in prompts[1] and "Turn 2:" in prompts[1]


def test_first_prompt_that_does_not_fit_gets_no_turn():
    args = args_for("--max-model-len", "300", "--max-tokens", "20")  # the first prompt alone is ~450 FakeTok tokens
    generate, tok, calls = scripted(["Up"])
    t = run_on(OPEN_4X4, generate, tok, args)[0]
    assert t.context_overflow and t.turns == [] and calls == [] and sum(t.mask) == 0 and t.score == 0.0
    stats = fl.episode_stats([t], "train")
    assert stats["train/num_turns"] == 0 and stats["train/action_is_valid"] == 0.0
    (row,) = fl.training_rows([t], None)
    assert sum(row.mask) == 0 and not fl.place_rewards([row], [t], len(row.ids)).any()


def test_truncated_reply_is_closed_untrained_and_flagged():
    """A reply cut at --max-tokens (no <|im_end|>): the chat format gets its <|im_end|> back as an untrained token."""
    args = args_for("--max-turns", "2")
    tok = FakeTok()

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        text = "<think> t </think> <answer> Right"  # cut mid-answer
        return [(tok(text)["input_ids"], [-0.5] * len(text)) for _ in prompts]

    t = run_on(OPEN_4X4, generate, tok, args)[0]
    assert [turn.truncated for turn in t.turns] == [True, True] and t.truncated
    end = t.turn_last_index[0]
    assert t.mask[end] == 1 and t.ids[end + 1] == 1 and t.mask[end + 1] == 0  # the appended <|im_end|>: context only
    assert t.turns[0].had_invalid  # no closed <answer>: a format error
    ok, _ = play(["Right"], OPEN_4X4, "--max-turns", "1")
    assert not ok.truncated


def test_rollout_record_schema_and_report_draws_the_lake():
    t, _ = play(["Right || Jump", "Down"], OPEN_4X4, "--max-turns", "2")
    rec = fl.rollout_record(t, 3, "train", fl.TASK)
    assert set(rec) == {"step", "split", "task", "seed", "success", "score", "env_reward", "turns", "final_view"}
    assert (rec["step"], rec["split"], rec["task"], rec["seed"]) == (3, "train", "frozenlake", 0)
    assert rec["score"] == pytest.approx(-0.1) and rec["env_reward"] == 0.0 and rec["success"] is False
    turn = rec["turns"][0]
    assert set(turn) == TURN_RECORD_KEYS
    assert turn["actions"] == ["Right"] and turn["rubric"]["format_penalty"] == -1.0 and turn["env_reward"] == 0.0
    assert turn["score"] == pytest.approx(-0.1)
    json.dumps(rec)  # one line of rollouts.jsonl
    grid = report.grid_of(turn["view"])  # the environment describes itself: no parsing of the prompt text
    assert grid["rows"] == [["_", "_", "_", "_"], ["_", "P", "_", "_"], ["_", "_", "_", "_"], ["_", "_", "_", "G"]]
    assert grid["legend"]["O"] == "hole" and turn["view"]["player"] == [1, 1] and turn["view"]["goal"] == [3, 3]
    assert report.grid_of(rec["final_view"])["rows"][2] == ["_", "_", "P", "_"]  # after Right, then Down
    assert t.turns[1].before == t.turns[0].after  # a turn starts where the last one left the lake


# ---- training rows and rewards (gae) -----------------------------------------------------------------------------


def test_training_rows_place_turn_rewards_on_last_sampled_tokens():
    t, _ = play(["Right || Jump", "Right", "Right"], CORRIDOR, "--max-turns", "3")
    assert [turn.reward for turn in t.turns] == pytest.approx([-0.1, 0.0, 1.0])
    (row,) = fl.training_rows([t], None)
    assert row.ids == t.ids and all(row.mask[i] == 1 for i in t.turn_last_index)
    placed = fl.place_rewards([row], [t], len(row.ids) - 1)[0]  # column c scores token c + 1
    want = {t.turn_last_index[0]: -0.1, t.turn_last_index[2]: 1.0}  # turn 2 earned 0
    assert {c + 1: v for c, v in enumerate(placed.tolist()) if v} == pytest.approx(want)
    rows = fl.training_rows([t], 1)  # one row per turn, return-to-go on its last token
    placed = fl.place_rewards(rows, [t], max(len(r.ids) for r in rows))
    assert [placed[i].sum().item() for i in range(3)] == pytest.approx([0.9, 1.0, 1.0])
    for j, r in enumerate(rows):
        context = t.ids[: t.first_len] + t.ids[t.turn_prompt_start[j] : t.turn_start[j]]
        assert r.ids == context + t.ids[t.turn_start[j] : t.turn_last_index[j] + 1]
        assert sum(r.mask) == t.turn_last_index[j] - t.turn_start[j] + 1 and r.mask[-1] == 1
        assert placed[j][r.last_index[0] - 1].item() == pytest.approx([0.9, 1.0, 1.0][j])


# ---- dynamic-programming baselines, worked by hand ---------------------------------------------------------------


def test_dp_2x2_open():
    """P G / _ _. One move: Right reaches G with 1/3 (Up stays, Down goes to (1, 0)); Up and Down also slip right
    with 1/3; Left never reaches G. Optimal 1/3, random (0 + 1/3 + 1/3 + 1/3) / 4 = 1/4. Without slipping: 1 and 1/4."""
    desc = ["SG", "FF"]
    assert fl.success_dp(desc, 1) == pytest.approx((1 / 4, 1 / 3))
    assert fl.success_dp(desc, 1, slippery=False) == pytest.approx((1 / 4, 1.0))
    assert fl.success_dp(desc, 0) == (0.0, 0.0)
    rand, best = fl.success_dp(desc, 200)
    assert best == pytest.approx(1.0, abs=1e-6) and rand == pytest.approx(1.0, abs=1e-6)  # no holes: eventually


def test_dp_2x2_with_hole():
    """P O / _ G. G is two cells away: the first move must reach (1, 0), which Left, Down and Right do with 1/3
    (Up cannot); from (1, 0), Right, Down and Up reach G with 1/3. Optimal: 1/3 * 1/3 = 1/9.
    Random: P(reach (1, 0)) = (1/3 + 1/3 + 1/3 + 0) / 4 = 1/4, then 3/4 * 1/3 = 1/4: 1/16."""
    desc = ["SH", "FG"]
    assert fl.success_dp(desc, 1) == pytest.approx((0.0, 0.0))
    assert fl.success_dp(desc, 2) == pytest.approx((1 / 16, 1 / 9))


def test_dp_3x3_hand_worked():
    """O P O / O G O / O O O. From P: Left and Right reach G with 1/3, stay (bump the border) with 1/3, fall with
    1/3; Down reaches G with 1/3 and falls with 2/3; Up stays with 1/3 and falls with 2/3.
    Optimal: V_k = 1/3 + V_{k-1}/3 (Left): 1/3, 4/9, 13/27. Random: R_k = (1 + R_{k-1}) / 4: 1/4, 5/16, 21/64."""
    desc = ["HSH", "HGH", "HHH"]
    opt, rnd = Fraction(0), Fraction(0)
    for k in range(1, 6):
        opt, rnd = Fraction(1, 3) + opt / 3, (1 + rnd) / 4
        assert fl.success_dp(desc, k) == pytest.approx((float(rnd), float(opt)), abs=1e-12)
    assert (opt, rnd) != (0, 0) and fl.success_dp(desc, 3) == pytest.approx((21 / 64, 13 / 27))


def test_dp_baselines_on_the_evaluation_maps():
    """The scale the script logs next to val/success: random well below optimal, both in the range RAGEN reports
    describes (random about a fifth, optimal about a half: the closed-loop optimum, an upper bound for the agent)."""
    scale = fl.baselines(args_for())
    assert 0.18 < scale["val/random_success"] < 0.26 and 0.42 < scale["val/optimal_success"] < 0.56


# ---- token accounting with the tiny model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = plumbing.tiny.build_tiny_model("frozenlake", fl.tiny_warmup_examples(args_for()), **fl.TINY_BUILD)
    return (
        AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.float32,
            attn_implementation=plumbing.engine.attention_implementation("cpu"),
            trust_remote_code=False,
        ).eval(),
        AutoTokenizer.from_pretrained(path, trust_remote_code=False),
    )


def recorded_rollout(tiny, flags, n=6, temperature=0.8):
    """A 3-turn rollout with the tiny model on a lake without holes (so episodes last), recording what was sampled."""
    model, tok = tiny
    args = args_for("--max-turns", "3", *flags)
    record = []

    def generate(prompts, temp, turn_cache, seeds=None):
        out = plumbing.engine.hf_generate(model, tok, prompts, temp, 1.0, args.max_tokens, turn_cache, 64)
        record.append((prompts, out))
        return out

    torch.manual_seed(0)
    trajs = run_on(
        ["SFFF", "FFFF", "FFFF", "FFFG"], generate, tok, args, seeds=range(n), temperature=temperature, slippery=True
    )
    return args, trajs, record


def test_mask_covers_exactly_the_sampled_tokens(tiny):
    model, tok = tiny
    args, trajs, record = recorded_rollout(tiny, [])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert max(len(t.turns) for t in trajs) == 3

    def slot(j, i):  # position of trajectory i in turn j's batched generate call (the episodes still running)
        return [k for k, tt in enumerate(trajs) if len(tt.turns) > j].index(i)

    for i, t in enumerate(trajs):
        sampled = [record[j][1][slot(j, i)] for j in range(len(t.turns))]
        expected_ids, expected_mask = t.ids[: t.first_len], [0] * t.first_len
        for j, (r_ids, r_lps) in enumerate(sampled):
            assert record[j][0][slot(j, i)] == t.ids[: t.turn_start[j]]  # generation saw exactly the history so far
            assert t.ids[t.turn_start[j] : t.turn_last_index[j] + 1] == r_ids  # the exact sampled tokens
            assert t.gen_logprobs[t.turn_start[j] : t.turn_last_index[j] + 1] == r_lps
            expected_ids = expected_ids + r_ids
            expected_mask = expected_mask + [1] * len(r_ids)
            if r_ids[-1] != im_end:  # cut at max_tokens: the closing <|im_end|> is context, not trained
                expected_ids, expected_mask = expected_ids + [im_end], expected_mask + [0]
            end = t.turn_start[j + 1] if j + 1 < len(t.turns) else len(t.ids)
            obs = t.ids[len(expected_ids) : end]
            expected_ids, expected_mask = expected_ids + obs, expected_mask + [0] * len(obs)
        assert t.ids == expected_ids and t.mask == expected_mask
        assert sum(t.mask) == sum(len(r) for r, _ in sampled)
        assert all(lp == 0.0 for lp, m in zip(t.gen_logprobs, t.mask) if m == 0)
        # the text is exactly the chat template applied to the conversation: observations are well-formed turns
        messages = [{"role": "system", "content": fl.SYSTEM_PROMPT}]
        text = tok.decode(t.ids, skip_special_tokens=False)
        users = text.split("<|im_start|>user\n")[1:]
        replies = [tok.decode(r, skip_special_tokens=False).removesuffix("<|im_end|>") for r, _ in sampled]
        for j, user in enumerate(users):
            messages.append({"role": "user", "content": user.split("<|im_end|>")[0]})
            if j < len(replies):
                messages.append({"role": "assistant", "content": replies[j]})
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert text == rendered.removesuffix("\n")  # the last reply ends the sequence, without the newline


@pytest.mark.parametrize("max_context_turns", [None, 1])
def test_update_logprobs_match_generation_and_observations_get_no_gradient(tiny, max_context_turns):
    """float32, hf backend: the update pass re-scores every sampled token exactly as the sampler saw it, in a ragged
    batch of multi-turn rows; the observation tokens get no log-prob, no entropy and no gradient."""
    model, tok = tiny
    flags = [] if max_context_turns is None else ["--max-context-turns", str(max_context_turns)]
    args, trajs, _ = recorded_rollout(tiny, flags, temperature=0.7)
    rows = fl.training_rows(trajs, args.max_context_turns)
    assert len({len(r.ids) for r in rows}) >= 3  # ragged: right padding is exercised
    batch = fl.collate(rows, tok.pad_token_id, "cpu")
    mb = fl.micro_view(batch, torch.arange(len(rows)))
    mask = batch["loss_mask"].bool()
    with torch.no_grad():
        logp, entropy = fl.policy_forward(model, mb, 0.7)
    assert mask.sum() > 100
    torch.testing.assert_close(logp[mask], batch["gen_logprobs"][mask], atol=1e-4, rtol=0)
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()

    # Gradients: garbage advantages / old log-probs / returns on observation positions must change nothing.
    critic = fl.Critic(str(model.name_or_path), torch.float32, fl.Args())
    torch.manual_seed(1)
    adv = torch.randn(mask.shape) * mask
    old = batch["gen_logprobs"].clone()
    returns = torch.randn(mask.shape)

    def grads(a, o, ret):
        model.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        lp, ent = fl.policy_forward(model, mb, 0.7)
        pg, _ = common.policy_loss(lp, o, a, mask, 0.2, 0.28, 3.0)
        vf, _ = common.value_loss(critic(mb), torch.zeros_like(ret), ret, mask, 0.5)
        (pg - 0.01 * common.agg_loss(ent, mask) + vf).backward()
        return torch.cat(
            [p.grad.flatten() for p in list(model.parameters()) + list(critic.parameters()) if p.grad is not None]
        )

    # One thread: with two, the backward of the index that copies a group's prompt states and KV cache to its rows
    # (hidden_states) accumulates in a varying order, and two identical passes differ by ~3e-9; one thread is
    # deterministic, so the check below stays exact.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clean = grads(adv, old, returns)
        junk = ~mask
        dirty = grads(adv + 1e3 * junk, old - 50.0 * junk, returns + 1e3 * junk)
    finally:
        torch.set_num_threads(threads)
    assert clean.abs().sum() > 0
    torch.testing.assert_close(clean, dirty, atol=0, rtol=0)
    model.zero_grad(set_to_none=True)


def test_update_is_the_same_whatever_the_micro_batch_plan(tiny, monkeypatch):
    """ppo_update cuts a mini-batch into micro-batches of like length (plumbing.forward.micro_batch_plan) to pad less: the
    weights after one optimizer step equal those of one pass over the whole ragged mini-batch."""
    model, tok = tiny
    args, trajs, _ = recorded_rollout(tiny, [], temperature=0.7)
    rows = fl.training_rows(trajs, None) + fl.training_rows(trajs, 1)  # whole episodes and single turns: ragged
    batch = fl.collate(rows, tok.pad_token_id, "cpu")
    mask = batch["loss_mask"]
    plan = plumbing.forward.micro_batch_plan(
        batch["first_len"], batch["rest_len"], batch["group"], args.micro_batch_size
    )
    assert len(plan) > 1  # the ragged rows are split
    torch.manual_seed(1)
    inputs = dict(
        mask=mask,
        advantages=torch.randn(mask.shape) * mask,
        returns=None,
        old_logp=batch["gen_logprobs"].clone(),
        ref_logp=torch.zeros_like(mask),
        old_values=torch.zeros_like(mask),
        tis=None,
    )

    def one_update():
        policy = copy.deepcopy(model)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(0)
        metrics, skipped = fl.ppo_update(
            policy, None, None, opt, None, batch, inputs, args, gen, contextlib.nullcontext()
        )
        assert skipped == 0
        return torch.cat([(p - q).flatten() for p, q in zip(policy.parameters(), model.parameters())]), metrics

    planned, m1 = one_update()
    monkeypatch.setattr(plumbing.forward, "micro_batch_plan", lambda first, *rest: [torch.arange(len(first))])
    whole, m2 = one_update()
    assert whole.abs().sum() > 0
    # The micro-batches sum the gradient in another order, and a weight near 1 (the norms') holds steps only to its
    # float32 spacing, 1.19e-7 (= eps) for |w| in [1, 2): two such steps may differ by that spacing. A CI run saw it
    # once (1 element of 3.3M off by 1.19e-7, against an earlier atol of 1e-7). A wrong plan moves every row by far more.
    assert max(p.abs().max().item() for p in model.parameters()) < 2
    torch.testing.assert_close(planned, whole, rtol=1e-4, atol=2 * torch.finfo(torch.float32).eps)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)


def test_one_step_update_takes_the_old_logprobs_from_its_own_pass(tiny):
    """A sampler of another precision (vLLM, the bf16 copy) needs the old log-probs recomputed; with one optimizer step
    per update (--ppo-epochs 1, all rows in one mini-batch) old_logprobs skips that pass and ppo_update takes them, the
    logged gap and the TIS weights from its own: the weights after the step and the gap equal those of the pass."""
    from dataclasses import replace

    model, tok = tiny
    args, trajs, _ = recorded_rollout(tiny, [], temperature=0.7)
    rows = fl.training_rows(trajs, None) + fl.training_rows(trajs, 1)
    batch = fl.collate(rows, tok.pad_token_id, "cpu")
    mask = batch["loss_mask"]
    torch.manual_seed(1)
    batch["gen_logprobs"] = batch["gen_logprobs"] + 0.05 * torch.randn(mask.shape) * mask  # another sampler's
    one = replace(args, ppo_epochs=1, mini_batch_size=len(rows), tis_cap=1.5)
    nc = contextlib.nullcontext()
    passed, gap = fl.old_logprobs(model, None, None, batch, mask, replace(one, mini_batch_size=1), True, nc)
    deferred, none = fl.old_logprobs(model, None, None, batch, mask, one, True, nc)
    assert deferred["old_logp"] is None and none == {} and "tis" not in deferred  # (TIS: ppo_update's, from old)
    assert passed["old_logp"] is not None and gap["rollout/logprob_diff_mean"] > 0.01

    def one_update(old):
        policy = copy.deepcopy(model)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        inputs = dict(mask=mask, advantages=torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask,
                      returns=None, **old)  # fmt: skip
        metrics, skipped = fl.ppo_update(policy, None, None, opt, None, batch, inputs, one, torch.Generator(), nc)
        assert skipped == 0
        return torch.cat([(p - q).flatten() for p, q in zip(policy.parameters(), model.parameters())]), metrics

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same order of sums in both (see the gradient test above)
    try:
        with_pass, m1 = one_update(passed)
        own, m2 = one_update(deferred)
    finally:
        torch.set_num_threads(threads)
    assert own.abs().sum() > 0
    torch.testing.assert_close(with_pass, own, rtol=1e-4, atol=2 * torch.finfo(torch.float32).eps)
    assert m2["rollout/logprob_diff_mean"] == pytest.approx(gap["rollout/logprob_diff_mean"], rel=1e-4)
    assert m2["rollout/logprob_diff_max"] == pytest.approx(gap["rollout/logprob_diff_max"], rel=1e-4)
    assert "rollout/logprob_diff_mean" not in m1 and m2["actor/ppo_kl"] == 0.0  # ratio 1 on its own pass


def test_tiny_warmup_is_random_and_format_correct():
    """The warm-up teaches the format on real episodes; its moves are uniformly random (never the solver's)."""
    examples = fl.tiny_warmup_examples(args_for())
    moves = Counter()
    for messages, last in examples:
        for reply in [m["content"] for m in messages if m["role"] == "assistant"] + [last]:
            think, answer = fl.parse_reply(reply)
            actions, bad = fl.parse_actions(answer, 5)
            assert think is not None and not bad and fl.FORMAT_RE.fullmatch(reply)
            moves.update(actions)
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
    total = sum(moves.values())
    assert all(abs(moves[a] / total - 0.25) < 0.02 for a in fl.ACTIONS), moves
    assert max(len(m) for m, _ in examples) > 4  # later turns too, with the whole history


# ---- flags and whole-script runs ---------------------------------------------------------------------------------

SMALL = ["--val-size", "6", "--n-groups", "2", "--group-size", "3", "--eval-every", "1", "--sample-every", "1"]


def run_script(*flags, timeout=600):
    return run_script_file("starpo_frozenlake.py", *flags, timeout=timeout)


def read(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--max-context-turns", "-1"], "--max-context-turns"),
        (["--max-turns", "0"], "--max-turns"),
        (["--max-actions-per-turn", "0"], "--max-actions-per-turn"),
        (["--max-actions-per-traj", "0"], "--max-actions-per-traj"),
        (["--estimator", "ppo"], "--estimator"),
        (["--resume"], "--resume"),  # nothing to resume in an empty folder
    ],
)
def test_bad_flags_fail_fast_with_one_line(flags, needle, tmp_path):
    out = tmp_path / "run"
    r = run_script(*flags, "--output-dir", str(out), timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error:"), r.stderr
    assert not out.exists()


EXPECTED_KEYS = {
    "train/success",
    "train/reward",
    "train/action_is_valid",
    "train/action_is_effective",
    "train/num_actions",
    "train/num_turns",
    "train/context_overflow",
    "rollout/in_group_std",
    "rollout/chosen_in_group_std",
    "rollout/zero_std_frac",
    "rollout/filter_kept_count",
    "rollout/truncated_frac",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/skipped_updates",
    "response_length/mean",
    "think_length/mean",
    "rubric/env_reward",
    "rubric/format_penalty",
    "rubric/format_reward",
    "timing_s/gen",
    "timing_s/env",
    "timing_s/logprob",
    "timing_s/update",
    "timing_s/step",
    "time_s",
    "timestamp",
}
VAL_KEYS = {
    "val/success",
    "val/reward",
    "val/random_success",
    "val/optimal_success",
    "val/action_is_valid",
    "val/action_is_effective",
    "val/num_actions",
    "val/num_turns",
}


@pytest.fixture(scope="module")
def gae_run(tmp_path_factory):
    """A 2-step run of PPO with a critic (turn rewards), checkpointing every step."""
    out = tmp_path_factory.mktemp("gae")
    r = run_script(*SMALL, "--steps", "2", "--estimator", "gae", "--save-every", "1", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout + r.stderr


def test_smoke_two_steps_writes_every_output(gae_run):
    out, log = gae_run
    rows = read(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert EXPECTED_KEYS <= set(rows[1]), EXPECTED_KEYS - set(rows[1])
    assert "critic/vf_loss" in rows[1] and "critic/vf_explained_var" in rows[1]
    assert VAL_KEYS <= set(rows[0]) and VAL_KEYS <= set(rows[2]) and "timing_s/eval" in rows[2]
    assert rows[0]["val/random_success"] < rows[0]["val/optimal_success"]
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    rollouts = read(out / "rollouts.jsonl")
    assert [(r["step"], r["split"]) for r in rollouts].count((0, "val")) == 6  # every val trajectory (<= 64)
    assert [(r["step"], r["split"]) for r in rollouts].count((1, "train")) == 2  # one per group
    assert all(r["task"] == "frozenlake" and r["turns"] for r in rollouts)
    html = (out / "report.html").read_text()
    assert "frozenlake" in html and "optimal" in html
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    ckpt = plumbing.run.latest_checkpoint(out)
    assert ckpt.name == "step-000002" and (ckpt / "policy" / "config.json").exists()
    assert {"opt", "critic", "critic_opt", "rng", "history"} <= set(plumbing.run.load_checkpoint_state(ckpt))
    config = json.loads((out / "config.json").read_text())
    assert config["task"] == "frozenlake" and config["estimator"] == "gae"
    assert "sample (seed" in log and "turn 1:" in log and "done: 2 steps" in log


def test_existing_run_needs_resume_or_overwrite(gae_run):
    out, _ = gae_run
    r = run_script("--steps", "1", "--output-dir", str(out), timeout=120)
    assert (
        r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--resume" in r.stderr and "--overwrite" in r.stderr
    )
    r = run_script("--resume", "--overwrite", "--output-dir", str(out), timeout=120)
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_resume_continues_where_the_checkpoint_left_off(gae_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(gae_run[0], out)
    r = run_script("--resume", "--steps", "3", "--output-dir", str(out))  # the saved config supplies every other flag
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    rows = read(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # each step once
    assert "critic/vf_loss" in rows[3] and "val/success" in rows[3]  # still gae, still evaluating every step
    steps = [r["step"] for r in read(out / "rollouts.jsonl")]
    assert steps == sorted(steps) and steps[-1] == 3
    assert plumbing.run.latest_checkpoint(out).name == "step-000003"


def test_smoke_grpo_with_kl_and_one_row_per_turn(tmp_path):
    r = run_script(
        *SMALL, "--steps", "2", "--algo", "starpo", "--max-context-turns", "1", "--output-dir", str(tmp_path)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert EXPECTED_KEYS <= set(rows[1]) and "actor/kl_loss" in rows[1] and "critic/vf_loss" not in rows[1]
    assert rows[1]["rollout/trained_rows"] >= rows[1]["rollout/filter_kept_count"] * 3  # a row per turn
    assert (tmp_path / "report.html").exists() and plumbing.run.latest_checkpoint(tmp_path).name == "step-000002"


# ---- in-process runs: guards (the loop's pieces patched) ------------------------------------------------------------

# (The episode budget stays at its defaults: the tiny model's warm-up depends on it, and a rebuild takes minutes.)
IN_PROCESS = ["--val-size", "2", "--n-groups", "2", "--group-size", "4", "--eval-every", "0", "--sample-every", "0"]


def weights_after(tmp_path, *flags):
    with unittest.mock.patch.dict(fl.SETTINGS, weight_decay=0.0):  # AdamW's decay would move untrained weights
        fl.main(
            [
                *IN_PROCESS,
                "--output-dir",
                str(tmp_path),
                "--steps",
                "1",
                "--entropy-coef",
                "0",
                "--keep-ratio",
                "1",
                *flags,
            ]
        )
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(
        json.loads((tmp_path / "config.json").read_text())["model_path"], trust_remote_code=False
    )
    saved = AutoModelForCausalLM.from_pretrained(
        plumbing.run.latest_checkpoint(tmp_path) / "policy", trust_remote_code=False
    )
    return [torch.equal(a, b) for a, b in zip(init.state_dict().values(), saved.state_dict().values())]


def test_mask_truncated_means_cut_replies_are_not_trained(tmp_path, monkeypatch):
    """--max-tokens 16 cuts every reply (the think alone is longer): with --mask-truncated nothing is trained (weights
    unchanged), without it the cut replies are trained like any other. (A rubric hashing the text gives them
    distinct rewards: a signal.)"""

    def text_hash(t):
        return float(sum(map(ord, t.text)) % 7)

    monkeypatch.setattr(fl, "RUBRIC", [(text_hash, 1.0)])
    assert all(weights_after(tmp_path / "masked", "--max-tokens", "16", "--mask-truncated"))
    assert read(tmp_path / "masked" / "metrics.jsonl")[1]["rollout/truncated_frac"] == 1.0
    assert not all(weights_after(tmp_path / "trained", "--max-tokens", "16"))


def test_non_finite_loss_skips_updates_then_stops(tmp_path, monkeypatch, capsys):
    real = fl.policy_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(fl, "policy_loss", nan_loss)
    monkeypatch.setitem(fl.SETTINGS, "max_skipped", 2)
    with pytest.raises(SystemExit) as e:
        fl.main([*IN_PROCESS, "--output-dir", str(tmp_path), "--steps", "3", "--save-every", "1"])
    assert e.value.code == 2
    assert "SETTINGS['max_skipped']" in capsys.readouterr().err
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["actor/skipped_updates"] >= 1 for r in rows[1:])
    assert plumbing.run.latest_checkpoint(tmp_path).name == "step-000001"  # nothing saved after the second bad step


@pytest.mark.parametrize("window", [[], ["--max-context-turns", "1"]])
def test_context_overflow_ends_episodes_cleanly(tmp_path, window):
    """No first prompt fits (--max-model-len 150): no turn is played, nothing is trained, and nothing crashes."""
    fl.main(
        [
            *IN_PROCESS,
            "--output-dir",
            str(tmp_path),
            "--steps",
            "1",
            "--max-model-len",
            "150",
            "--max-tokens",
            "8",
            *window,
        ]
    )
    rows = read(tmp_path / "metrics.jsonl")
    assert rows[1]["train/context_overflow"] == 8 and rows[1]["train/num_turns"] == 0 and rows[0]["val/success"] == 0
    assert math.isfinite(rows[1]["actor/pg_loss"]) and rows[1]["actor/skipped_updates"] == 0


def test_world_model_warmup_runs_before_rl_and_a_resume_reuses_it(tmp_path, capsys):
    """--warmup-steps: the world-model SFT runs once, saves <run>/warmup/, RL starts from it (config's model_path),
    the weights moved, and --resume finds it done instead of warming up again."""
    import torch
    from transformers import AutoModelForCausalLM

    out, flags = (tmp_path / "run", [*IN_PROCESS, "--warmup-steps", "2"])
    fl.main([*flags, "--output-dir", str(out), "--steps", "1", "--save-every", "1"])
    warm = out / "warmup"
    assert "world-model warm-up: 2 steps of 8" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_path"] == str(warm)
    tiny = plumbing.tiny.build_tiny_model(
        "frozenlake", fl.tiny_warmup_examples(fl.Args(**fl.PRESETS["tiny"])), **fl.TINY_BUILD
    )
    before = AutoModelForCausalLM.from_pretrained(tiny, trust_remote_code=False).state_dict()
    after = AutoModelForCausalLM.from_pretrained(warm, trust_remote_code=False).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    stamp = (warm / "model.safetensors").stat().st_mtime_ns
    fl.main([*flags, "--output-dir", str(out), "--steps", "2", "--resume"])
    assert "world-model warm-up" not in capsys.readouterr().out
    assert (warm / "model.safetensors").stat().st_mtime_ns == stamp
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [0, 1, 2]


# ---- the rubric in the file is the rubric that runs -----------------------------------------------------------------


def test_each_weight_says_where_it_came_from():
    rubric, source = plumbing.flags.weighted_rubric(fl.RUBRIC, "tiny")
    assert dict(rubric)[fl.progress] == 0.5 and source["progress"] == "file, preset tiny"
    assert source["env_reward"] == source["format_penalty"] == "file"
    rubric, source = plumbing.flags.weighted_rubric(fl.RUBRIC, "paper", "progress=0.3,format_penalty=0")
    assert dict(rubric)[fl.progress] == 0.3 and source["progress"] == "--rubric-weights"
    assert dict(rubric)[fl.format_penalty] == 0.0 and source["env_reward"] == "file"
    with pytest.raises(ValueError, match="NAME=WEIGHT"):
        plumbing.flags.weighted_rubric(fl.RUBRIC, "tiny", "progres=1")


def test_a_weight_edited_in_a_copy_of_the_script_is_the_weight_trained(tmp_path):
    """A workshop edit: RUBRIC's progress weight set to 0.2 in a copy of the script. The start-up line says so (and
    that it came from the file), and every training turn's score is the weighted sum with 0.2."""
    src = (ROOT / "starpo_frozenlake.py").read_text()
    old = '    (progress, {"tiny": 0.5}),'
    assert src.count(old) == 1
    (tmp_path / "starpo_frozenlake.py").write_text(src.replace(old, "    (progress, 0.2),"))
    out = tmp_path / "run"
    flags = ["--steps", "1", "--n-groups", "2", "--group-size", "4", "--val-size", "4", "--eval-every", "0"]
    flags += ["--sample-every", "1", "--output-dir", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the copy imports common and plumbing from the repository
    r = subprocess.run(
        [sys.executable, str(tmp_path / "starpo_frozenlake.py"), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0.2 * progress [file]" in r.stdout and "0.1 * format_penalty [file]" in r.stdout
    train = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    turns = [turn for rec in train if rec["split"] == "train" for turn in rec["turns"]]
    assert turns and any(turn["rubric"]["progress"] != 0 for turn in turns)
    for turn in turns:
        parts = turn["rubric"]
        expected = parts["env_reward"] + 0.1 * parts["format_penalty"] + 0.2 * parts["progress"]
        assert turn["score"] == pytest.approx(expected)


def progress_as_meant(t) -> float:
    """WORKSHOP.md's per-move component: progress of the moves that went as meant; a slipped move pays nothing."""
    states = [t.before] + [info["after"] for info in t.infos]
    total = 0.0
    for a, b, info in zip(states, states[1:], t.infos):
        (r0, c0), (r1, c1), (gr, gc) = a["player"], b["player"], b["goal"]
        total += 0.0 if info["slipped"] else abs(gr - r0) + abs(gc - c0) - abs(gr - r1) - abs(gc - c1)
    return total


def test_each_move_shows_the_world_after_it_and_whether_it_slipped():
    """Turn.infos holds every played move's world after it (`after`) and, on the lake, whether the ice slipped it, so
    a per-move component (progress_as_meant, WORKSHOP.md) is one small function."""
    t, _ = play(["Right || Right", "Down || Down", "Left || Down"], OPEN_4X4, "--max-turns", "3", slippery=True)
    infos = [info for turn in t.turns for info in turn.infos]
    assert len(infos) >= 4 and any(i["slipped"] for i in infos) and not all(i["slipped"] for i in infos)
    for turn in t.turns:
        states = [turn.before] + [info["after"] for info in turn.infos]
        assert states[-1] == turn.after  # the moves chain from the world before the turn to the world after it
        per_move = [b["player"] != a["player"] for a, b in zip(states, states[1:])]
        assert per_move == [info["action_is_effective"] for info in turn.infos]
        # summed over every move, slips included, per-move progress is the turn's own progress (it telescopes)
        goal = turn.after["goal"]
        dist = [abs(goal[0] - s["player"][0]) + abs(goal[1] - s["player"][1]) for s in states]
        assert sum(a - b for a, b in zip(dist, dist[1:])) == turn.parts["progress"]
        assert progress_as_meant(turn) == sum(a - b for a, b, i in zip(dist, dist[1:], turn.infos) if not i["slipped"])
    env = fl.FrozenLakeEnv(desc=OPEN_4X4, slippery=False)
    env.reset(0)
    assert env.step("Up")[3]["slipped"] is False  # moves that always succeed never slip
