"""Benchmark: the README's CPU command (`python starpo_bandit.py`), timed end to end from a cold model cache.

Writes bench/results/bandit_cpu.json: wall time to reach 0.9 and 0.95 eval high-arm rate (including the tiny
model's build), seconds per step, generated tokens per second, and the eval curve. Target on a 2-core CPU:
>= 0.95 eval high-arm rate within 180 s of wall time. Every figure comes from this run; nothing is hard-coded.

    python bench/bandit_cpu.py                 # cold cache: the build counts, as for a newcomer
    python bench/bandit_cpu.py --warm-cache    # reuse the cached tiny model (training time only)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-cache", action="store_true", help="reuse STARPO_CACHE instead of a fresh cache")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bandit_cpu.json"))
    ap.add_argument("extra", nargs="*", help="extra flags for starpo_bandit.py (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if not a.warm_cache:
            env["STARPO_CACHE"] = str(Path(tmp) / "cache")
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "starpo_bandit.py", "--seed", str(a.seed), "--sample-every", "0", "--output-dir", str(run_dir), *a.extra]
        load_start = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed:\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        config = json.loads((run_dir / "config.json").read_text())
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
