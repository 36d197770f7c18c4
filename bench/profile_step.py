"""Profile: where does a default FrozenLake step spend its time on this CPU? (#16)

Runs the default command itself (`starpo_frozenlake.py --steps N --eval-every 0 --val-size 8`, the shipped tiny model,
in this process), with its `rollout` and `ppo_update` wrapped (as bench/update_plan.py records its updates): the
page faults (getrusage) and seconds of every training rollout, and torch.profiler on the last step's rollout and
update. Prints and writes the operators that took the most time, self CPU.

    python bench/profile_step.py                                   # -> bench/results/profile_step.json
    python bench/profile_step.py --rollouts 1 --out /tmp/prof.json
    python bench/profile_step.py --out /tmp/prof_bf16.json -- --precision bf16      # script flags after --

torch.profiler adds its own cost to every operator (a profiled rollout runs slower than a plain one), so read the
shares, not the seconds.
"""

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import harness
import plumbing.forward

sys.path.insert(0, str(harness.ROOT))


def top_ops(prof, n: int) -> list[dict]:
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    return [
        {"op": e.key, "self_s": round(e.self_cpu_time_total / 1e6, 3), "share": round(e.self_cpu_time_total / total, 3),
         "calls": e.count}
        for e in ops[:n]
    ]  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rollouts", type=int, default=4, help="training steps run (the last one's rollout and update are profiled)"
    )
    ap.add_argument("--top", type=int, default=12, help="operators listed")
    ap.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "profile_step.json"))
    ap.add_argument(
        "extra", nargs="*", help="extra flags for starpo_frozenlake.py (after --), e.g. -- --precision bf16"
    )
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_start = os.getloadavg()

    import torch

    import starpo_frozenlake as fl

    rollouts, update, profiles = [], {}, {}
    real_rollout, real_update, real_old = fl.rollout, fl.ppo_update, fl.old_logprobs

    def profiled(name: str, last: bool):
        if not last:
            return contextlib.nullcontext()
        profiles[name] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        return profiles[name]

    def rollout(generate, tok, seeds, args, temperature, rubric):
        if temperature != fl.SETTINGS["temperature"]:  # an evaluation (val_temperature): not profiled
            return real_rollout(generate, tok, seeds, args, temperature, rubric)
        faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        with profiled("rollout", len(rollouts) == a.rollouts - 1):
            trajs = real_rollout(generate, tok, seeds, args, temperature, rubric)
        rollouts.append(
            {
                "s": round(time.perf_counter() - t, 2),
                "profiled": len(rollouts) == a.rollouts - 1,
                "turns_per_episode": round(sum(len(t.turns) for t in trajs) / len(trajs), 2),
                "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
            }
        )
        print("rollout", rollouts[-1], flush=True)
        return trajs

    def ppo_update(policy, critic, ref, opt, critic_opt, batch, inputs, args, generator, autocast):
        t = time.perf_counter()
        with profiled("update", len(rollouts) == a.rollouts):
            out = real_update(policy, critic, ref, opt, critic_opt, batch, inputs, args, generator, autocast)
        keys = (batch["first_len"], batch["rest_len"], batch["group"])
        plan = plumbing.forward.micro_batch_plan(*keys, args.micro_batch_size)
        update.update(s=round(time.perf_counter() - t, 2), rows=len(batch["rest_len"]),
                      padded_tokens=plumbing.forward.padded_tokens(plan, *keys))  # fmt: skip
        return out

    def old_logprobs(*args, **kwargs):
        t = time.perf_counter()  # the log-prob pass before the update (reference, critic; none by default)
        out = real_old(*args, **kwargs)
        update["old_logprobs_s"] = round(time.perf_counter() - t, 2)
        return out

    flags = ["--steps", str(a.rollouts), "--eval-every", "0", "--val-size", "8", "--sample-every", "0", *a.extra]
    fl.rollout, fl.ppo_update, fl.old_logprobs = rollout, ppo_update, old_logprobs
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fl.main(flags + ["--output-dir", str(Path(tmp) / "run")])
            config = json.loads((Path(tmp) / "run" / "config.json").read_text())
    finally:
        fl.rollout, fl.ppo_update, fl.old_logprobs = real_rollout, real_update, real_old
    print("update", update, flush=True)

    result = {
        "benchmark": "profile_step",
        "command": " ".join(["python bench/profile_step.py", *(argv or sys.argv[1:])]),
        "script_flags": flags,
        "rollouts": rollouts,
        "rollout_top_ops": top_ops(profiles["rollout"], a.top),
        "update": update,
        "update_top_ops": top_ops(profiles["update"], a.top),
        "setup": {"torch": torch.__version__, "model": config["model_path"], "precision": config["precision"]},
        "machine": harness.machine(load_start),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
