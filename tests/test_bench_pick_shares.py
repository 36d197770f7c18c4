"""bench/pick_shares.py: honest picks and word shares, by hand, for both multi-turn tasks."""

import json
import random
import sys

import pytest

import starpo_frozenlake as fl
import starpo_sokoban as sk
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import pick_shares  # noqa: E402


@pytest.mark.parametrize("m", [fl, sk], ids=lambda m: m.TASK)
def test_honest_and_word_shares_by_hand(m, tmp_path):
    """Two episodes at step 0: turn 1 honest in both; turn 2 honest in one, a pick whose move is another in the
    other; then a step-10 turn without a pick. The counts are what a reader would count."""
    rng, env, episodes = random.Random(0), m.make_env(m.Args(outcomes=True)), []
    for seed, lie in ((1, False), (2, True)):
        env.reset(seed)
        turns = []
        for j in range(2):
            world = m.world_model_think(env)
            moves, think = m.warmup_reply(rng, env, 1, 10)
            if lie and j == 1:
                moves = [next(a for a in m.ACTIONS if a != moves[0])]  # plays another move than it picked
            turns.append(dict(think=think, world=world, actions=moves))
            env.step(moves[0])
        episodes.append(dict(step=0, split="val", task=m.TASK, turns=turns))
    episodes.append(dict(step=10, split="val", task=m.TASK, turns=[dict(think=None, world="", actions=[])]))
    episodes.append(dict(step=10, split="train", task=m.TASK, turns=[dict(think=None, world="", actions=[])]))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    got = pick_shares.shares(path)
    assert got[0]["turns"] == 4 and got[0]["honest"] == 0.75 and got[0]["honest_by_turn"] == [1.0, 0.5]
    words = [t["think"].rsplit(". ", 1)[1].split()[0] for e in episodes[:2] for t in e["turns"]]
    assert got[0]["words"] == {w: words.count(w) / 4 for w in set(words)}
    assert got[0]["word_not_on_line"] == 0.0 and got[0]["dishonest_later_picks_repeating_the_last"] in (0.0, 1.0)
    assert got[10]["turns"] == 1 and got[10]["honest"] == 0.0 and got[10]["words"] == {"BAD": 1.0}
    assert got[10]["word_not_on_line"] == 0.0 and got[10]["dishonest_later_picks_repeating_the_last"] is None
    assert pick_shares.main([str(tmp_path), "--out", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["runs"][str(tmp_path)]["0"]["honest"] == 0.75


def test_a_word_off_the_line_and_a_repeated_pick_are_counted(tmp_path):
    """Turn 2 repeats turn 1's pick word for word although the line has changed: dishonest, a repeat; turn 3 picks
    a word the line does not have."""
    world1, world2 = "wall Up, push Down, floor Left, to Right", "wall Up, floor Down, target Left, wall Right"
    turns = [
        dict(think=f"{world1}. push Down", world=world1, actions=["Down"]),
        dict(think=f"{world2}. push Down", world=world2, actions=["Down"]),
        dict(think=f"{world2}. away Left", world=world2, actions=["Left"]),
    ]
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(dict(step=0, split="val", task="sokoban", turns=turns)) + "\n")
    got = pick_shares.shares(path)[0]
    assert got["honest_by_turn"] == [1.0, 0.0, 0.0] and got["word_not_on_line"] == pytest.approx(2 / 3, abs=1e-3)
    assert got["dishonest_later_picks_repeating_the_last"] == 0.5
