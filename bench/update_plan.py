"""Benchmark: the multi-turn update with micro-batches of like length (common.micro_batch_plan) against one padded
pass over the same rows, on real batches.

    python bench/update_plan.py                 # -> bench/results/update_plan.json
    python bench/update_plan.py --steps 2 --reps 1 --out /tmp/x.json   # check the plumbing

It runs `starpo_frozenlake.py`'s tiny defaults for a few steps (`--steps N --eval-every 0 --val-size 8`, in this
process, the tiny model cached), records every step's update inputs (weights, batch, advantages), then replays
each update from the same weights with the plan and with one micro-batch holding every row, alternating, and
reports the median seconds of each and the padded tokens each would run. Run it alone on an idle machine; the
load is recorded.
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import starpo_frozenlake as fl  # noqa: E402


def real_tokens(first, rest, group) -> int:
    """The tokens with no padding: each group's first prompt once, every row's rest."""
    firsts = dict(zip(group.tolist(), first.tolist()))
    return sum(firsts.values()) + int(rest.sum())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="training steps whose updates are recorded")
    ap.add_argument("--reps", type=int, default=3, help="replays of every recorded update, per variant")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "update_plan.json"))
    opts = ap.parse_args(argv)
    load_start = os.getloadavg()
    t_start = time.time()

    recorded, real_update = [], fl.ppo_update

    def record(policy, critic, ref, opt, critic_opt, batch, inputs, args, generator, autocast):
        clone = lambda v: v.clone() if torch.is_tensor(v) else v  # noqa: E731
        recorded.append((copy.deepcopy(policy.state_dict()), {k: clone(v) for k, v in batch.items()},
                         {k: clone(v) for k, v in inputs.items()}, args, policy))  # fmt: skip
        return real_update(policy, critic, ref, opt, critic_opt, batch, inputs, args, generator, autocast)

    fl.ppo_update = record
    flags = ["--steps", str(opts.steps), "--eval-every", "0", "--val-size", "8", "--sample-every", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        fl.main(flags + ["--output-dir", str(Path(tmp) / "run")])
    fl.ppo_update = real_update

    planner = common.micro_batch_plan
    variants = {"plan": planner, "one_pass": lambda first, *rest: [torch.arange(len(first))]}
    seconds = {name: [] for name in variants}
    try:
        for _ in range(opts.reps):
            for name, plan in variants.items():
                common.micro_batch_plan = plan
                for weights, batch, inputs, args, policy in recorded:
                    policy.load_state_dict(weights)
                    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
                    gen = torch.Generator().manual_seed(0)
                    t = time.perf_counter()
                    real_update(policy, None, None, opt, None, batch, inputs, args, gen, contextlib.nullcontext())
                    seconds[name].append(time.perf_counter() - t)
    finally:
        common.micro_batch_plan = planner
    batches = []
    for _, batch, _, args, _ in recorded:
        keys = (batch["first_len"], batch["rest_len"], batch["group"])
        plan = planner(*keys, args.micro_batch_size)
        one = [torch.arange(len(batch["rest_len"]))]
        batches.append(dict(rows=len(batch["rest_len"]), micro_batches=[len(p) for p in plan],
                            real_tokens=real_tokens(*keys),
                            padded_tokens_plan=common.padded_tokens(plan, *keys),
                            padded_tokens_one_pass=common.padded_tokens(one, *keys)))  # fmt: skip
    med = {k: round(statistics.median(v), 3) for k, v in seconds.items()}
    result = dict(
        benchmark="update_plan",
        command="python bench/update_plan.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        script_flags=flags,
        machine=dict(cpus=os.cpu_count(), load_avg_at_start=[round(x, 2) for x in load_start]),
        median_update_s=med,
        speedup=round(med["one_pass"] / med["plan"], 2),
        seconds={k: [round(x, 3) for x in v] for k, v in seconds.items()},
        batches=batches,
        wall_s=round(time.time() - t_start, 1),
    )
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_update_s", "speedup", "machine")}))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
