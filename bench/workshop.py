"""Run every command of WORKSHOP.md as written and record what each run showed: bench/results/workshop.json.

    python bench/workshop.py                 # all exercises, one after the other (~30 min on a quiet 2-core CPU)
    python bench/workshop.py --only 2 3      # some exercises

The figures quoted in WORKSHOP.md ("What a run showed") come from this file's output. The commands are parsed from
WORKSHOP.md itself (so are the test suite's short versions: tests/test_workshop.py), so the handout, the tests and
the figures cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def workshop_commands(path: Path = ROOT / "WORKSHOP.md") -> list[tuple[int, list[str]]]:
    """[(exercise number, argv)] for every `python starpo_*.py ...` line inside a fenced bash block."""
    out, exercise, in_block = [], 0, False
    for line in path.read_text().splitlines():
        m = re.match(r"## Exercise (\d+)", line)
        if m:
            exercise = int(m.group(1))
        if line.startswith("```"):
            in_block = line.strip() == "```bash"
            continue
        if in_block and line.startswith("python starpo_"):
            out.append((exercise, shlex.split(line)[1:]))
    return out


def flag(argv: list[str], name: str):
    return argv[argv.index(name) + 1] if name in argv else None


def summarise(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("step", 0) > 0]
    evals = [(r["step"], round(r["val/success"], 3)) for r in rows if "val/success" in r]

    def first_last(key, k=3):  # mean of the first and the last k training steps
        vals = [r[key] for r in train if key in r]
        return [round(statistics.mean(vals[:k]), 3), round(statistics.mean(vals[-k:]), 3)] if vals else None

    keys = [
        "train/success",
        "train/reward",
        "rollout/in_group_std",
        "rollout/zero_std_frac",
        "actor/entropy",
        "actor/grad_norm",
        "think_length/mean",
        "response_length/mean",
        "rollout/truncated_frac",
        "train/num_turns",
        "train/num_actions",
        "train/action_is_valid",
        "train/action_is_effective",
        "rollout/policy_age",
        "rollout/stale_logprob_diff_mean",
    ]
    keys += sorted({k for r in train for k in r if k.startswith(("rubric/", "judge/", "adv_share/", "gigpo/"))})
    judged = (json.loads((run_dir / "config.json").read_text()).get("judged") or {}).get("rewarded", [])
    curve = ["step", *(f"rubric/{n}" for n in judged), "judge/agreement", "val/success"]  # what the warning reads
    return {
        "val_success": evals,
        "first_last_3_steps": {k: v for k in keys if (v := first_last(k)) is not None},
        "grad_norm_max": round(max(r.get("actor/grad_norm", 0) for r in train), 3) if train else None,
        "echo_trap_warnings_at": [r["step"] for r in train if r.get("warn/echo_trap")],
        "reward_hacking_warnings_at": [r["step"] for r in train if r.get("warn/reward_hacking")],
        **({"judge_curve": [{k: r[k] for k in curve if k in r} for r in rows]} if judged else {}),
        "baselines": {k: round(rows[0][k], 3) for k in ("val/random_success", "val/optimal_success") if k in rows[0]},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", type=int, nargs="*", help="exercise numbers to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/workshop.json"))
    a = ap.parse_args(argv)
    out_path = Path(a.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {"runs": {}}
    for exercise, cmd in workshop_commands():
        if a.only and exercise not in a.only:
            continue
        run_dir = ROOT / flag(cmd, "--output-dir")
        t0 = time.time()
        print(f"[exercise {exercise}] python {shlex.join(cmd)}", flush=True)
        proc = subprocess.run([sys.executable, *cmd, "--overwrite"], cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            return proc.returncode
        results["runs"][" ".join(["python", *cmd])] = dict(
            exercise=exercise,
            wall_s=round(wall, 1),
            date=time.strftime("%Y-%m-%d %H:%M"),
            load_avg_at_end=[round(x, 2) for x in os.getloadavg()],
            **summarise(run_dir),
        )
        print(json.dumps(results["runs"][" ".join(["python", *cmd])])[:400], flush=True)
        results["machine"] = dict(
            cpus=os.cpu_count(),
            platform=platform.platform(),
            python=platform.python_version(),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        )
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
