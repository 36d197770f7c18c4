"""Benchmark: how one FrozenLake training step's cost grows with the number of turns and of moves per turn.

    python bench/turn_cost.py                                  # this checkout -> bench/results/turn_cost.json
    git worktree add /tmp/before <commit>                      # an older version of the script, same tiny model
    python bench/turn_cost.py --script /tmp/before/starpo_frozenlake.py --out bench/results/turn_cost_before.json

Each setting is a short run of the tiny defaults on the non-slippery lake (`--no-slippery --steps 3 --eval-every 0
--val-size 8`, the tiny model cached), once per `--max-turns` 1..5 (one move per turn, so every turn is a reply) and
once per `--max-actions-per-turn` 2 and 3 at 5 turns. Per setting: the median over steps 2-3 of the step (less the
final evaluation step 3 also runs), generation and update seconds, and the mean number of turns an episode lasted
(episodes end early at a hole or the goal, so the number of turns played is what the cost follows). Run it alone on an idle machine; the load is recorded.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [("--max-turns", str(k), "--max-actions-per-turn", "1") for k in range(1, 6)] + [
    ("--max-turns", "5", "--max-actions-per-turn", str(a)) for a in (2, 3)
]
BASE = [
    "--model",
    "tiny",
    "--no-slippery",
    "--steps",
    "3",
    "--eval-every",
    "0",
    "--val-size",
    "8",
    "--sample-every",
    "0",
]


def run(script: Path, flags: tuple) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(script), *BASE, *flags, "--output-dir", str(Path(tmp) / "run")]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        proc = subprocess.run(cmd, cwd=script.parent, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(Path(tmp) / "run" / "metrics.jsonl")]
    train = [r for r in rows if "timing_s/gen" in r][1:]  # steps 2-3: the first step pays one-off allocations
    for r in train:  # the last step also runs the final evaluation (timing_s/eval): not the training step's cost
        r["timing_s/train_step"] = r["timing_s/step"] - r.get("timing_s/eval", 0.0)
    med = lambda key: round(statistics.median(r[key] for r in train), 2)  # noqa: E731
    return {
        "flags": list(flags),
        "s_per_step": med("timing_s/train_step"),
        "gen_s": med("timing_s/gen"),
        "update_s": med("timing_s/update"),
        "turns_per_episode": round(statistics.mean(r["train/num_turns"] for r in train), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", type=Path, default=ROOT / "starpo_frozenlake.py", help="the script to time")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "turn_cost.json")
    args = ap.parse_args()
    load, t0 = os.getloadavg(), time.time()
    results = []
    for flags in SETTINGS:
        results.append(run(args.script.resolve(), flags))
        print(json.dumps(results[-1]), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=args.script.resolve().parent, capture_output=True, text=True
    ).stdout.strip()
    out = {
        "benchmark": "turn_cost",
        "script": str(args.script),
        "commit": commit,
        "command": " ".join(["python", "bench/turn_cost.py", *sys.argv[1:]]),
        "base_flags": BASE,
        "machine": {"cpus": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in load]},
        "wall_s": round(time.time() - t0, 1),
        "settings": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
