"""bench/move_shares.py: it judges each move as the lake itself does, and counts shares and repeats right."""

import json
import subprocess
import sys

import starpo_frozenlake as fl
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import move_shares  # noqa: E402


def test_outcome_agrees_with_the_lake_on_every_move():
    env, seen = fl.FrozenLakeEnv(slippery=False), set()
    for seed in range(60):
        env.reset(seed)
        for move in fl.ACTIONS:
            seen.add(move_shares.outcome(env.describe(), move))
            assert move_shares.outcome(env.describe(), move) == env.outcome(move), (seed, move)
    assert seen == set(move_shares.OUTCOMES)


def record(step, views_and_moves, success=False):
    turns = [dict(view=v, actions=m) for v, m in views_and_moves]
    return dict(step=step, split="val", task="frozenlake", success=success, turns=turns)


def test_shares_and_repeats_by_hand(tmp_path):
    env = fl.FrozenLakeEnv(slippery=False, desc=["SFFF", "FHFF", "FFFF", "FFFG"])
    env.reset(0)
    corner = env.describe()  # player at (0, 0), goal at (3, 3)
    recs = [
        record(0, [(corner, ["Up"]), (corner, ["Up"]), (corner, ["Right", "Down"])]),  # wall, wall (a repeat), to
        record(0, [(corner, ["Down"]), (corner, [])], success=True),  # to; a turn without a move breaks the chain
        record(5, [(corner, ["Left"])]),
    ]
    rows = move_shares.shares(recs)
    assert [r["step"] for r in rows] == [0, 5]
    r = rows[0]
    assert r["turns_with_a_move"] == 4 and r["success"] == 0.5 and r["episodes"] == 2
    assert (r["outcome/wall"], r["outcome/to"], r["outcome/hole"]) == (0.5, 0.5, 0.0)
    assert (r["move/Up"], r["move/Right"], r["move/Down"]) == (0.5, 0.25, 0.25)
    assert r["repeat"] == 0.5  # of two later turns with a move after one with a move, one repeats
    assert rows[1]["outcome/wall"] == 1.0 and rows[1]["repeat"] == 0.0
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    out = tmp_path / "shares.json"
    p = subprocess.run(
        [sys.executable, "bench/move_shares.py", str(run), "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())[str(run)] == rows and "wall 0.50" in p.stdout
