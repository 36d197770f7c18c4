"""Benchmark: the README's CPU command (`python starpo_bandit.py`), timed end to end from a cold model cache.

Writes bench/results/bandit_cpu.json (the schema of bench/harness.py): the eval curve, wall time to 0.9 and 0.95
eval high-arm rate (the tiny model's build included), seconds per step and their breakdown, generated tokens per
second. Target on a 2-core CPU: >= 0.95 eval high-arm rate within 180 s of wall time. Every figure comes from this
run; nothing is hard-coded. The command line is harness.py's (--warm-cache, --steps, --val-size, --out, -- flags).
"""

import harness

if __name__ == "__main__":
    harness.main("starpo_bandit.py", "bandit_cpu.json", 0.95, 180, (0.9, 0.95), __doc__)
