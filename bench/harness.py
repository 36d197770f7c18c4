"""What every bench/*_cpu.py shares: one command line, one run of a training script in a temporary folder, one JSON
schema (bench/results/<task>_cpu.json), so the three benchmarks read and compare alike.

    python bench/<task>_cpu.py                     # the README's CPU command, cold cache: the tiny model's build counts
    python bench/<task>_cpu.py --warm-cache        # reuse STARPO_CACHE (training time only)
    python bench/<task>_cpu.py --warm-cache --steps 2 --val-size 8 --out /tmp/x.json   # check the plumbing
    python bench/<task>_cpu.py -- --lr 3e-4        # extra flags for the script, after --
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


def run_script(script: str, flags: list[str], warm_cache: bool, env: dict | None = None) -> dict:
    """Run `python SCRIPT --sample-every 0 FLAGS --output-dir TMP` offline (in `env`, default this process's); a cold
    run gets a fresh STARPO_CACHE, so the tiny model's build counts. Returns its metrics rows, config, stdout, start
    time, wall seconds and load at start."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ if env is None else env, HF_HUB_OFFLINE="1")
        if not warm_cache:
            env["STARPO_CACHE"] = str(Path(tmp) / "cache")
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            script,
            "--sample-every",
            "0",
            *flags,
            "--output-dir",
            str(run_dir),
        ]  # flags may override
        load_start = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed:\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        config = json.loads((run_dir / "config.json").read_text())
        cache = Path(env.get("STARPO_CACHE", Path.home() / ".cache" / "starpo"))
        built = build_seconds(cache, t0)
    return dict(rows=rows, config=config, stdout=proc.stdout, t0=t0, wall=wall, load_start=load_start, build_s=built)


def machine(load_start) -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_avg_at_start": [round(x, 2) for x in load_start],
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def write_result(out: str, result: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "eval_curve"}, indent=1))
    print(f"written to {out}")


CONFIG_KEYS = (
    "model",
    "preset",
    "algo",
    "estimator",
    "n_groups",
    "group_size",
    "keep_ratio",
    "lr",
    "max_tokens",
    "steps",
    "val_size",
    "eval_every",
    "max_context_turns",
    "slippery",
)


def summarise(
    run: dict, command: str, target_success: float, target_wall_s: float, thresholds: tuple, judged: bool
) -> dict:
    """The one schema: the eval curve (step, wall seconds since the command started, val/success, with the random
    and optimal reference on the same evaluation set when the script logs them), the wall time to each threshold,
    seconds per step and their breakdown, the warnings that fired (kind -> steps), the machine and its load. judged:
    the default run, so the target counts."""
    rows, config, t0 = run["rows"], run["config"], run["t0"]
    evals = [r for r in rows if "val/success" in r]
    train = [r for r in rows if "timing_s/gen" in r]
    curve = [
        {"step": r["step"], "wall_s": round(r["timestamp"] - t0, 1), "val_success": r["val/success"]}
        | {k.replace("val/", "val_"): r[k] for k in ("val/random_success", "val/optimal_success") if k in r}
        for r in evals
    ]
    first = lambda thr: next((c["wall_s"] for c in curve if c["val_success"] >= thr), None)  # noqa: E731
    median = lambda f: round(statistics.median(f(r) for r in train), 3) if train else None  # noqa: E731
    batch = config["n_groups"] * config["group_size"]
    gen_s = sum(r["timing_s/gen"] for r in train)
    replies = sum(r["response_length/mean"] * batch * r.get("train/num_turns", 1) for r in train)
    reached = first(target_success)
    step_s, collapse_s = (sum(r.get(f"timing_s/{k}", 0.0) for r in train) for k in ("step", "collapse"))
    return {
        "command": command,
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
        "wall_s_total": round(run["wall"], 1),
        "wall_s_before_training": curve[0]["wall_s"],  # the tiny model's build (cold cache), baselines, step-0 eval
        "wall_s_to_val": {f"{thr:g}": first(thr) for thr in thresholds},
        "initial_val_success": curve[0]["val_success"],
        "best_val_success": max(c["val_success"] for c in curve),
        "final_val_success": curve[-1]["val_success"],
        **{k: curve[0][k] for k in ("val_random_success", "val_optimal_success") if k in curve[0]},
        "steps": len(train),
        "median_s_per_step": median(lambda r: r["timing_s/step"]),
        "median_s_per_step_excl_eval": median(lambda r: r["timing_s/step"] - r.get("timing_s/eval", 0.0)),
        "median_turns_per_step": median(lambda r: r.get("train/num_turns", 1)),  # a step's cost grows with them
        "median_s_breakdown": {
            k: median(lambda r, k=k: r[f"timing_s/{k}"]) for k in ("gen", "env", "logprob", "update")
        },
        "gen_tokens_per_s": round(replies / gen_s, 1) if gen_s else None,
        # the collapse diagnostics (every --mi-every steps): their seconds over all steps' seconds, and per step
        "collapse_share_of_step": round(collapse_s / step_s, 4) if step_s else None,
        "collapse_s_per_step_mean": round(collapse_s / len(train), 3) if train else None,
        "eval_curve": curve,
        "warnings": {
            k[5:]: [r["step"] for r in rows if r.get(k)]
            for k in sorted({k for r in rows for k in r})
            if k.startswith("warn/")
        },
        "target": f">= {target_success:g} eval success within {target_wall_s:g} s wall time (cold cache, default run)",
        "target_met": bool(judged and reached is not None and reached <= target_wall_s),
        "machine": machine(run["load_start"]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def build_seconds(cache: Path, since: float) -> float | None:
    """Seconds the tiny models built during this run took (their build_info.json), None if none was built."""
    infos = [json.loads(p.read_text()) for p in cache.glob("tiny-*/build_info.json") if p.stat().st_mtime >= since]
    return round(sum(i["build_seconds"] for i in infos), 1) if infos else None


def main(
    script: str,
    out_name: str,
    target_success: float,
    target_wall_s: float,
    thresholds: tuple,
    doc: str,
    rungs: dict | None = None,
    warm_judged: bool = False,
):
    """rungs: {extra flags: (target success, target wall s)} for variants judged on targets of their own (e.g.
    ("--no-slippery",)). warm_judged: the target is judged on a warm-cache run (training time; the build is reported
    on its own line), else on a cold one (the build counts)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-cache", action="store_true", help="reuse STARPO_CACHE instead of a fresh cache")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="override the script's --steps (a quick check; the target is judged only on the default run)",
    )
    ap.add_argument("--val-size", type=int, default=None, help="override the script's --val-size (a quick check)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out_name))
    ap.add_argument("extra", nargs="*", help=f"extra flags for {script} (after --)")
    a = ap.parse_args()
    flags = (
        ["--seed", str(a.seed)]
        + (["--steps", str(a.steps)] if a.steps is not None else [])
        + (["--val-size", str(a.val_size)] if a.val_size is not None else [])
        + list(a.extra)
    )
    run = run_script(script, flags, a.warm_cache)
    rungs = rungs or {}
    target_success, target_wall_s = rungs.get(tuple(a.extra), (target_success, target_wall_s))
    judged = (
        a.warm_cache == warm_judged
        and a.steps is None
        and a.val_size is None
        and (not a.extra or tuple(a.extra) in rungs)
    )
    result = summarise(run, f"python {script} " + " ".join(flags), target_success, target_wall_s, thresholds, judged)
    write_result(a.out, {"cold_cache": not a.warm_cache, "build_s": run.get("build_s"), **result})
