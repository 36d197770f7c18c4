"""Benchmark: the README's CPU command (`python starpo_sokoban.py`), timed with the tiny model cached.

    python bench/sokoban_cpu.py --warm-cache      # judged: >= 0.40 within 20 minutes of wall time
    python bench/sokoban_cpu.py                   # cold cache: build_s says what the tiny model's build cost

Writes bench/results/sokoban_cpu.json (the schema of bench/harness.py): the eval curve next to val/random_success
(simulation) and val/optimal_success (BFS solver) on the same evaluation rooms, wall time to 0.30 and 0.40, seconds
per step. Target on an idle 2-core CPU: >= 0.40 eval success within 20 minutes (random 0.15 on RAGEN's rooms; RAGEN's
Qwen2.5-0.5B with StarPO-S: 0.215; SPA's Qwen2.5-1.5B: 0.598). The command line is harness.py's (--warm-cache,
--steps, --val-size, --out, -- flags).
"""

import harness

if __name__ == "__main__":
    harness.main("starpo_sokoban.py", "sokoban_cpu.json", 0.40, 20 * 60, (0.30, 0.40), __doc__, warm_judged=True)
