"""The rooms are RAGEN's in distribution: its reverse play (pull moves only, every target empty, one box scored by its
displacement) and its player walk. The reference figures come from RAGEN's own generator (ragen/env/sokoban/utils.py,
generate_room, seeded as its SokobanEnv.reset does), measured the same way over the same seeds:

    seeds 0-999, 6x6, one box:  one-move rooms 8.2%, random mover (10 moves, 200 tries) 0.178, mean solution 3.98
    the 256 evaluation rooms:   one-move rooms 7.8%, random mover 0.169, mean solution 4.03
    8x8, two boxes, seeds 0-199: no box on a target at the start (the player stands on one in 8)

The rooms before this change gave 20.0%, 0.237 and 42 boxes on targets: the bounds below tell the two apart.
"""

import random
import statistics

import pytest

import starpo_sokoban as sk


def room_stats(seeds, rollouts=200):
    env, rng, lengths, random_wins = sk.SokobanEnv(positions=False), random.Random(0), [], []
    for seed in seeds:
        env.reset(seed)
        path = sk.solve(env)
        assert path is not None, f"room {seed} is not solvable"  # solvable by construction
        lengths.append(len(path))
        random_wins.append(sk.random_success(env, seed, 10, rollouts, rng))
    return dict(
        one_move=lengths.count(1) / len(lengths),
        mean_length=statistics.mean(lengths),
        random=statistics.mean(random_wins),
        within_budget=sum(n <= 10 for n in lengths) / len(lengths),
    )


def test_training_rooms_match_ragens_statistics():
    got = room_stats(range(1000))  # ours: 9.3%, 3.94, 0.190, 99.5% (RAGEN: 8.2%, 3.98, 0.178, 99.8%)
    assert 0.06 <= got["one_move"] <= 0.11  # +-2.5 standard errors around RAGEN's 8.2%; the old rooms: 20.0%
    assert 0.16 <= got["random"] <= 0.20  # RAGEN 0.178; the old rooms 0.237
    assert 3.7 <= got["mean_length"] <= 4.3
    assert got["within_budget"] >= 0.99


def test_evaluation_rooms_match_ragens_statistics():
    got = room_stats([10**9 + i for i in range(256)])  # ours: 7.4%, 4.22, 0.154 (RAGEN: 7.8%, 4.03, 0.169)
    assert 0.04 <= got["one_move"] <= 0.12
    assert 0.13 <= got["random"] <= 0.20  # the old rooms: 0.190
    assert 3.7 <= got["mean_length"] <= 4.6


def test_no_box_starts_on_a_target():
    """RAGEN's reverse play scores a state 0 while a box or the player stands on a target (the old rooms: 42 of 200
    two-box rooms started with a box on a target, seed 2 among them)."""
    env = sk.SokobanEnv(size=8, num_boxes=2, positions=False)
    for seed in range(200):
        env.reset(seed)
        assert not env.targets & env.boxes, f"seed {seed}: a box starts on a target\n{env.render()}"
        assert not env.solved()


def test_the_old_one_move_case_needs_more_than_down():
    env = sk.SokobanEnv(positions=False)
    env.reset(10**9 + 2)  # the old rooms: solved by one Down
    env.step("Down")
    assert not env.solved()


def corridor(length: int) -> set:
    return {(1, c) for c in range(1, length + 1)}


def test_reverse_play_pulls_only_and_scores_one_box_by_its_displacement():
    # # # # # # # #      the box starts on the target at column 2, the player at 3; pulling right drags it along:
    # _ O P _ _ #        the best state is the box at 4 and the player at 5 (displacement 2, one box: score 2;
    # # # # # # # #      gym-sokoban's count of every pull would say 2 pulls x 2 = 4)
    score, player, boxes = sk.reverse_play(corridor(5), [(1, 2)], (1, 3), search_depth=300)
    assert (score, player, boxes) == (2, (1, 5), ((1, 4),))


def test_reverse_play_scores_zero_while_a_box_stands_on_a_target():
    # # # # # # # #      pulling right drags the box from column 3 to 5; the box from column 2 cannot follow (the
    # _ O O P _ _ #      player never gets behind it), so a target stays covered and nothing scores above 0 (the room
    # # # # # # # #      is redrawn). The old rule kept it: 2 pulls x displacement 2 = 4, with a box on a target.
    assert sk.reverse_play(corridor(6), [(1, 2), (1, 3)], (1, 4), search_depth=300)[0] == 0


def test_reverse_play_keeps_no_box_or_player_on_a_target():
    """Over many drawn layouts (8x8, two boxes), the kept state has every target empty."""
    kept = 0
    for seed in range(300):
        rng = random.Random(seed)
        floor = sk.carve_room(rng, 8, int(1.7 * 16))
        cells = sorted(floor)
        if len(cells) <= 3:
            continue
        player = rng.choice(cells)
        targets = rng.sample([c for c in cells if c != player], 2)
        score, player, boxes = sk.reverse_play(floor, targets, player, search_depth=300)
        if score > 0:
            kept += 1
            assert player not in targets and not set(targets) & set(boxes), seed
    assert kept > 200


def test_player_walk_moves_with_its_probability():
    floor = {(r, c) for r in range(1, 8) for c in range(1, 8)}
    assert all(len(sk.walk_player(random.Random(i), floor, (), (4, 4), 0.0)) == 1 for i in range(200))  # stays
    assert all(len(sk.walk_player(random.Random(i), floor, (), (4, 4), 1.0)) >= 2 for i in range(200))  # moves


def test_player_walk_takes_one_two_or_three_steps_never_back():
    floor = {(r, c) for r in range(1, 8) for c in range(1, 8)}  # open floor: the walk never gets stuck
    paths = [sk.walk_player(random.Random(i), floor, ((4, 5),), (4, 4), 0.8) for i in range(8000)]
    steps = [len(p) - 1 for p in paths]
    share = {k: steps.count(k) / len(steps) for k in range(4)}
    assert share[0] == pytest.approx(0.2, abs=0.02)  # did not move: 1 - 0.8
    assert share[1] == pytest.approx(0.8 / 2, abs=0.02)  # then 1 step w.p. 1/2, 2 or 3 w.p. 1/4 each
    assert share[2] == pytest.approx(0.8 / 4, abs=0.02) and share[3] == pytest.approx(0.8 / 4, abs=0.02)
    for p in paths:
        assert len(set(p)) == len(p)  # never onto a cell it stood on, its start included
        assert (4, 5) not in p  # never onto a box
        assert all(abs(a[0] - b[0]) + abs(a[1] - b[1]) == 1 for a, b in zip(p, p[1:]))


def test_player_walk_stops_in_a_dead_end():
    floor = corridor(3)
    assert sk.walk_player(random.Random(0), floor, ((1, 2),), (1, 1), 1.0) == [(1, 1)]  # boxed in: stays
    for i in range(50):
        path = sk.walk_player(random.Random(i), corridor(2), (), (1, 1), 1.0)
        assert path == [(1, 1), (1, 2)]  # one step, then only its start is free


def test_a_room_is_a_pure_function_of_its_seed():
    a, b = sk.SokobanEnv(), sk.SokobanEnv()
    for seed in (0, 7, 10**9 + 5):
        assert a.reset(seed) == b.reset(seed)
