"""Benchmark: what do the scripts' two memory settings on a CPU buy? (#16)

1. `common.seed_everything` keeps torch's deterministic algorithms (bit-for-bit runs) but turns off their debugging
   aid, which writes NaN into every new tensor (torch.utils.deterministic.fill_uninitialized_memory).
2. `common.keep_freed_memory` tells glibc's malloc to keep freed memory in the process, so each step's KV caches and
   activations reuse pages instead of new ones the kernel must fault in and zero.

Each default command runs a few steps (`--eval-every 0 --val-size 8`, tiny model cached) in three variants, in
rotation, `--reps` times each, every run in a fresh process:
  before   both as they were: NaN fill on, glibc's default malloc (keep_freed_memory does nothing)
  no-fill  the fill off, glibc's default malloc
  now      what the scripts do
(Not MALLOC_MMAP_MAX_=65536 for "glibc's default": setting any such variable also stops glibc from raising its mmap
threshold as blocks are freed, which made these runs 38% slower than the default.)
The runs of one script play the same episodes bit for bit in every variant (checked: same rewards), so their seconds
compare directly: the sum over the steps after the first, its generation and update, the process's peak memory.

    python bench/cpu_memory.py                                   # writes bench/results/cpu_memory.json
    python bench/cpu_memory.py --reps 1 --steps 2 --scripts starpo_bandit.py --out /tmp/mem.json
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

WRAPPER = r"""
import atexit, resource, runpy, sys
sys.path.insert(0, {root!r})
import torch
import common
if {fill}:  # the old seed_everything: deterministic algorithms with their NaN fill of new tensors
    seed = common.seed_everything
    def seed_with_fill(*a, **k):
        seed(*a, **k)
        torch.utils.deterministic.fill_uninitialized_memory = True
    common.seed_everything = seed_with_fill
if not {keep}:  # glibc's malloc as it comes
    common.keep_freed_memory = lambda *a, **k: False
atexit.register(lambda: print("peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""
VARIANTS = {  # name: (NaN fill on, keep freed memory)
    "before": (True, False),
    "no-fill": (False, False),
    "now": (False, True),
}
STEPS = {"starpo_frozenlake.py": 6, "starpo_sokoban.py": 6, "starpo_bandit.py": 12}


def one_run(script: str, variant: str, steps: int, tmp: str) -> dict:
    fill, keep = VARIANTS[variant]
    wrapper = Path(tmp) / f"{variant}_{Path(script).stem}.py"
    wrapper.write_text(WRAPPER.format(root=str(harness.ROOT), fill=fill, keep=keep, script=str(harness.ROOT / script)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
    flags = ["--steps", str(steps), "--eval-every", "0", "--val-size", "8"]
    run = harness.run_script(str(wrapper), flags, warm_cache=True, env=env)
    rows = [r for r in run["rows"] if "timing_s/step" in r][1:]  # the first step warms up
    peak = next(line.split()[1] for line in run["stdout"].splitlines() if line.startswith("peak_rss_mb"))
    return {
        "s_steps": round(sum(r["timing_s/step"] for r in rows), 2),
        "gen_s": round(sum(r["timing_s/gen"] for r in rows), 2),
        "update_s": round(sum(r["timing_s/logprob"] + r["timing_s/update"] for r in rows), 2),
        "peak_rss_mb": int(peak),
        "rewards": [round(r["train/reward"], 6) for r in rows],
        "load_at_start": round(run["load_start"][0], 2),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="runs of each variant, in rotation")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 6, the bandit 12)")
    ap.add_argument("--scripts", nargs="+", default=list(STEPS), help="which scripts")
    ap.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "cpu_memory.json"))
    a = ap.parse_args(argv)
    load_start = os.getloadavg()
    result = {"benchmark": "cpu_memory", "command": " ".join(["python bench/cpu_memory.py", *(argv or sys.argv[1:])])}
    with tempfile.TemporaryDirectory() as tmp:
        for script in a.scripts:
            steps = a.steps or STEPS[script]
            runs: dict[str, list] = {v: [] for v in VARIANTS}
            for _ in range(a.reps):
                for variant in VARIANTS:
                    runs[variant].append(one_run(script, variant, steps, tmp))
                    print(script, variant, runs[variant][-1], flush=True)
            same = len({tuple(r["rewards"]) for rs in runs.values() for r in rs}) == 1
            out = {
                "command": f"python {script} --sample-every 0 --steps {steps} --eval-every 0 --val-size 8",
                "same_episodes_in_every_run": same,
                "summed_over_steps": f"2-{steps}",
            }
            for variant, rs in runs.items():
                out[variant] = {
                    k: statistics.median(r[k] for r in rs) for k in ("s_steps", "gen_s", "update_s", "peak_rss_mb")
                }
                out[variant]["runs_s_steps"] = [r["s_steps"] for r in rs]
            out["speedup_now_vs_before"] = round(out["before"]["s_steps"] / out["now"]["s_steps"], 3)
            out["speedup_no_fill_vs_before"] = round(out["before"]["s_steps"] / out["no-fill"]["s_steps"], 3)
            result[script] = out
    result["machine"] = harness.machine(load_start)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
