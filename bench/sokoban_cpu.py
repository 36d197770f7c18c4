"""Benchmark: the README's CPU command (`python starpo_sokoban.py`), timed end to end from a cold model cache.

Writes bench/results/sokoban_cpu.json (the schema of bench/harness.py): the eval curve next to val/random_success
(simulation) and val/optimal_success (BFS solver) on the same evaluation rooms, wall time to 0.40 and 0.60, seconds
per step. Target on a 2-core CPU: >= 0.60 eval success within 20 minutes of wall time (RAGEN's Qwen2.5-0.5B with
StarPO-S: 0.215). The command line is harness.py's (--warm-cache, --steps, --val-size, --out, -- flags).
"""

import harness

if __name__ == "__main__":
    harness.main("starpo_sokoban.py", "sokoban_cpu.json", 0.60, 20 * 60, (0.40, 0.60), __doc__)
