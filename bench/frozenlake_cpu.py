"""Benchmark: the README's CPU commands for FrozenLake, timed with the tiny model cached (its build on a line of its own).

    python bench/frozenlake_cpu.py --warm-cache                        # slippery (RAGEN v1): target 0.35 in 15 min
    python bench/frozenlake_cpu.py --warm-cache --out bench/results/frozenlake_noslip_cpu.json -- --no-slippery
                                                                       # RAGEN-2's non-slippery lake: 0.80 in 15 min
    python bench/frozenlake_cpu.py                                     # cold cache: build_s says what the build cost

Writes bench/results/frozenlake_cpu.json (the schema of bench/harness.py): the eval curve (val/success by step and
by wall time) next to the exact random- and optimal-policy success on the same maps and budget (the script's dynamic
programming), wall time to each threshold, seconds per step and their split. Targets on an idle 2-core CPU: slippery
>= 0.35 (random 0.22, closed-loop optimum about 0.5; RAGEN's Qwen2.5-0.5B about 0.20), non-slippery >= 0.80 (random
about 0.2, optimum 1.0), within 15 minutes. The command line is harness.py's (--warm-cache, --steps, --val-size,
--out, -- flags).
"""

import harness

if __name__ == "__main__":
    harness.main(
        "starpo_frozenlake.py",
        "frozenlake_cpu.json",
        0.35,
        15 * 60,
        (0.30, 0.35, 0.80),
        __doc__,
        rungs={("--no-slippery",): (0.80, 15 * 60)},
        warm_judged=True,
    )
