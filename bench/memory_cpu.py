"""The laptop's memory: each script's default tiny command for one training step between two evaluations, its peak
resident memory phase by phase and whole (memory_gb/* in metrics.jsonl; Linux). Not the process's ru_maxrss (nor
`/usr/bin/time -f %M`): the run resets the kernel's high-water mark at each phase, so those see only the last phase.

    python bench/memory_cpu.py                            # the three scripts, their defaults
    python bench/memory_cpu.py sokoban -- --val-size 64   # one script, extra flags after --

Writes bench/results/memory_cpu.json (merged per command): the process's peak GB, step 0's (the model and the first
evaluation, 256 episodes), step 1's phases (rollout and its generation, the no-grad pass, the update, the
evaluation), the val/success of steps 0 and 1 (to hold a memory change to the same numbers), wall time and load.
A full default run adds nothing new after step 1: more steps of the same sizes (replies can grow a little). Target
(issue "The paper-sized run, rehearsed on the CPU"): every default tiny command at most 1.5 GB, evaluation included.
"""

import argparse
import json
import os
import sys
import time

from harness import ROOT, machine, run_script

SCRIPTS = ("bandit", "frozenlake", "sokoban")
OUT = ROOT / "bench" / "results" / "memory_cpu.json"


def measure(task: str, extra: list[str]) -> dict:
    flags = ["--steps", "1", "--eval-every", "1", "--sample-every", "0", "--save-every", "0", *extra]
    run = run_script(f"starpo_{task}.py", flags, warm_cache=True)
    memory = lambda r: {k.split("/", 1)[1]: round(v, 3) for k, v in r.items() if k.startswith("memory_gb/")}  # noqa: E731
    return {
        "command": f"python starpo_{task}.py {' '.join(flags)}",
        "peak_gb": round(max(r.get("memory_gb/peak", 0.0) for r in run["rows"]), 3),
        "step0_gb": memory(run["rows"][0]),
        "step1_gb": memory(run["rows"][1]),
        "val_success": [r.get("val/success") for r in run["rows"]],
        "wall_s": round(run["wall"], 1),
        "machine": machine(run["load_start"]),
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tasks", nargs="*", help=f"of {', '.join(SCRIPTS)} (default: all)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if set(args.tasks) - set(SCRIPTS):
        p.error(
            f"unknown task(s): {', '.join(sorted(set(args.tasks) - set(SCRIPTS)))}; the tasks: {', '.join(SCRIPTS)}"
        )
    results = json.loads(open(args.out).read()) if os.path.exists(args.out) else {"runs": {}}
    for task in args.tasks or SCRIPTS:
        r = measure(task, extra)
        results["runs"][r["command"]] = r
        print(json.dumps(r))
        with open(args.out, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
