"""Benchmark: the README's CPU command (`python starpo_sokoban.py`), timed end to end, with fixed seeds.

Runs the script's default CPU command (embedded tiny model, SimpleSokoban) in a subprocess, reads its
metrics.jsonl and writes bench/results/sokoban_cpu.json: the eval-success curve (step, wall seconds, val/success,
next to val/random_success by simulation and val/optimal_success from the BFS solver for the same evaluation rooms),
best and final val/success, wall time, seconds per step with their breakdown, the exact command and whether the
target was met. Target on a 2-core CPU: >= 0.60 eval success within 20 minutes of wall time (RAGEN's Qwen2.5-0.5B
with StarPO-S: 0.215). Every figure comes from this run; nothing is hard-coded.

    python bench/sokoban_cpu.py                 # cold cache: the tiny model's build counts, as for a newcomer
    python bench/sokoban_cpu.py --warm-cache    # reuse STARPO_CACHE (training time only)
    python bench/sokoban_cpu.py --warm-cache --steps 2 --val-size 8 --out /tmp/s.json   # end-to-end check, a minute
    python bench/sokoban_cpu.py -- --lr 3e-4    # extra flags for starpo_sokoban.py after --
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_SUCCESS, TARGET_WALL_S = 0.60, 20 * 60


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-cache", action="store_true", help="reuse STARPO_CACHE instead of a fresh cache")
    ap.add_argument("--steps", type=int, default=None, help="override the script's training steps (a quick check)")
    ap.add_argument("--val-size", type=int, default=None, help="override the number of evaluation rooms (a quick check)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sokoban_cpu.json"))
    ap.add_argument("extra", nargs="*", help="extra flags for starpo_sokoban.py (after --)")
    a = ap.parse_args()
    extra = list(a.extra)
    if a.steps is not None:
        extra += ["--steps", str(a.steps)]
    if a.val_size is not None:
        extra += ["--val-size", str(a.val_size)]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if not a.warm_cache:
            env["STARPO_CACHE"] = str(Path(tmp) / "cache")
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "starpo_sokoban.py", "--seed", str(a.seed), "--sample-every", "0", "--output-dir", str(run_dir), *extra]
        load_start = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed:\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        config = json.loads((run_dir / "config.json").read_text())
    evals = [r for r in rows if "val/success" in r]
    curve = [{"step": r["step"], "wall_s": round(r["timestamp"] - t0, 1), "val_success": r["val/success"],
              "val_random_success": r["val/random_success"], "val_optimal_success": r["val/optimal_success"]}
             for r in evals]  # wall_s: since the command started, so a cold cache's model build is included
    train = [r for r in rows if "timing_s/gen" in r]
    within = [c["val_success"] for c in curve if c["wall_s"] <= TARGET_WALL_S]
    reached = next((c["wall_s"] for c in curve if c["val_success"] >= TARGET_SUCCESS), None)
    result = {
        "command": "python starpo_sokoban.py" + (" " + " ".join(extra) if extra else "") + f" --seed {a.seed}",
        "cold_cache": not a.warm_cache,
        "config": {k: config[k] for k in ("model", "algo", "estimator", "n_groups", "group_size", "keep_ratio", "lr",
                                          "max_tokens", "steps", "val_size", "eval_every", "max_context_turns")},
        "wall_s_total": round(wall, 1),
        "wall_s_to_first_eval": curve[0]["wall_s"],  # the tiny model's build (cold cache) and the step-0 evaluation
        "val_random_success": evals[0]["val/random_success"],
        "val_optimal_success": evals[0]["val/optimal_success"],
        "val_optimal_length_mean": evals[0]["val/optimal_length/mean"],
        "initial_val_success": curve[0]["val_success"],
        "best_val_success": max(c["val_success"] for c in curve),
        "final_val_success": curve[-1]["val_success"],
        "best_val_success_within_20_min": max(within) if within else None,
        "wall_s_to_target": reached,
        "target": f">= {TARGET_SUCCESS} eval success within {TARGET_WALL_S} s wall time on a 2-core CPU",
        "target_met": bool(reached is not None and reached <= TARGET_WALL_S),
        "steps": len(train),
        "median_s_per_step": round(statistics.median(r["timing_s/step"] for r in train), 3) if train else None,
        "median_s_per_step_excl_eval": round(statistics.median(r["timing_s/step"] - r.get("timing_s/eval", 0.0) for r in train), 3) if train else None,
        "median_s_breakdown": {k: round(statistics.median(r[f"timing_s/{k}"] for r in train), 3)
                               for k in ("gen", "env", "logprob", "update")} if train else None,
        "eval_curve": curve,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_at_start": [round(x, 2) for x in load_start],
                    "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "eval_curve"}, indent=1))


if __name__ == "__main__":
    main()
