"""The world-model warm-up (SPA): its thoughts are the environment's ground truth, its moves are uniformly random
whatever the state (never a policy), and the world_model rubric scores a think against the truth."""

import copy
import math
import re
from collections import Counter, defaultdict

import pytest

import starpo_frozenlake as fl
import starpo_sokoban as sk
import plumbing.engine
import plumbing.tiny

TASKS = [fl, sk]
WARMUPS = [
    (fl, fl.Args()),
    (fl, fl.Args(outcomes=True)),
    (sk, sk.Args()),
    (sk, sk.Args(outcomes=True)),
]  # --outcomes too


def replay(m, args=None):
    """Every warm-up reply with the environment it was written for: (env before the reply, reply) pairs."""
    args, (first_seed, _) = args or m.Args(), m.TINY_WARMUP_SEEDS
    out = []
    for e, (messages, last) in enumerate(m.tiny_warmup_examples(args)):
        replies = [x["content"] for x in messages if x["role"] == "assistant"] + [last]
        env = m.make_env(args)
        env.reset(first_seed + e)
        for reply in replies:
            out.append((copy.deepcopy(env), reply))
            actions, _ = m.parse_actions(m.parse_reply(reply)[1], args.max_actions_per_turn)
            for a in actions:
                if env.step(a)[2]:
                    break
    return out


@pytest.fixture(scope="module", params=WARMUPS, ids=lambda w: w[0].TASK + ("-outcomes" * getattr(w[1], "outcomes", 0)))
def played(request):
    m, args = request.param
    return m, replay(m, args)


def test_every_warmup_think_is_the_environments_ground_truth(played):
    m, pairs = played
    assert len(pairs) > 500
    for env, reply in pairs:
        think, answer = m.parse_reply(reply)
        actions, invalid = m.parse_actions(answer, 5)
        pick = "".join(f". {env.outcome(a)} {a}" for a in actions) if getattr(env, "outcomes", False) else ""
        assert think == m.world_model_think(env) + pick and m.FORMAT_RE.fullmatch(reply)  # --outcomes: then the pick
        assert not invalid


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square with df degrees of freedom (Wilson-Hilferty; scipy is not a dependency)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def pooled_chi_square(by_state: dict, actions) -> tuple[float, int]:
    """Chi-square of move counts against uniform, summed over the state classes seen at least 20 times, and its df."""
    chi2, df = 0.0, 0
    for counts in by_state.values():
        n = sum(counts.values())
        if n >= 20:
            chi2 += sum((counts[a] - n / len(actions)) ** 2 / (n / len(actions)) for a in actions)
            df += len(actions) - 1
    return chi2, df


def test_warmup_moves_are_uniform_whatever_the_state(played):
    """Chi-square of move counts within each state class (what each move would do, and where the goal lies: all a
    policy could prefer a move by) against the uniform distribution: a solver's or a greedy rule's moves fail it."""
    m, pairs = played
    by_state = defaultdict(Counter)
    for env, reply in pairs:
        state = re.sub(r"\d", "#", m.world_model_think(env))  # the class: outcomes and offsets, not coordinates
        actions, _ = m.parse_actions(m.parse_reply(reply)[1], 5)
        by_state[state].update(actions)
    chi2, df = pooled_chi_square(by_state, m.ACTIONS)
    assert df >= 6 and chi2 < chi_square_critical(df), (chi2, df)


def test_the_uniform_test_catches_a_warmup_that_prefers_good_moves(played):
    """The same statistic on a greedy warm-up (never into a wall or a hole, toward the goal when it can) fails."""
    m, pairs = played
    by_state = defaultdict(Counter)
    for env, _ in pairs:
        think = m.world_model_think(env)
        good = "to|goal|push|target"  # --outcomes words come before their move: "ice Left, to Down", "push Up"
        safe = [a for a in m.ACTIONS if re.search(rf"{a} (_|G|box|to|ice|goal)|({good}|ice|floor) {a}", think)]
        safe = safe or list(m.ACTIONS)
        offset = think.split(". ")[0] if ". " in think else ""  # "at 0 1, goal 3 0: 3 Down 1 Left"
        toward = [a for a in safe if f" {a}" in offset or re.search(rf"{a} (to|goal)|({good}) {a}", think)] or safe
        by_state[re.sub(r"\d", "#", think)][toward[0]] += 1
    chi2, df = pooled_chi_square(by_state, m.ACTIONS)
    assert chi2 > chi_square_critical(df)


def test_predict_leaves_the_world_unchanged_and_matches_a_step():
    env = fl.FrozenLakeEnv(desc=["SFH", "FFG", "FFF"], slippery=True)
    env.reset(0)
    assert [env.predict(a) for a in fl.ACTIONS] == ["wall", "_", "_", "wall"] and env.pos == (0, 0)
    env.pos = (1, 1)
    assert [env.predict(a) for a in fl.ACTIONS] == ["_", "_", "G", "_"]
    env.pos = (0, 1)
    assert env.predict("Right") == "O" and env.perceive() == "at 0 1, goal 1 2: 1 Down 1 Right"
    room = sk.SokobanEnv()
    room.reset(7)
    before = (room.player, room.boxes, room.render())
    for a in sk.ACTIONS:
        said = room.predict(a)
        sim = copy.deepcopy(room)
        sim.step(a)
        moved = sorted(sim.boxes - room.boxes)
        expected = "wall" if sim.player == room.player else " ".join(f"box {r} {c}" for r, c in moved) or None
        assert expected is None or said == expected
        assert (room.player, room.boxes, room.render()) == before


