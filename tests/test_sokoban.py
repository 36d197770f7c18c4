"""starpo_sokoban.py: rules, room generation, the BFS solver, parsing, budget, token accounting, flags, smoke runs,
resume, the non-finite guard and --mask-truncated."""

import itertools
import json
import random

import pytest
import torch

import plumbing.engine
import plumbing.flags
import plumbing.forward
import plumbing.run
import plumbing.tiny
import starpo_sokoban as ss
from conftest import TURN_RECORD_KEYS, run_script_file

RUBRIC = plumbing.flags.weighted_rubric(ss.RUBRIC, "paper")[0]  # [(function, weight)] as the paper preset runs it

# ---- rules ------------------------------------------------------------------------------------------------------


def room(grid: str) -> ss.SokobanEnv:
    env = ss.SokobanEnv()
    env.load(grid)
    return env


def rows(env) -> list[str]:
    return [line.replace(" ", "") for line in env.render().splitlines()]


def test_push_moves_the_box_and_the_player():
    env = room("#######\n#P_X_O#\n#######")
    _, r1, done, info = env.step("Right")
    assert rows(env)[1] == "#_PX_O#" and r1 == pytest.approx(-0.1) and not done and info["action_is_effective"]
    _, r2, _, _ = env.step("Right")
    assert rows(env)[1] == "#__PXO#" and r2 == pytest.approx(-0.1)


@pytest.mark.parametrize(
    "grid,action",
    [
        ("#######\n#_PX#O#\n#######", "Right"),  # box against a wall
        ("########\n#PXX_OO#\n########", "Right"),  # box against a second box
        ("#####\n#P_O#\n#X__#\n#####", "Up"),  # walking into a wall
    ],
)
def test_blocked_moves_change_nothing_but_cost_a_step(grid, action):
    env = room(grid)
    before = env.render()
    _, reward, done, info = env.step(action)
    assert env.render() == before and reward == pytest.approx(-0.1) and not done
    assert info["action_is_valid"] and not info["action_is_effective"] and not info["success"]


def test_box_onto_target_solves_a_one_box_room():
    env = room("######\n#PXO_#\n######")
    obs, reward, done, info = env.step("right")  # case-insensitive
    assert reward == pytest.approx(-0.1 + 1 + 10) and done and info["success"] and info["action_is_effective"]
    assert obs.splitlines()[1] == "# _ P √ _ #"


def test_box_on_and_off_target_with_two_boxes():
    env = room("#######\n#PXO__#\n#_XO__#\n#######")
    _, r_on, done, info = env.step("Right")
    assert r_on == pytest.approx(0.9) and not done and not info["success"]  # one of two boxes placed
    _, r_off, _, _ = env.step("Right")
    assert r_off == pytest.approx(-1.1) and rows(env)[1] == "#__SX_#"  # pushed off again; player on the target
    env = room("#######\n#PXO__#\n#_XO__#\n#######")
    env.step("Right")
    for move in ("Left", "Down"):
        env.step(move)
    _, r_last, done, info = env.step("Right")
    assert r_last == pytest.approx(10.9) and done and info["success"]


def test_progress_counts_box_steps_nearer_the_targets():
    view = lambda boxes: dict(boxes=boxes, targets=[[1, 1], [3, 4]])  # noqa: E731 - what describe() gives
    turn = lambda before, after: ss.Turn("", "", None, None, [], False, 0.0, [], view(before), view(after))  # noqa: E731
    assert ss.progress(turn([[1, 3]], [[1, 2]])) == 1.0  # one step nearer the target at (1, 1)
    assert ss.progress(turn([[1, 2]], [[1, 3]])) == -1.0
    assert ss.progress(turn([[1, 2], [3, 2]], [[1, 1], [3, 3]])) == 2.0  # each box to its nearest target
    assert ss.progress(ss.Turn("", "", None, None, [], False, 0.0, [])) == 0.0  # no views: nothing to say
    room = ss.SokobanEnv()
    room.reset(7)
    before = room.describe()
    room.step("Up")  # one move: at most one box, one step
    real = ss.Turn("", "", None, None, ["Up"], False, 0.0, [], before, room.describe())
    assert ss.progress(real) in (-1.0, 0.0, 1.0)


def test_rendering_symbols():
    env = room("########\n#S√X_O_#\n#_X____#\n########")
    assert env.render() == "# # # # # # # #\n# S √ X _ O _ #\n# _ X _ _ _ _ #\n# # # # # # # #"
    _, reward, _, _ = env.step("Left")  # into the wall
    assert env.render().splitlines()[1] == "# S √ X _ O _ #" and reward == pytest.approx(-0.1)
    env.step("Down")
    assert env.render().splitlines()[1:3] == ["# O √ X _ O _ #", "# P X _ _ _ _ #"]  # the target reappears


