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
    assert got[10] == {"turns": 1, "honest": 0.0, "honest_by_turn": [0.0], "words": {"BAD": 1.0}}
    assert pick_shares.main([str(tmp_path), "--out", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["runs"][str(tmp_path)]["0"]["honest"] == 0.75
