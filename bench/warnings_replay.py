"""Replay the collapse warnings (plumbing/run.py's collapse_warnings, as it is now) over runs already measured: which
steps would fire today, beside what fired when the run was made. To check a change to a warning rule on real curves
without rerunning them.

    python bench/warnings_replay.py                          # the filter sweeps' runs (echo trap: their std curves)
    python bench/warnings_replay.py runs/x runs/y            # run directories too (every kind, from metrics.jsonl)

The filter sweeps (bench/results/filters_<task>.json) keep each run's in-group std at every step, so the echo trap
replays exactly on them; the gradient spike and template collapse need a run's metrics.jsonl. Writes
bench/results/warnings_replay.json: per run, kind -> steps now, and the steps recorded at the time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plumbing.run import collapse_warnings  # noqa: E402


def replay(rows: list[dict]) -> dict[str, list[int]]:
    """Step by step, as Run.end_step calls it: kind -> the steps it fires on (warn/* keys of the rows ignored)."""
    history, warned, fired = [], set(), {}
    for row in rows:
        history.append({k: v for k, v in row.items() if not k.startswith("warn/")})
        for kind, _ in collapse_warnings(history, warned):
            fired.setdefault(kind, []).append(row["step"])
    return fired


def recorded(rows: list[dict]) -> dict[str, list[int]]:
    out = {}
    for row in rows:
        for k in row:
            if k.startswith("warn/") and row[k]:
                out.setdefault(k[5:], []).append(row["step"])
    return out


def from_sweep(run: dict) -> tuple[list[dict], dict[str, list[int]]]:
    """A filter-sweep run's std curve as rows, and the echo-trap steps it recorded."""
    curve = run["curves"]["rollout/in_group_std"]
    rows = [{"step": int(s), "rollout/in_group_std": v} for s, v in sorted(curve.items(), key=lambda kv: int(kv[0]))]
    was = {k[5:]: [int(s)] for s, kinds in run["warnings"].items() for k in kinds if k == "warn/echo_trap"}
    return rows, was


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="*", help="run directories (each with a metrics.jsonl)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "warnings_replay.json"))
    args = ap.parse_args(argv)
    result = {"filter_sweeps_echo_trap": {}, "run_dirs": {}}
    for path in sorted((ROOT / "bench" / "results").glob("filters_*.json")):
        sweep = json.loads(path.read_text())
        for name, run in sweep["runs"].items():
            rows, was = from_sweep(run)
            now = {k: v for k, v in replay(rows).items() if k == "echo_trap"}
            result["filter_sweeps_echo_trap"][f"{sweep['task']}:{name}"] = {"now": now, "then": was}
    for d in args.run_dirs:
        rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl")]
        rows = [r for r in rows if r["step"] > 0]  # step 0 is the evaluation before training
        result["run_dirs"][str(d)] = {"now": replay(rows), "then": recorded(rows)}
    counts = {}
    for key, r in result["filter_sweeps_echo_trap"].items():
        task = key.split(":")[0]
        n, was, now = counts.get(task, (0, 0, 0))
        counts[task] = (n + 1, was + bool(r["then"]), now + bool(r["now"]))
    result["echo_trap_runs_fired"] = {t: {"runs": n, "then": a, "now": b} for t, (n, a, b) in counts.items()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["echo_trap_runs_fired"]), *(f"{d}: {r}" for d, r in result["run_dirs"].items()), sep="\n")


if __name__ == "__main__":
    main()