def test_observation_adds_coordinates_unless_turned_off():
    env = room("######\n#PXO_#\n#____#\n######")
    assert (
        env.observation()
        == env.render() + "\nPlayer at row 1, column 1. Box at row 1, column 2. Target at row 1, column 3."
    )
    env.positions = False
    assert env.observation() == env.render()
    two = ss.SokobanEnv(size=8, num_boxes=2)
    assert "Boxes at row" in two.reset(0) and "Targets at row" in two.reset(0)
    assert ss.SokobanEnv(positions=False).reset(0) == ss.SokobanEnv().reset(0).rsplit("\n", 1)[0]


def test_invalid_word_changes_nothing_and_pays_nothing():
    env = room("######\n#PXO_#\n######")
    before = env.render()
    _, reward, done, info = env.step("Jump")
    assert env.render() == before and reward == 0.0 and not done
    assert not info["action_is_valid"] and not info["action_is_effective"]


# ---- room generation ----------------------------------------------------------------------------------------------


def check_well_formed(env: ss.SokobanEnv):
    grid = [line.split(" ") for line in env.render().splitlines()]
    size = env.size
    assert len(grid) == size and all(len(line) == size for line in grid)
    assert all(grid[0][c] == grid[-1][c] == "#" for c in range(size))  # closed by walls
    assert all(grid[r][0] == grid[r][-1] == "#" for r in range(size))
    flat = [ch for line in grid for ch in line]
    assert sum(ch in "PS" for ch in flat) == 1
    boxes = sum(ch in "X√" for ch in flat)
    targets = sum(ch in "O√S" for ch in flat)
    assert boxes == targets == env.num_boxes
    assert not env.solved()  # reverse play always displaces a box


def test_500_rooms_well_formed_and_solvable():
    env = ss.SokobanEnv()
    lengths = []
    for seed in range(500):
        env.reset(seed)
        check_well_formed(env)
        path = ss.solve(env)
        assert path is not None, seed
        lengths.append(len(path))
        copy = room(env.render())  # the rendered grid is the whole state: replaying the path solves it
        for move in path:
            _, _, done, _ = copy.step(move)
        assert done
    # RAGEN's rooms: ~99.7% solvable within 10 moves, a few need 11 or so; a random mover solves ~23%
    assert sum(n <= 10 for n in lengths) / len(lengths) >= 0.98
    assert 2 <= sorted(lengths)[len(lengths) // 2] <= 5


def test_larger_sokoban_rooms():
    env = ss.SokobanEnv(size=8, num_boxes=2)
    for seed in range(20):
        env.reset(seed)
        check_well_formed(env)
        assert ss.solve(env) is not None


def test_room_is_a_pure_function_of_the_seed():
    a, b = ss.SokobanEnv(), ss.SokobanEnv()
    seen = set()
    for seed in range(50):
        grid = a.reset(seed)
        b.reset(seed + 1)
        assert b.reset(seed) == grid  # same seed, same room, whatever came before
        random.seed(seed + 123)  # the global random state plays no part
        assert a.reset(seed) == grid
        seen.add(grid)
    assert len(seen) >= 45  # and different seeds give different rooms


def test_random_success_estimate_matches_reference():
    rng = random.Random(0)
    est = sum(ss.random_success(ss.SokobanEnv(size=6, num_boxes=1), s, 10, 20, rng) for s in range(300)) / 300
    assert 0.17 <= est <= 0.29  # RAGEN's rooms: about 23%


# ---- solver ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid,length",
    [
        ("#####\n#PXO#\n#####", 1),
        ("########\n#P__XO_#\n########", 3),
        ("######\n#__O_#\n#_X__#\n#P___#\n######", 5),  # two pushes at a right angle
        ("######\n#PXO_#\n#_XO_#\n######", 4),  # two boxes: push, walk round, push
        ("#####\n#√P_#\n#####", 0),  # already solved
        ("#####\n#X_O#\n#P__#\n#####", None),  # box in a corner: dead
        ("######\n#P_X_#\n#_#O_#\n######", None),  # box against the top wall, target below it: dead
    ],
)
def test_solver_on_hand_built_rooms(grid, length):
    path = ss.solve(room(grid))
    assert (None if path is None else len(path)) == length


def test_solver_is_optimal_against_brute_force():
    """Every move sequence shorter than the BFS answer fails (exhaustive, on rooms needing at most 5 moves)."""
    env = ss.SokobanEnv()
    checked = 0
    for seed in range(60):
        env.reset(seed)
        n = len(ss.solve(env))
        if n > 5:
            continue
        start = (env.player, env.boxes)
        for k in range(n):
            for seq in itertools.product(ss.DIRECTIONS, repeat=k):
                player, boxes = start
                for step in seq:
                    player, boxes, _ = ss.push(env.floor, player, boxes, step)
                assert boxes != env.targets, (seed, seq)
        checked += 1
    assert checked >= 40


