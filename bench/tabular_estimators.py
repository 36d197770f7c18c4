"""Do the advantage estimators learn FrozenLake when the policy can read? A tabular check, no language model.

    python bench/tabular_estimators.py [--steps 60] [--out bench/results/tabular_estimators.json]

The policy is a softmax over the four moves with a handful of parameters: a weight per outcome word that the
`--outcomes` line shows for each move (to, ice, wall, hole, goal), times `read` (1 = it reads the line perfectly,
0 = it cannot read it at all), plus a bias per move word and a bias for repeating the last move. Episodes are played
on the script's own non-slippery lakes (FrozenLakeEnv, 5 turns of one move, groups of 8 sharing a lake, 8 groups a
step), scored by the script's rubric weights, and the parameters climb the exact policy gradient of the script's
update (seq-mean-token-mean: each episode's per-turn terms averaged, then the episodes) with the advantages of
common.group_advantages (grpo) or common.turn_group_advantages (turn-grpo), after StarPO-S's filter, with Adam.

It answers one question the language-model runs cannot: when a multi-turn run drifts (say onto one move word), is
that the estimator's doing or the model's? If a policy that reads learns here with every estimator and a blind one
does not drift, the estimator is sound and the trouble is in what the model can represent and how its updates move.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from starpo_frozenlake import ACTIONS, FrozenLakeEnv  # noqa: E402

WORDS = ("to", "ice", "wall", "hole", "goal")
PROGRESS = {"to": 1.0, "ice": -1.0, "wall": 0.0, "hole": -1.0, "goal": 1.0}  # the progress component, per move


def features(words: list[str], prev: int | None, read: float) -> np.ndarray:
    """(4 moves, 10): read * one-hot of the move's outcome word | one-hot of the move word | repeats the last move."""
    f = np.zeros((4, 10))
    for a, w in enumerate(words):
        f[a, WORDS.index(w)] = read
        f[a, 5 + a] = 1.0
        f[a, 9] = float(prev == a)
    return f


def run(estimator: str, read: float, progress: float, keep: float, steps: int, seed: int, lr: float = 0.05) -> dict:
    rng, env = np.random.default_rng(seed), FrozenLakeEnv(slippery=False, outcomes=True)
    theta, m, v = np.zeros(10), np.zeros(10), np.zeros(10)
    curve = []
    for step in range(steps):
        groups = []  # 8 groups x 8 episodes; an episode: [(features, move, probs, turn reward, outcome word)]
        for g in range(8):
            lake = 10**6 * (seed + 1) + step * 8 + g
            episodes = []
            for _ in range(8):
                env.reset(lake)
                prev, turns = None, []
                for _ in range(5):
                    words = [env.outcome(a) for a in ACTIONS]
                    f = features(words, prev, read)
                    z = f @ theta
                    p = np.exp(z - z.max())
                    p /= p.sum()
                    a = int(rng.choice(4, p=p))
                    _, paid, done, _ = env.step(ACTIONS[a])
                    turns.append((f, a, p, paid + progress * PROGRESS[words[a]], words[a], paid))
                    prev = a
                    if done:
                        break
                episodes.append(turns)
            groups.append(episodes)
        scores = torch.tensor([[sum(t[3] for t in ep) for ep in eps] for eps in groups], dtype=torch.float64)
        grad, rows = np.zeros(10), 0
        for g in common.filter_groups(scores, keep).tolist():
            eps = groups[g]
            if estimator == "grpo":
                adv = [[a] * len(ep) for a, ep in zip(common.group_advantages(scores[g : g + 1])[0].tolist(), eps)]
            else:
                adv = common.turn_group_advantages([[t[3] for t in ep] for ep in eps])
            for ep, a_ep in zip(eps, adv):
                grad += sum(aj * (f[a] - p @ f) for (f, a, p, *_), aj in zip(ep, a_ep)) / len(ep)
                rows += 1
        grad /= max(rows, 1)
        m, v = 0.9 * m + 0.1 * grad, 0.999 * v + 0.001 * grad**2
        theta += lr * (m / (1 - 0.9 ** (step + 1))) / (np.sqrt(v / (1 - 0.999 ** (step + 1))) + 1e-8)
        played = [t for eps in groups for ep in eps for t in ep]
        curve.append(
            dict(
                step=step + 1,
                success=float(np.mean([ep[-1][5] > 0 for eps in groups for ep in eps])),
                **{f"outcome/{w}": sum(t[4] == w for t in played) / len(played) for w in WORDS},
            )
        )
    first, last = curve[:5], curve[-10:]
    mean = lambda rows, k: round(float(np.mean([r[k] for r in rows])), 3)  # noqa: E731
    return dict(
        estimator=estimator,
        read=read,
        progress=progress,
        keep_ratio=keep,
        first_5_steps={k: mean(first, k) for k in curve[0] if k != "step"},
        last_10_steps={k: mean(last, k) for k in curve[0] if k != "step"},
        theta=dict(zip([*WORDS, *ACTIONS, "repeat"], np.round(theta, 3).tolist())),
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tabular_estimators.json"))
    a = ap.parse_args(argv)
    t0, load = time.time(), os.getloadavg()
    cases = [
        (est, read, prog, keep)
        for read in (1.0, 0.0)
        for est, prog in (("grpo", 0.0), ("grpo", 0.5), ("turn-grpo", 0.5))
        for keep in (1.0, 0.25)
    ]
    results = []
    for est, read, prog, keep in cases:
        r = run(est, read, prog, keep, a.steps, a.seed)
        results.append(r)
        s0, s1 = r["first_5_steps"], r["last_10_steps"]
        print(
            f"{est:9s} read {read:.0f} progress {prog:.1f} keep {keep:.2f}: success {s0['success']:.2f} -> "
            f"{s1['success']:.2f}, walls {s0['outcome/wall']:.2f} -> {s1['outcome/wall']:.2f}, "
            f"to {s0['outcome/to']:.2f} -> {s1['outcome/to']:.2f}",
            flush=True,
        )
    out = dict(
        benchmark="tabular_estimators",
        command="python bench/tabular_estimators.py" + (f" --steps {a.steps}" if a.steps != 60 else ""),
        steps=a.steps,
        seed=a.seed,
        load_at_start=load,
        seconds=round(time.time() - t0, 1),
        results=results,
    )
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
