"""Benchmark: which CPU thread setting survives a busy machine? The tiny model's forward + backward (the update's
inner loop) timed under each thread policy, on an idle machine and beside one busy process per core; then the
default bandit run itself (`starpo_bandit.py`, 10 steps) under torch's default, one thread and the scripts' own policy.

Policies (each in a fresh process: OpenMP reads its environment when torch loads):
  default     torch's default (one thread per core, OpenMP's spin-wait: ~300,000 spins before a thread sleeps)
  passive     all cores, OMP_WAIT_POLICY=PASSIVE (waiting threads sleep at once)
  short-spin  all cores, GOMP_SPINCOUNT=10000 (waiting threads spin briefly, then sleep)
  one         OMP_NUM_THREADS=1
  auto        what the scripts do: common.thread_policy() at start

    python bench/threads_cpu.py                                   # writes bench/results/threads_cpu.json
    python bench/threads_cpu.py --reps 2 --out /tmp/threads.json  # quicker
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

import harness

POLICIES = {
    "default": {"STARPO_THREADS": "off"},
    "passive": {"STARPO_THREADS": "off", "OMP_WAIT_POLICY": "PASSIVE"},
    "short-spin": {"STARPO_THREADS": "off", "GOMP_SPINCOUNT": "10000"},
    "one": {"STARPO_THREADS": "off", "OMP_NUM_THREADS": "1"},
    "auto": {},
}
WORK = r"""
import time, sys
sys.path.insert(0, {root!r})
import common
policy = common.thread_policy()
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
model = Qwen2ForCausalLM(cfg)
x = torch.randint(0, 1024, (32, 160))
times = []
for i in range({reps} + 1):
    t0 = time.perf_counter()
    model(input_ids=x, labels=x).loss.backward()
    times.append(time.perf_counter() - t0)
print(policy, torch.get_num_threads(), *times[1:], sep="|")
"""


def spin(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


OURS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "STARPO_THREADS")
BANDIT = ["--steps", "10", "--eval-every", "0", "--val-size", "8"]  # harness.run_script adds --sample-every 0


def policy_env(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(POLICIES[name])
    return env


def measure_bandit(name: str) -> dict:
    """The default bandit run, 10 steps (tiny model from STARPO_CACHE): median of steps 2-9 (step 10 evaluates)."""
    run = harness.run_script("starpo_bandit.py", BANDIT, warm_cache=True, env=policy_env(name))
    steps = [r["timing_s/step"] for r in run["rows"] if "timing_s/step" in r and 2 <= r["step"] <= 9]
    picked = next((line.split("threads: ", 1)[1] for line in run["stdout"].splitlines() if "threads: " in line), "?")
    return dict(policy=name, picked=picked, median_s=round(statistics.median(steps), 3), times=steps)


def measure(name: str, reps: int) -> dict:
    env = policy_env(name)
    code = WORK.format(root=str(harness.ROOT), reps=reps)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    line = out.strip().splitlines()[-1].split("|")
    policy, threads, times = line[0], int(line[1]), [float(t) for t in line[2:]]
    return dict(policy=name, picked=policy, threads=threads, median_s=round(statistics.median(times), 3), times=times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "threads_cpu.json"))
    a = p.parse_args()
    load_start, results = os.getloadavg(), {}
    for condition in ("idle", "loaded"):
        stop, hogs = mp.Event(), []
        if condition == "loaded":  # one CPU-bound process per core, as a browser + video call would be, or worse
            hogs = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 1)]
            for h in hogs:
                h.start()
            time.sleep(2)
        results[condition] = [measure(name, a.reps) for name in POLICIES]
        results[f"bandit_{condition}"] = [measure_bandit(name) for name in ("default", "one", "auto")]
        stop.set()
        for h in hogs:
            h.join()
        for r in results[condition]:
            print(f"{condition:6s} {r['policy']:10s} ({r['picked']}, {r['threads']} threads): {r['median_s']:.3f} s")
        for r in results[f"bandit_{condition}"]:
            print(f"{condition:6s} bandit run, {r['policy']:7s} ({r['picked']}): {r['median_s']:.3f} s per step")
    idle, loaded = (next(r for r in results[f"bandit_{c}"] if r["policy"] == "auto") for c in ("idle", "loaded"))
    results["bandit_loaded_over_idle"] = round(loaded["median_s"] / idle["median_s"], 2)  # the target: <= 2
    out = dict(
        benchmark="threads_cpu",
        command="python bench/threads_cpu.py " + " ".join(sys.argv[1:]),
        workload="tiny model (3.3M, Qwen2) forward+backward, batch 32 x 160 tokens; median of --reps after 1 warm-up; "
        "bandit_*: python starpo_bandit.py --sample-every 0 " + " ".join(BANDIT) + ", median s/step of steps 2-9",
        results=results,
        machine=harness.machine(load_start),
    )
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