# ---- parsing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer,actions,invalid",
    [
        ("Up", ["Up"], False),
        ("up || LEFT||  down ", ["Up", "Left", "Down"], False),
        ("Up || Jump || Left", ["Up", "Left"], True),  # the bad word is dropped, the turn is flagged
        ("Up ||", ["Up"], True),  # an empty word is not a move
        ("", [], True),
        ("Jump", [], True),
        (None, [], True),  # no <answer> at all
        ("Up || Up || Up || Up || Up || Up || Up", ["Up"] * 5, False),  # at most max_actions per turn
        ("Up Left", [], True),  # words must be separated by ||
    ],
)
def test_parse_actions(answer, actions, invalid):
    assert ss.parse_actions(answer, 5) == (actions, invalid)


@pytest.mark.parametrize(
    "text,think,answer",
    [
        ("<think> go </think> <answer> Up || Left </answer>", "go", "Up || Left"),
        ("<answer>Down</answer>", None, "Down"),
        ("<think>x</think><answer>Up</answer><answer>Down</answer>", "x", None),
        ("", None, None),
    ],
)
def test_parse_reply(text, think, answer):
    assert ss.parse_reply(text) == (think, answer)


def test_outcome_words_name_what_each_move_does():
    """--outcomes: one word a move (wall, to, floor, push, away, target), the Moves line under the room, and the
    think's restated line outcome first; the room itself is left as it was."""
    env = ss.SokobanEnv(outcomes=True)
    room = "# # # # # # #\n# P _ X _ O #\n# _ _ _ _ _ #\n# # # # # # #"
    obs = env.load(room)
    assert {a: env.outcome(a) for a in ss.ACTIONS} == dict(Up="wall", Down="floor", Left="wall", Right="to")
    assert obs.endswith("\nMoves: Up wall, Down floor, Left wall, Right to.")
    assert env.perceive() == "wall Up, floor Down, wall Left, to Right" and env.predict("Right") == ""
    assert ss.world_model_think(env) == env.perceive()
    env.load(room.replace("P _ X", "_ P X"))
    assert env.outcome("Right") == "push" and env.render() == room.replace("P _ X", "_ P X")
    env.load(room.replace("P _ X _", "_ _ X P"))
    assert env.outcome("Left") == "away" and env.outcome("Right") == "floor"  # onto the target cell, off the box
    env.load(room.replace("P _ X _ O", "_ _ _ P X").replace("# _ _ _ _ _ #\n#", "# _ _ _ _ O #\n#"))
    assert env.outcome("Right") == "wall"  # a box against a wall does not move
    env.load("# # # # #\n# P X O #\n# # # # #")
    assert env.outcome("Right") == "target"
    assert ss.SokobanEnv().load(room).count("Moves:") == 0  # off by default (RAGEN's observation)


