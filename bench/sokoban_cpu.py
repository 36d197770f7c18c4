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
import statistics
import time

import harness

ROOT = harness.ROOT
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
    run = harness.run_script("starpo_sokoban.py", ["--seed", str(a.seed), *extra], a.warm_cache)
    rows, config, t0, wall = run["rows"], run["config"], run["t0"], run["wall"]
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
        "machine": harness.machine(run["load_start"]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
