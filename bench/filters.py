"""Which filter learns best here: StarPO-S's top-k against RAGEN-2's top-p against no filter, on a task's default command.

    python bench/filters.py bandit --seeds 0 1 2            # 3 filters x 3 seeds of `python starpo_bandit.py`
    python bench/filters.py sokoban --seeds 0 --filters top_p  # some of them
    python bench/filters.py bandit --seeds 0 -- --steps 4 --val-size 8   # extra flags for every run, after --
    python bench/filters.py frozenlake --seeds --merge /tmp/a.json /tmp/b.json  # add runs measured elsewhere, run none

Each run is the task's default command (the tiny preset, warm model cache: training time only) with the filter's
flags added: `top_k` = the command as it is (StarPO-S's top-k: 25% of the groups, 50% under the multi-turn tiny
preset), `top_p` = --algo starpo-s2 (RAGEN-2's recommended filter: top-p 0.9 of the reward-std mass, zero-std groups
dropped, empty batches skipped), `none` = --filter none (the same algorithm training on every group). Writes bench/results/filters_<task>.json:
per run, val/success by step and by wall time, the kept ratio, skipped (empty) steps, the collapse (MI) curves and
the cost of the diagnostics; per filter, the mean over seeds. Every figure comes from these runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import harness

FILTERS = {"top_k": [], "top_p": ["--algo", "starpo-s2"], "none": ["--filter", "none"]}
CURVES = (
    "collapse/mi_estimate",
    "collapse/mi_zscore",
    "collapse/mi_zscore_ema",
    "collapse/retrieval_accuracy",
    "collapse/retrieval_chance_level",
    "collapse/conditional_entropy_est",
    "collapse/reasoning_entropy_est",
    "collapse/valid_thinking_rate",
    "actor/entropy",
    "rollout/in_group_std",
)


def summarise_run(rows: list[dict], wall: float) -> dict:
    train = [r for r in rows if r["step"] >= 1]
    evals = [r for r in rows if "val/success" in r]
    mean = lambda key: statistics.mean(r[key] for r in train if key in r) if any(key in r for r in train) else None
    step_s = [r["timing_s/step"] for r in train if "timing_s/step" in r]
    mi_s = [r.get("timing_s/collapse", 0.0) for r in train]
    return {
        "val_success": {str(r["step"]): round(r["val/success"], 4) for r in evals},
        "val_success_at_s": {str(r["step"]): round(r.get("time_s", 0.0), 1) for r in evals},
        "final_val_success": evals[-1]["val/success"] if evals else None,
        "best_val_success": max(r["val/success"] for r in evals) if evals else None,
        "steps_run": len(train),
        "kept_ratio_mean": mean("rollout/filter_kept_ratio"),
        "skipped_steps": sum(r.get("rollout/empty_after_filter", 0) for r in train),
        "s_per_step_mean": statistics.mean(step_s) if step_s else None,
        "collapse_s_per_step_mean": statistics.mean(mi_s) if mi_s else None,  # averaged over every step
        "collapse_share_of_step": (sum(mi_s) / sum(step_s)) if step_s else None,
        "wall_s": round(wall, 1),
        "curves": {k: {str(r["step"]): r[k] for r in rows if k in r} for k in CURVES},
        "warnings": {
            str(r["step"]): [k for k in r if k.startswith("warn/")]
            for r in rows
            if any(k.startswith("warn/") for k in r)
        },
    }


def summarise_filters(runs: dict, variants=FILTERS) -> dict:
    """Per filter (or other variant: bench/estimators.py), the mean over its seeds (runs keyed "<name>/seed<n>")."""
    by_filter = {}
    for name in variants:
        group = {key.split("/")[1]: r for key, r in runs.items() if key.startswith(name + "/")}
        if group:
            done = group.values()
            by_filter[name] = {
                "seeds": len(group),
                "final_val_success": {seed: r["final_val_success"] for seed, r in group.items()},
                "final_val_success_mean": statistics.mean(r["final_val_success"] for r in done),
                "best_val_success_mean": statistics.mean(r["best_val_success"] for r in done),
                "kept_ratio_mean": statistics.mean(r["kept_ratio_mean"] or 0.0 for r in done),  # None: never filtered
                "skipped_steps_mean": statistics.mean(r["skipped_steps"] for r in done),
                "s_per_step_mean": statistics.mean(r["s_per_step_mean"] for r in done),
            }
    return by_filter


def main(argv=None, variants=FILTERS, kind="filters", description=__doc__) -> None:
    """kind: what the variants are (the flag that picks some, the JSON's name); bench/estimators.py passes its own."""
    ap = argparse.ArgumentParser(description=description.split("\n")[0])
    ap.add_argument("task", choices=["bandit", "frozenlake", "sokoban"])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0], help="none: run nothing (with --merge)")
    ap.add_argument(f"--{kind}", dest="names", nargs="+", choices=list(variants), default=list(variants))
    ap.add_argument(
        "--out", default=None, help=f"default bench/results/{kind}_<task>.json; runs already there are kept"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="JSON",
        help="add the runs of these files (two sweeps run side by side)",
    )
    ap.add_argument("extra", nargs="*", help="flags for every run, after --")
    args = ap.parse_args(argv)
    out = Path(args.out or harness.ROOT / "bench" / "results" / f"{kind}_{args.task}.json")
    result = json.loads(out.read_text()) if out.exists() else {"task": args.task, "runs": {}}
    for path in args.merge:
        other = json.loads(Path(path).read_text())
        if other.get("task") != args.task:
            sys.exit(f"--merge {path}: its runs are of {other.get('task')!r}, not {args.task!r}")
        result["runs"].update(other["runs"])
    for seed in args.seeds:
        for name in args.names:
            flags = [*variants[name], "--seed", str(seed), *args.extra]
            print(f"[{kind}] starpo_{args.task}.py {' '.join(flags)}", file=sys.stderr, flush=True)
            run = harness.run_script(f"starpo_{args.task}.py", flags, warm_cache=True)
            result["runs"][f"{name}/seed{seed}"] = {
                "command": f"python starpo_{args.task}.py {' '.join(flags)}",
                "machine": harness.machine(run["load_start"]),
                **summarise_run(run["rows"], run["wall"]),
            }
            out.write_text(json.dumps(result, indent=1))  # after every run: a long sweep keeps what it measured
    key = "by_filter" if kind == "filters" else "by_variant"
    result[key] = summarise_filters(result["runs"], variants)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result[key], indent=1))


if __name__ == "__main__":
    main()