# ---- rollout with a scripted model: budget, penalties, token accounting ------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = plumbing.tiny.build_tiny_model(
        "sokoban", ss.tiny_warmup_examples(ss.Args(**ss.PRESETS["tiny"])), **ss.TINY_BUILD
    )
    attn = plumbing.engine.attention_implementation("cpu")  # what the script loads on a CPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def scripted(tok, replies: list[str], log: list):
    """A generate() for ONE rollout that answers turn j with replies[j]; a trailing '~' = cut at max_tokens."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        assert len(prompts) == 1
        text = replies[len(log)]
        log.append(prompts)
        cut = text.endswith("~")
        ids = tok(text.rstrip("~"), add_special_tokens=False)["input_ids"] + ([] if cut else [im_end])
        return [(ids, [-0.5] * len(ids))]

    return generate


def reply(*moves, think="t") -> str:
    return f"<think> {think} </think> <answer> {' || '.join(moves)} </answer>"


def run_scripted(tok, seed: int, turns: list[str], **kw):
    args = ss.Args(max_tokens=32, **kw)
    log = []
    (traj,) = ss.rollout(scripted(tok, turns, log), tok, [seed], args, 1.0, RUBRIC)
    return traj, log, args


def unsolved_seed(moves: list[str]) -> int:
    """A seed whose room is still unsolved after playing `moves`."""
    env = ss.SokobanEnv()
    for seed in range(100):
        env.reset(seed)
        if not any(env.step(m)[2] for m in moves):
            return seed
    raise AssertionError("no such seed")


def test_budget_per_turn_and_per_trajectory(tiny):
    _, tok = tiny
    turns = [reply(*["Up", "Down"] * 4), reply(*["Up", "Down"] * 3), reply("Up", "Down", "Up"), reply("Up")]
    traj, log, _ = run_scripted(tok, unsolved_seed(["Up", "Down"] * 5), turns)
    assert [len(t.actions) for t in traj.turns] == [5, 5] and traj.num_actions == 10  # 5 per turn, 10 per episode
    assert len(traj.turns) == len(log) == 2 and not traj.success  # the budget is spent: no third turn
    assert traj.score == pytest.approx(-1.0)  # ten moves at -0.1, no penalty (extra moves are not invalid words)


def test_turn_limit_and_format_penalty(tiny):
    _, tok = tiny
    turns = ["no tags at all", reply("Jump"), reply("Up", "Fly"), reply("Up"), reply("Down"), reply("Up")]
    traj, log, args = run_scripted(tok, unsolved_seed(["Up", "Up", "Down"]), turns)
    assert len(traj.turns) == len(log) == args.max_turns == 5
    assert [t.parts["format_penalty"] for t in traj.turns] == [-1.0, -1.0, -1.0, 0.0, 0.0]
    assert [t.actions for t in traj.turns] == [[], [], ["Up"], ["Up"], ["Down"]]
    w = {fn.__name__: wt for fn, wt in ss.RUBRIC}["format_penalty"]
    assert traj.turns[0].reward == pytest.approx(-w)  # the format penalty, nothing played
    assert traj.turns[2].reward == pytest.approx(-0.1 - w)  # one move played, and the penalty once
    assert traj.score == pytest.approx(sum(t.reward for t in traj.turns)) == pytest.approx(-0.3 - 3 * w)
    assert traj.parts["format_penalty"] == -3.0 and traj.num_actions == 3


def test_reward_on_the_last_allowed_action_counts(tiny):
    """The solving move is the 10th and last of the budget: its +10 must be in the score."""
    _, tok = tiny
    env = ss.SokobanEnv()
    seed = next(s for s in range(200) if env.reset(s) and len(ss.solve(env)) % 2 == 0)
    path = ss.solve(env)
    back = {"Up": "Down", "Down": "Up", "Left": "Right", "Right": "Left"}
    free = next(
        m for m, (dr, dc) in ss.ACTIONS.items() if (env.player[0] + dr, env.player[1] + dc) in env.floor - env.boxes
    )
    moves = [free, back[free]] * ((10 - len(path)) // 2) + path  # walk away and back, then solve on move 10
    traj, _, _ = run_scripted(tok, seed, [reply(*moves[:5]), reply(*moves[5:])])
    assert traj.num_actions == 10 and traj.success and len(traj.turns) == 2
    assert traj.turns[-1].payout == pytest.approx(-0.5 + 11)
    assert traj.score == pytest.approx(-1.0 + 11)


def test_token_accounting_matches_the_chat_format(tiny):
    _, tok = tiny
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [reply("Up"), reply("Left", think="cut here") + "~", reply("Down"), "<think> x </think> <answer> Right"]
    traj, log, args = run_scripted(tok, unsolved_seed(["Up", "Left", "Down"]), turns, max_turns=4)
    assert len(traj.turns) == 4
    # rebuild the chat from the messages the rollout claims to have shown: it must equal the token sequence
    messages = ss.first_messages(traj.turns[0].state, args)
    left = args.max_actions_per_traj
    for j, turn in enumerate(traj.turns):
        messages.append({"role": "assistant", "content": turn.text})
        left -= len(turn.actions)
        if j + 1 < len(traj.turns):
            messages.append(
                {"role": "user", "content": ss.feedback_message(turn.reward, j + 2, traj.turns[j + 1].state, left)}
            )
    assert tok.decode(traj.ids) + "\n" == tok.apply_chat_template(messages, tokenize=False)
    # mask: exactly the sampled tokens (the model's own <|im_end|> included, the one appended after a cut excluded)
    sampled = [
        len(tok(t.rstrip("~"), add_special_tokens=False)["input_ids"]) + (0 if t.endswith("~") else 1) for t in turns
    ]
    assert sum(traj.mask) == sum(sampled) and len(traj.ids) == len(traj.mask) == len(traj.gen_logprobs)
    for j, (start, last) in enumerate(zip(traj.turn_start, traj.turn_last_index)):
        assert last - start + 1 == sampled[j] and all(traj.mask[start : last + 1])
        assert traj.mask[start - 1] == 0 and traj.mask[last + 1 : last + 2] in ([0], [])
    assert traj.ids[traj.turn_last_index[1] + 1] == im_end and traj.mask[traj.turn_last_index[1] + 1] == 0
    assert traj.truncated  # turn 2 was cut: --mask-truncated would leave this whole trajectory untrained
    assert all((lp != 0) == bool(m) for lp, m in zip(traj.gen_logprobs, traj.mask))
    assert traj.ids[-1] == im_end  # no observation after the final turn
    for j, prompts in enumerate(log):  # each turn's prompt was exactly the sequence so far
        assert prompts[0] == traj.ids[: traj.turn_start[j]]


def test_max_context_turns_prompts_and_rows(tiny):
    _, tok = tiny
    turns = [reply("Up"), reply("Left"), reply("Down"), reply("Right")]
    traj, log, _ = run_scripted(
        tok, unsolved_seed(["Up", "Left", "Down", "Right"]), turns, max_context_turns=1, max_turns=4
    )
    first = traj.ids[: traj.first_len]
    assert log[0][0] == first
    for j in range(1, len(log)):  # first prompt + the previous turn (its reply and the feedback) only
        assert log[j][0] == first + traj.ids[traj.turn_start[j - 1] : traj.turn_start[j]]
    rows_ = ss.training_rows([traj], 1)
    assert len(rows_) == len(traj.turns) == 4
    for j, row in enumerate(rows_):
        reply_ids = traj.ids[traj.turn_start[j] : traj.turn_last_index[j] + 1]
        assert row.ids == log[j][0] + reply_ids and row.last_index == [len(row.ids) - 1]
        assert sum(row.mask) == len(reply_ids) and row.mask[-len(reply_ids) :] == [1] * len(reply_ids)


def test_place_rewards_full_history_and_per_turn(tiny):
    _, tok = tiny
    traj, _, _ = run_scripted(
        tok, unsolved_seed(["Up", "Left"]), [reply("Jump"), reply("Up"), reply("Left")], max_turns=3
    )
    r = [t.reward for t in traj.turns]
    full = ss.training_rows([traj], None)
    tr = ss.place_rewards(full, [traj], len(traj.ids) - 1)
    assert tr.sum().item() == pytest.approx(sum(r))
    for j, last in enumerate(traj.turn_last_index):
        assert tr[0, last - 1].item() == pytest.approx(r[j])  # column t scores token t + 1
    per_turn = ss.training_rows([traj], 1)
    tr = ss.place_rewards(per_turn, [traj], max(len(x.ids) for x in per_turn) - 1)
    for j, row in enumerate(per_turn):
        assert tr[j, row.last_index[0] - 1].item() == pytest.approx(sum(r[j:]))  # return-to-go


def test_place_turn_values_covers_each_turns_sampled_tokens_exactly(tiny):
    """turn-grpo: each turn's value on exactly that turn's sampled tokens (once masked), in a full-history row and in
    the one-turn rows of --max-context-turns."""
    _, tok = tiny
    traj, _, _ = run_scripted(
        tok, unsolved_seed(["Up", "Left"]), [reply("Jump"), reply("Up"), reply("Left")], max_turns=3
    )
    values = [[2.0, -1.0, 0.5]]
    full = ss.training_rows([traj], None)
    mask = torch.tensor(full[0].mask[1:], dtype=torch.float)  # column t scores token t + 1
    placed = ss.place_turn_values(full, values, len(traj.ids) - 1)[0] * mask
    for j, (start, last) in enumerate(zip(traj.turn_start, traj.turn_last_index)):
        assert placed[start - 1 : last].tolist() == [values[0][j]] * (last - start + 1)
    assert placed.abs().sum().item() == pytest.approx(
        sum(abs(v) * sum(traj.mask[s : e + 1]) for v, s, e in zip(values[0], traj.turn_start, traj.turn_last_index))
    )
    per_turn = ss.training_rows([traj], 1)
    width = max(len(x.ids) for x in per_turn) - 1
    placed = ss.place_turn_values(per_turn, values, width)
    for j, row in enumerate(per_turn):
        m = torch.zeros(width)
        m[: len(row.ids) - 1] = torch.tensor(row.mask[1:], dtype=torch.float)
        assert set((placed[j] * m)[m.bool()].tolist()) == {values[0][j]}


# ---- log-prob consistency: generation vs the update pass ---------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hidden_states_runs_each_first_prompt_once_and_equals_a_full_pass(tiny, checkpointing):
    """The update's forward pass runs a group's shared first prompt once, yet gives the states and the gradients of
    one pass over the full rows: two groups with first prompts of different lengths, rests of different lengths,
    and a row with nothing after its prompt (an overflowed first prompt). Under --gradient-checkpointing
    (transformers drops a KV cache there) it is that full pass, checkpointed: the same states and gradients."""
    model, _ = tiny
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()  # checkpointing acts in training mode only (dropout is 0 in these models)
    try:
        hidden_states_equals_a_full_pass(model, checkpointing)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


def hidden_states_equals_a_full_pass(model, checkpointing):
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(5, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a, b = draw(7), draw(11)
    rows = [(a, draw(5)), (a, draw(9)), (b, draw(3)), (b, []), (a, draw(2))]
    rows = [ss.Row(i, p + r, [0] * len(p) + [1] * len(r), [0.0] * (len(p) + len(r)), [], [], len(p))
            for i, (p, r) in enumerate(rows)]  # fmt: skip
    mb = ss.micro_view(ss.collate(rows, 0, "cpu"), torch.arange(len(rows)))
    shapes = []
    hook = model.base_model.register_forward_pre_hook(
        lambda m, args, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True
    )
    weights = torch.randn(*mb["input_ids"].shape, model.config.hidden_size, generator=g)
    valid = mb["attention_mask"].bool()
    results = []
    try:
        for shared in (True, False):
            model.zero_grad()
            if shared:
                h = plumbing.forward.hidden_states(model.base_model, mb)
            else:
                h = model.base_model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).last_hidden_state
            (h[valid] * weights[valid]).sum().backward()
            results.append((h[valid].detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    width = mb["input_ids"].shape[1]
    assert shapes[:2] == ([(5, width)] * 2 if checkpointing else [(2, 11), (5, 9)])  # else prompts once, then rests
    (h_shared, g_shared), (h_full, g_full) = results
    torch.testing.assert_close(h_shared, h_full, atol=1e-5, rtol=1e-4)
    assert len(g_shared) == len(g_full) > 10
    for x, y in zip(g_shared, g_full):  # float32 sums in another order: equal to a few millionths of the largest entry
        torch.testing.assert_close(x, y, atol=5e-5 * max(1.0, y.abs().max().item()), rtol=1e-3)


@pytest.mark.parametrize("k", [None, 1])
def test_turn_cache_samples_what_a_full_prefill_samples(tiny, k):
    """Cross-turn KV reuse is exact: under the same random stream a rollout that prefills only each turn's new
    tokens samples the same tokens with the same log-probs as one that prefills the whole episode every turn, across
    two chunks of a batch, shared first prompts and ragged lengths. With --max-context-turns 1 the window drops
    old turns, so every later turn misses and is prefilled whole (still the same samples)."""
    model, tok = tiny
    args = ss.Args(max_tokens=48, max_context_turns=k, max_turns=4)
    caches, calls = [], []

    def generate(prompts, temp, turn_cache, seeds=None):
        caches.append(turn_cache)
        calls.append(len({(i // 4, tuple(p)) for i, p in enumerate(prompts)}))  # distinct prompts per chunk of 4
        return plumbing.engine.hf_generate(model, tok, prompts, temp, 1.0, args.max_tokens, turn_cache, 4)

    runs = []
    for reuse in (False, True):
        torch.manual_seed(0)
        gen = generate if reuse else (lambda prompts, temp, turn_cache, seeds=None: generate(prompts, temp, None))
        runs.append(ss.rollout(gen, tok, [10**9 + i // 2 for i in range(6)], args, 0.7, RUBRIC))
    full, reused = runs
    assert [t.ids for t in full] == [t.ids for t in reused]
    for a, b in zip(full, reused):
        torch.testing.assert_close(torch.tensor(b.gen_logprobs), torch.tensor(a.gen_logprobs), atol=1e-4, rtol=0)
    if k == 0:  # each turn a prompt of its own: nothing to reuse, and the rollout keeps no cache
        assert caches and all(c is None for c in caches)
        return
    cache, calls = caches[-1], calls[len(calls) // 2 :]  # the reusing run's cache and its calls
    assert len(calls) >= 3  # the episodes did go on
    # turn 1 has nothing stored; with k = 1 turn 2 still extends turn 1 (the window is not full yet), then misses
    assert (cache.hits, cache.misses) == (
        (sum(calls[1:]), calls[0]) if k is None else (calls[1], calls[0] + sum(calls[2:]))
    )


@pytest.mark.parametrize("k", [None, 1])
def test_generation_logprobs_match_update_pass(tiny, k):
    """hf backend, float32, real multi-turn rollouts of different lengths in one batch: the training pass re-scores
    every sampled token exactly as the sampler saw it (observation tokens in between, right padding, temperature)."""
    model, tok = tiny
    torch.manual_seed(0)
    args = ss.Args(max_tokens=64, max_context_turns=k)
    gen = lambda prompts, temp, cache, seeds=None: plumbing.engine.hf_generate(
        model, tok, prompts, temp, 1.0, args.max_tokens, cache, 64
    )  # noqa: E731
    trajs = ss.rollout(gen, tok, [10**9 + i for i in range(6)], args, 0.7, RUBRIC)
    rows_ = ss.training_rows(trajs, k)
    assert len({len(r.ids) for r in rows_}) >= 3  # ragged
    batch = ss.collate(rows_, tok.pad_token_id, "cpu")
    mask = batch["loss_mask"]
    logp = torch.zeros_like(mask)
    with torch.no_grad():
        for idx in torch.arange(len(rows_)).split(4):  # micro-batches with different trims
            mb = ss.micro_view(batch, idx)
            logp[idx, : mb["cols"]] = ss.policy_forward(model, mb, 0.7)[0]
    m = mask.bool()
    assert m.sum() > 50  # float32 in another order (cached decode vs one pass): 1e-4, plus 1e-4 of the value
    torch.testing.assert_close(logp[m], batch["gen_logprobs"][m], atol=1e-4, rtol=1e-4)


# ---- flags ------------------------------------------------------------------------------------------------------


def run_script(*flags, timeout=900):
    return run_script_file("starpo_sokoban.py", *flags, timeout=timeout)


def test_bad_flag_fails_in_one_line_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    r = run_script("--max-context-turns", "-1", "--output-dir", str(out), timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: --max-context-turns") and not out.exists()


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--estimator", "grpo", "--group-size", "1"], "--group-size"),
        (["--max-context-turns", "-1"], "--max-context-turns"),
        (["--num-boxes", "0"], "--num-boxes"),
        (["--size", "3"], "--size"),
        (["--max-turns", "0"], "--max-turns"),
        (["--max-actions-per-turn", "0"], "--max-actions-per-turn"),
        (["--max-actions-per-traj", "0"], "--max-actions-per-traj"),
        (["--keep-ratio", "1.5"], "--keep-ratio"),
        (["--max-tokens", "4000"], "--max-tokens"),
        (["--save-every", "-1"], "--save-every"),
        (["--resume", "--overwrite"], "--"),  # --resume with no run here, or the pair itself: either way one line
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flags_fail_before_a_model_loads(flags, needle, tmp_path, monkeypatch, capsys):
    def no_model(*a, **k):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(plumbing.tiny, "build_tiny_model", no_model)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        ss.main([*flags, "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error:"), err
    assert not out.exists()


def test_resume_needs_a_run_and_a_run_needs_resume_or_overwrite(smoke_run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ss.main(["--resume", "--output-dir", str(tmp_path / "empty")])
    assert "--resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ss.main(["--steps", "1", "--output-dir", str(smoke_run[0])])
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err


# ---- whole-script runs -------------------------------------------------------------------------------------------

SMOKE = ["--eval-every", "1", "--val-size", "4", "--n-groups", "2", "--group-size", "2", "--sample-every", "1"]
EXPECTED_KEYS = {
    "train/success",
    "train/reward",
    "train/reward_min",
    "train/reward_max",
    "train/action_is_valid",
    "train/action_is_effective",
    "train/num_actions",
    "train/num_turns",
    "train/context_overflow",
    "rollout/in_group_std",
    "rollout/chosen_in_group_std",
    "rollout/zero_std_frac",
    "rollout/truncated_frac",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/skipped_updates",
    "response_length/mean",
    "rubric/env_reward",
    "rubric/format_penalty",
    "rubric/format_reward",
    "timing_s/gen",
    "timing_s/env",
    "timing_s/logprob",
    "timing_s/update",
    "timing_s/step",
}
VAL_KEYS = {"val/success", "val/reward", "val/random_success", "val/optimal_success", "val/optimal_length/mean"}


def read(path):
    return [json.loads(line) for line in open(path)]


def check_run(run_dir, out: str, gae: bool, kl: bool | None = None):
    rows_ = read(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows_] == [0, 1, 2]
    assert EXPECTED_KEYS <= set(rows_[1]), EXPECTED_KEYS - set(rows_[1])
    assert VAL_KEYS <= set(rows_[0]) and VAL_KEYS <= set(rows_[2]) and "timing_s/eval" in rows_[2]
    assert rows_[0]["val/optimal_success"] >= 0.75 and rows_[0]["val/optimal_length/mean"] > 0
    assert rows_[1]["actor/skipped_updates"] == 0
    assert ("critic/vf_loss" in rows_[1]) == gae and ("actor/kl_loss" in rows_[1]) == (not gae if kl is None else kl)
    ckpt = plumbing.run.latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step-000002" and (ckpt / "policy" / "config.json").exists()
    assert ("critic" in plumbing.run.load_checkpoint_state(ckpt)) == gae
    assert json.loads((run_dir / "config.json").read_text())["task"] == "sokoban"
    assert "sample (seed" in out and "report: " in out
    # rollouts.jsonl: the bandit's schema, one entry per turn; 4 val rooms at steps 0, 1, 2 and one per group in training
    rollouts = read(run_dir / "rollouts.jsonl")
    assert sorted((r["split"], r["step"]) for r in rollouts) == sorted(
        [("val", s) for s in (0, 1, 2) for _ in range(4)] + [("train", s) for s in (1, 2) for _ in range(2)]
    )
    for r in rollouts:
        assert r["task"] == "sokoban" and isinstance(r["success"], bool) and 1 <= len(r["turns"]) <= 5
        for t in r["turns"]:
            assert set(t) == TURN_RECORD_KEYS
            assert set(t["rubric"]) == {
                "env_reward",
                "format_penalty",
                "format_reward",
                "world_model",
                "pick",
                "progress",
            }
            assert set(t["view"]) == {"grid", "legend", "player", "boxes", "targets"}
    # the report draws the room from the environment's own view of it, and the room after the last move
    from plumbing.report import grid_of

    html = (run_dir / "report.html").read_text()
    assert "sokoban" in html
    grid = grid_of(rollouts[0]["turns"][0]["view"])
    assert len(grid["rows"]) == 6 and all(len(row) == 6 for row in grid["rows"]) and grid["legend"]["X"] == "box"
    assert all(grid_of(r["final_view"]) for r in rollouts)
    return rows_


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """StarPO-S with GAE (the paper preset's estimator; the tiny preset's is turn-grpo) for 2 steps with a checkpoint
    after each: shared by the smoke and resume tests."""
    out = tmp_path_factory.mktemp("smoke")
    flags = ("--steps", "2", "--save-every", "1", "--estimator", "gae")
    r = run_script(*flags, *SMOKE, "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout + r.stderr


def test_smoke_two_steps_gae(smoke_run):
    run_dir, out = smoke_run
    check_run(run_dir, out, gae=True)
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step-000001", "step-000002"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--algo", "starpo", "--estimator", "grpo"],
        ["--estimator", "turn-grpo", "--gamma", "0.9"],
        ["--max-context-turns", "1", "--mask-truncated"],
        ["--max-context-turns", "1", "--estimator", "turn-grpo", "--precision", "fp32"],
    ],
)
def test_smoke_two_steps(flags, tmp_path):
    r = run_script("--steps", "2", *SMOKE, "--output-dir", str(tmp_path), *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    rows_ = check_run(tmp_path, r.stdout + r.stderr, gae=False, kl="starpo" in flags)  # the tiny preset: turn-grpo
    if "--max-context-turns" in flags:  # one training row per turn
        assert rows_[1]["rollout/trained_rows"] >= 2
    if "fp32" in flags:  # the float32 sampler's own log-probs are the old ones: no second pass, no gap
        assert "rollout/logprob_diff_mean" not in rows_[1]


def test_bf16_on_the_cpu_samples_from_a_copy_and_recomputes_its_logprobs(tmp_path):
    """--precision bf16, the multi-turn loop (FrozenLake runs the same main): each turn is sampled by the policy's bf16
    copy, refreshed after every update, and the update recomputes the old log-probs at its own precision; their gap
    to the sampler's, over every turn's tokens, is logged. At this learning rate the mean gap measured 0.001, 0.003,
    0.046 over three steps; with the refresh removed, step 3's was 7.2. fp32 (test_smoke_two_steps with
    --precision fp32) logs none."""
    flags = ("--eval-every", "0", "--val-size", "4", "--n-groups", "2", "--group-size", "2", "--sample-every", "0")
    r = run_script("--steps", "3", *flags, "--lr", "1e-2", "--precision", "bf16", "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "precision: bf16" in r.stdout + r.stderr
    rows_ = read(tmp_path / "metrics.jsonl")[1:]
    gaps = [row["rollout/logprob_diff_mean"] for row in rows_]
    assert len(gaps) == 3 and all(0 < g < 0.5 for g in gaps) and rows_[0]["train/num_turns"] > 1, gaps


def test_resume_continues_without_repeating_steps(smoke_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run[0], run_dir)
    r = run_script("--resume", "--steps", "3", "--output-dir", str(run_dir))  # the saved config gives the rest
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    rows_ = read(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows_] == [0, 1, 2, 3]
    assert rows_[:3] == read(smoke_run[0] / "metrics.jsonl")  # the old lines are kept as they were
    assert VAL_KEYS <= set(rows_[3])  # the last step evaluates
    steps = [r["step"] for r in read(run_dir / "rollouts.jsonl")]
    assert steps == sorted(steps) and steps.count(3) == 4 + 2
    assert plumbing.run.latest_checkpoint(run_dir).name == "step-000003"


# ---- numerical guard and --mask-truncated (in-process, with the loop's pieces patched) ----------------------------

IN_PROCESS = ["--n-groups", "2", "--group-size", "4", "--val-size", "4", "--eval-every", "0", "--sample-every", "0"]


def initial_and_saved(run_dir):
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(json.loads((run_dir / "config.json").read_text())["model_path"])
    saved = AutoModelForCausalLM.from_pretrained(plumbing.run.latest_checkpoint(run_dir) / "policy")
    return [torch.equal(a, b) for a, b in zip(init.state_dict().values(), saved.state_dict().values())]


def test_non_finite_loss_skips_updates_then_stops(tmp_path, monkeypatch, capsys):
    real = ss.policy_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(ss, "policy_loss", nan_loss)
    monkeypatch.setitem(ss.SETTINGS, "max_skipped", 2)
    with pytest.raises(SystemExit) as e:
        ss.main([*IN_PROCESS, "--steps", "4", "--save-every", "1", "--output-dir", str(tmp_path)])
    assert e.value.code == 2 and "SETTINGS['max_skipped']" in capsys.readouterr().err
    rows_ = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows_] == [0, 1, 2] and all(r["actor/skipped_updates"] >= 1 for r in rows_[1:])
    assert plumbing.run.latest_checkpoint(tmp_path).name == "step-000001" and all(initial_and_saved(tmp_path))


def test_mask_truncated_means_cut_trajectories_are_not_trained(tmp_path, monkeypatch):
    """--max-tokens 12 cuts every reply (the think alone is longer): with --mask-truncated nothing is trained (weights
    unchanged), without it the cut replies are trained like any other. (A rubric hashing the text gives them
    distinct rewards: a signal to train on.)"""

    def text_hash(t):
        return float(sum(map(ord, t.text)) % 7)

    monkeypatch.setattr(ss, "RUBRIC", [(text_hash, 1.0)])
    monkeypatch.setitem(ss.SETTINGS, "weight_decay", 0.0)  # AdamW's decay would move untrained weights
    flags = [
        *IN_PROCESS,
        "--steps",
        "1",
        "--max-tokens",
        "12",
        "--entropy-coef",
        "0",
        "--estimator",
        "grpo",
        "--keep-ratio",
        "1",
    ]
    ss.main([*flags, "--mask-truncated", "--output-dir", str(tmp_path / "masked")])
    assert read(tmp_path / "masked" / "metrics.jsonl")[1]["rollout/truncated_frac"] == 1.0
    assert all(initial_and_saved(tmp_path / "masked"))
    ss.main([*flags, "--output-dir", str(tmp_path / "trained")])
    assert not all(initial_and_saved(tmp_path / "trained"))
