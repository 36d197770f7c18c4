"""Benchmark: the README's CPU command (`python starpo_frozenlake.py`), timed end to end from a cold model cache.

Does the embedded tiny model learn slippery FrozenLake on a CPU, and where does it end up between the uniformly
random policy and the optimal one? Writes bench/results/frozenlake_cpu.json: the eval curve (step, wall seconds,
val/success) next to the exact random- and optimal-policy success on the same maps and budget (the script's dynamic
programming), the wall time to reach 0.40, seconds per step, the command, and whether the target was met.
Target (issue #3) on a 2-core CPU: >= 0.40 eval success within 15 minutes of wall time (random ~0.21, optimal
~0.46). Every figure comes from this run; nothing is hard-coded.

    python bench/frozenlake_cpu.py                      # cold cache: the tiny model's build counts, as for a newcomer
    python bench/frozenlake_cpu.py --warm-cache         # reuse the cached tiny model (training time only)
    python bench/frozenlake_cpu.py --warm-cache --steps 2 --out /tmp/fl.json -- --val-size 16   # check the plumbing
"""

import argparse
import statistics
import time

import harness

ROOT = harness.ROOT
TARGET_SUCCESS, TARGET_WALL_S = 0.40, 15 * 60


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-cache", action="store_true", help="reuse STARPO_CACHE instead of a fresh cache")
    ap.add_argument("--steps", type=int, default=None, help="override the script's --steps (a quick check; the target "
                                                             "is only judged on the default run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "frozenlake_cpu.json"))
    ap.add_argument("extra", nargs="*", help="extra flags for starpo_frozenlake.py (after --)")
    a = ap.parse_args()
    flags = ["--seed", str(a.seed), *(["--steps", str(a.steps)] if a.steps is not None else []), *a.extra]
    run = harness.run_script("starpo_frozenlake.py", flags, a.warm_cache)
    rows, config, t0, wall = run["rows"], run["config"], run["t0"], run["wall"]
    evals = [(r["step"], round(r["timestamp"] - t0, 1), r["val/success"]) for r in rows if "val/success" in r]
    train = [r for r in rows if "timing_s/gen" in r]
    first = lambda thr: next((w for _, w, s in evals if s >= thr), None)  # noqa: E731
    median = lambda key: round(statistics.median(r[key] for r in train), 3) if train else None  # noqa: E731
    reached = first(TARGET_SUCCESS)
    result = {
        "command": "python starpo_frozenlake.py " + " ".join(flags),
        "cold_cache": not a.warm_cache,
        "wall_s_total": round(wall, 1),
        "wall_s_before_training": evals[0][1],  # tiny-model build (cold cache), baselines and the step-0 evaluation
        f"wall_s_to_val_{TARGET_SUCCESS:.2f}": reached,
        "val/random_success": rows[0]["val/random_success"],
        "val/optimal_success": rows[0]["val/optimal_success"],
        "initial_val_success": evals[0][2],
        "final_val_success": evals[-1][2],
        "best_val_success": max(s for _, _, s in evals),
        "steps": len(train),
        "val_size": config["val_size"],
        "median_s_per_step": median("timing_s/step"),
        "median_s_breakdown": {k: median(f"timing_s/{k}") for k in ("gen", "env", "logprob", "update")},
        "eval_curve": [{"step": s, "wall_s": w, "val_success": v} for s, w, v in evals],
        "target": f">= {TARGET_SUCCESS:.2f} eval success within {TARGET_WALL_S} s wall time (cold cache, default run)",
        "target_met": bool(reached is not None and reached <= TARGET_WALL_S and not a.warm_cache
                           and a.steps is None and not a.extra),
        "machine": harness.machine(run["load_start"]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    harness.write_result(a.out, result)
    print("eval curve (step, wall s, val/success): " + ", ".join(f"({s}, {w}, {v:.3f})" for s, w, v in evals))
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
