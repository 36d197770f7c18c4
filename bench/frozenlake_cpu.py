"""Benchmark: the README's CPU command (`python starpo_frozenlake.py`), timed end to end from a cold model cache.

Does the embedded tiny model learn slippery FrozenLake on a CPU, and where does it end up between the uniformly
random policy and the optimal one? Writes bench/results/frozenlake_cpu.json (the schema of bench/harness.py): the
eval curve next to the exact random- and optimal-policy success on the same maps and budget (the script's dynamic
programming), wall time to 0.35 and 0.40, seconds per step. Target on a 2-core CPU: >= 0.40 eval success within 15
minutes of wall time. The command line is harness.py's (--warm-cache, --steps, --val-size, --out, -- flags).
"""

import harness

if __name__ == "__main__":
    harness.main("starpo_frozenlake.py", "frozenlake_cpu.json", 0.40, 15 * 60, (0.35, 0.40), __doc__)
