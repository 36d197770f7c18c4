"""What a move budget allows on SimpleSokoban's evaluation rooms: bench/results/sokoban_budget.json.

    python bench/sokoban_budget.py            # the 256 evaluation rooms of the tiny preset, budgets 1-10

For each budget k (moves per episode): the share of rooms the BFS solver solves within k moves (the optimum), the
share a uniformly random mover solves (simulated), and the share a policy that only ranks the Moves line's words
solves (simulated, ties broken at random): `target` > `push` > `to` > `floor` > `away` > `wall`. That last one is
what the tiny model can learn by preferring words, as it does on FrozenLake; it never looks further than one move.
The tiny preset plays five one-move turns, so k = 5 is its ceiling, while the scripts' val/random_success and
val/optimal_success use --max-actions-per-traj (10), what the environment allows. CPU only, about a minute.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402
import starpo_sokoban as ss  # noqa: E402

WORD_ORDER = ("target", "push", "to", "floor", "away", "wall")  # the policy's preference, best first


def word_policy_success(env: ss.SokobanEnv, seed: int, budget: int, rollouts: int, rng: random.Random) -> float:
    """Share of `rollouts` episodes of at most `budget` moves solved by always taking the best-ranked outcome word."""
    wins = 0
    for _ in range(rollouts):
        env.reset(seed)
        for _ in range(budget):
            words = {move: env.outcome(move) for move in ss.ACTIONS}
            best = min(WORD_ORDER.index(w) for w in words.values())
            move = rng.choice([m for m, w in words.items() if WORD_ORDER.index(w) == best])
            if env.step(move)[2]:  # done: the room is solved
                wins += 1
                break
    return wins / rollouts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--val-size", type=int, default=256)
    ap.add_argument("--budgets", type=int, nargs="+", default=list(range(1, 11)))
    ap.add_argument("--rollouts", type=int, default=50, help="simulated episodes per room for the two random policies")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sokoban_budget.json"))
    a = ap.parse_args(argv)
    t0, load_start = time.time(), os.getloadavg()
    args = ss.Args(**ss.PRESETS["tiny"], val_size=a.val_size)
    env = ss.make_env(args)
    seeds = [10**9 + i for i in range(a.val_size)]  # the evaluation rooms (see baselines and evaluate)
    lengths = []
    for seed in seeds:
        env.reset(seed)
        path = ss.solve(env)
        lengths.append(len(path) if path is not None else None)
    rng = random.Random(0)
    rows = []
    for k in a.budgets:
        rows.append(
            {
                "budget": k,
                "optimal": statistics.mean(n is not None and n <= k for n in lengths),
                "random": statistics.mean(ss.random_success(env, s, k, a.rollouts, rng) for s in seeds),
                "word_policy": statistics.mean(word_policy_success(env, s, k, a.rollouts, rng) for s in seeds),
            }
        )
        print(" ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}" for key, v in rows[-1].items()))
    result = {
        "benchmark": "sokoban_budget",
        "command": "python bench/sokoban_budget.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "val_size": a.val_size,
        "rollouts": a.rollouts,
        "word_order": list(WORD_ORDER),
        "solution_lengths": {str(n): lengths.count(n) for n in sorted(set(x for x in lengths if x is not None))},
        "unsolved": lengths.count(None),
        "rows": rows,
        "wall_seconds": round(time.time() - t0, 1),
        "machine": harness.machine(load_start),
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
