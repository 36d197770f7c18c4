"""Benchmark: which CPU thread setting survives a busy machine? The tiny model's forward + backward (the update's
inner loop) timed under each thread policy, on an idle machine and beside one busy process per core.

Policies (each in a fresh process: OpenMP reads its environment when torch loads):
  default   torch's default (one thread per core, OpenMP's active spin-wait)
  passive   all cores, OMP_WAIT_POLICY=PASSIVE (waiting threads sleep instead of spinning)
  one       OMP_NUM_THREADS=1
  auto      what common.thread_policy() picks at start (the scripts' default)

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


def measure(name: str, reps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "STARPO_THREADS")}
    env.update(POLICIES[name])
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
        stop.set()
        for h in hogs:
            h.join()
        for r in results[condition]:
            print(f"{condition:6s} {r['policy']:8s} ({r['picked']}, {r['threads']} threads): {r['median_s']:.3f} s")
    out = dict(
        benchmark="threads_cpu",
        command="python bench/threads_cpu.py " + " ".join(sys.argv[1:]),
        workload="tiny model (3.3M, Qwen2) forward+backward, batch 32 x 160 tokens; median of --reps after 1 warm-up",
        results=results,
        machine=harness.machine(load_start),
    )
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
