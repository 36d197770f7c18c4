"""What the moves of a FrozenLake run did, from its rollouts.jsonl: a stalled run's first question.

    python bench/move_shares.py runs/frozenlake-... [more run folders] [--split val] [--out bench/results/x.json]

For each logged step (evaluation rollouts by default; `--split train` for the one-per-group training ones): the
share of played moves that stepped nearer the goal (`to`), onto other ice (`ice`), into the border (`wall`: the
player stays), into a hole or onto the goal (each move judged as meant, from the state the turn saw: on slippery ice
the move may then slip); the share of each move word; how often a turn's first move repeats the last turn's first
move; and the success rate of those episodes. A policy that collapses onto one word shows it here first: one word's
share near 1, walls and repeats rising, success falling.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
OUTCOMES = ("to", "ice", "wall", "hole", "goal")


def outcome(view: dict, move: str) -> str:
    """What `move` reaches from the state `view` (a turn's env.describe()), as meant: one of OUTCOMES."""
    (r, c), (gr, gc), grid = view["player"], view["goal"], view["grid"]
    dr, dc = MOVES[move.lower()]
    nr, nc = r + dr, c + dc
    if not (0 <= nr < len(grid) and 0 <= nc < len(grid[0])):
        return "wall"
    if grid[nr][nc] in ("O", "G"):
        return "hole" if grid[nr][nc] == "O" else "goal"
    return "to" if abs(gr - nr) + abs(gc - nc) < abs(gr - r) + abs(gc - c) else "ice"


def shares(records: list[dict]) -> list[dict]:
    """One row per logged step of the given rollout records (see the module docstring)."""
    by_step = collections.defaultdict(list)
    for rec in records:
        by_step[rec["step"]].append(rec)
    rows = []
    for step, recs in sorted(by_step.items()):
        kinds, words, repeats, later = collections.Counter(), collections.Counter(), 0, 0
        for rec in recs:
            prev = None
            for turn in rec["turns"]:
                first = turn["actions"][0] if turn["actions"] else None
                for move in turn["actions"][:1]:
                    kinds[outcome(turn["view"], move)] += 1
                    words[move] += 1
                if first is not None and prev is not None:
                    later, repeats = later + 1, repeats + (first == prev)
                prev = first
        n = max(sum(kinds.values()), 1)
        rows.append(
            dict(
                step=step,
                episodes=len(recs),
                success=sum(r["success"] for r in recs) / len(recs),
                turns_with_a_move=sum(kinds.values()),
                **{f"outcome/{k}": kinds[k] / n for k in OUTCOMES},
                **{f"move/{w}": words[w] / n for w in ("Left", "Down", "Right", "Up")},
                repeat=repeats / later if later else 0.0,
            )
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with rollouts.jsonl)")
    ap.add_argument("--split", default="val", choices=("val", "train"))
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    out = {}
    for run in a.runs:
        path = Path(run) / "rollouts.jsonl"
        if not path.exists():
            sys.exit(f"error: no rollouts.jsonl in {run}")
        records = [json.loads(line) for line in open(path)]
        if any(r.get("task") != "frozenlake" for r in records):
            sys.exit(f"error: {run} is not a FrozenLake run")
        out[run] = rows = shares([r for r in records if r["split"] == a.split])
        print(run)
        for row in rows:
            print(
                f"  step {row['step']:4d}  success {row['success']:.2f}  "
                + "  ".join(f"{k} {row['outcome/' + k]:.2f}" for k in OUTCOMES)
                + "  |  "
                + "  ".join(f"{w} {row['move/' + w]:.2f}" for w in ("Left", "Down", "Right", "Up"))
                + f"  |  repeat {row['repeat']:.2f}"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
