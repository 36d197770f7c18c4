"""Benchmark: the README's CPU command (`python starpo_bandit.py`), timed end to end from a cold model cache.

Writes bench/results/bandit_cpu.json: wall time to reach 0.9 and 0.95 eval high-arm rate (including the tiny
model's build), seconds per step, generated tokens per second, and the eval curve. Target on a 2-core CPU:
>= 0.95 eval high-arm rate within 180 s of wall time. Every figure comes from this run; nothing is hard-coded.

    python bench/bandit_cpu.py                 # cold cache: the build counts, as for a newcomer
    python bench/bandit_cpu.py --warm-cache    # reuse the cached tiny model (training time only)
"""

import argparse
import statistics
import time

import harness

ROOT = harness.ROOT


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-cache", action="store_true", help="reuse STARPO_CACHE instead of a fresh cache")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bandit_cpu.json"))
    ap.add_argument("extra", nargs="*", help="extra flags for starpo_bandit.py (after --)")
    a = ap.parse_args()
    run = harness.run_script("starpo_bandit.py", ["--seed", str(a.seed), *a.extra], a.warm_cache)
    rows, config, t0, wall = run["rows"], run["config"], run["t0"], run["wall"]
    evals = [(r["step"], round(r["timestamp"] - t0, 1), r["val/success"]) for r in rows if "val/success" in r]
    train = [r for r in rows if "timing_s/gen" in r]
    steps_s = lambda key: round(statistics.median(r[key] for r in train), 3)  # noqa: E731
    first = lambda thr: next((w for _, w, s in evals if s >= thr), None)  # noqa: E731
    batch = config["n_groups"] * config["group_size"]
    gen_tokens = sum(r["response_length/mean"] * batch for r in train)
    result = {
        "command": "python starpo_bandit.py" + (" " + " ".join(a.extra) if a.extra else "") + f" --seed {a.seed}",
        "cold_cache": not a.warm_cache,
        "wall_s_total": round(wall, 1),
        "wall_s_to_val_0.9": first(0.9),
        "wall_s_to_val_0.95": first(0.95),
        "final_val_success": evals[-1][2],
        "best_val_success": max(s for _, _, s in evals),
        "steps": len(train),
        "median_s_per_step": round(statistics.median(r["timing_s/step"] for r in train), 3),
        "median_s_per_step_excl_eval": round(statistics.median(r["timing_s/gen"] + r["timing_s/update"] for r in train), 3),
        "gen_tokens_per_s": round(gen_tokens / sum(r["timing_s/gen"] for r in train), 1),
        "median_s_breakdown": {k: steps_s(f"timing_s/{k}") for k in ("gen", "env", "logprob", "update")},
        "eval_curve": [{"step": s, "wall_s": w, "val_success": v} for s, w, v in evals],
        "target": ">= 0.95 eval high-arm rate within 180 s wall time (cold cache)",
        "target_met": bool(first(0.95) is not None and first(0.95) <= 180 and not a.warm_cache),
        "machine": harness.machine(run["load_start"]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