@pytest.mark.parametrize("m", TASKS, ids=lambda m: m.TASK)
def test_world_model_rubric_scores_the_think_against_the_truth(m):
    env = m.make_env(m.Args())
    env.reset(3)
    truth = m.world_model_think(env)
    n = len(re.split(r"[.,:]\s+", truth))
    turn = lambda think: m.Turn("", "", think, "Up", [], False, 0.0, [], world=truth)  # noqa: E731
    assert m.world_model(turn(truth)) == 1.0
    assert m.world_model(turn(None)) == 0.0 and m.world_model(turn("")) == 0.0
    wrong_first = "at 9 9" + truth[truth.index(",") :]
    assert m.world_model(turn(wrong_first)) == pytest.approx((n - 1) / n)
    assert m.world_model(turn(truth + ", Up wall, Up wall")) == 1.0  # extra claims earn nothing more


@pytest.mark.parametrize("m", TASKS, ids=lambda m: m.TASK)
def test_pick_rubric_scores_an_honest_pick_whatever_the_move(m):
    """The `pick` component: 1 when the pick's word is its move's outcome and the answer plays that move. Every
    warm-up turn is honest by construction; another move played, another word or no pick scores 0; and every
    word can score, so it rewards honesty, not good moves."""
    import random

    rng, env, words = random.Random(0), m.make_env(m.Args(outcomes=True)), set()
    for seed in range(40):
        env.reset(10**6 + seed)
        world = m.world_model_think(env)
        moves, thought = m.warmup_reply(rng, env, 1, 10)
        turn = lambda think, played: m.Turn("", "", think, None, played, False, 0.0, [], world=world)  # noqa: E731
        assert m.pick(turn(thought, moves)) == 1.0, (world, thought, moves)
        word, move = thought.rsplit(". ", 1)[1].split()
        words.add(word)
        other = next(a for a in m.ACTIONS if a != move)
        assert m.pick(turn(thought, [other])) == 0.0  # says one move, plays another
        assert m.pick(turn(thought, [move, move])) == 0.0  # plays more than it picked
        liar = next(w for w in ("wall", "floor", "ice", "to") if w != word)
        assert m.pick(turn(thought.rsplit(". ", 1)[0] + f". {liar} {move}", moves)) == 0.0  # the wrong word
        assert m.pick(turn(world, moves)) == 0.0 and m.pick(turn(None, moves)) == 0.0  # no pick
    assert len(words) >= 3  # walls, floor or ice, nearer: honest picks of every kind score
    env = m.make_env(m.Args())  # no Moves line: no pick to check
    env.reset(3)
    assert m.pick(m.Turn("", "", "Up", None, ["Up"], False, 0.0, [], world=m.world_model_think(env))) == 0.0


@pytest.mark.parametrize("m", TASKS, ids=lambda m: m.TASK)
def test_the_warmed_up_tiny_model_reads_the_state_on_held_out_maps(m):
    """The shipped model (the tiny preset's build, which every test of the script uses): asked greedily about lakes
    or rooms it was never warmed up on, its think restates what each move does, picks a move with that move's own
    word, and its answer is mostly the move it picked. (bench/tiny_probe.py --world --outcomes measures the same on
    200: FrozenLake's ten-turn build states every word and picks consistently on all 200, and its answer plays the
    pick on 0.88 of them; 10 of these 12. Sokoban's: 1.00 on all three.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = m.Args(**m.PRESETS["tiny"])
    path = plumbing.tiny.build_tiny_model(m.TASK, m.tiny_warmup_examples(args), **m.TINY_BUILD)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, envs = [], []
    for i in range(12):
        env = m.make_env(args)
        obs = env.reset(9 * 10**8 + i)  # no script trains, warms up or evaluates on these seeds
        text = tok.apply_chat_template(m.first_messages(obs, args), add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
        envs.append(env)
    torch.manual_seed(0)
    replies = plumbing.engine.hf_generate(model, tok, prompts, 1e-4, 1.0, 48, batch_size=16)
    words = consistent = copied = 0
    for (ids, _), env in zip(replies, envs):
        think, answer = m.parse_reply(tok.decode(ids, skip_special_tokens=True))
        line, _, pick = (think or "").rpartition(". ")
        said, truth = line.split(", "), m.world_model_think(env).split(", ")  # "hole Left", "to Down", ...
        words += sum(a == b for a, b in zip(said, truth))
        word, _, move = pick.partition(" ")
        consistent += move in m.ACTIONS and env.outcome(move) == word
        copied += (answer or "").strip() == move
    assert words >= 40 and consistent >= 10 and copied >= 10, (words, consistent, copied)
