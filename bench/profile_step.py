"""Profile: where does a default FrozenLake step spend its time on this CPU? (#16)

Plays rollouts of the default run (`starpo_frozenlake.py`'s tiny preset: 8 groups x 8 episodes, ten turns, the
shipped tiny model, in this process) with torch.profiler on the last one, and counts the page faults of each
(getrusage). Then records the update of a training step (the script's own ppo_update on that rollout's kept groups)
and profiles it too. Prints and writes the operators that took the most time, self CPU.

    python bench/profile_step.py                                   # -> bench/results/profile_step.json
    python bench/profile_step.py --rollouts 1 --out /tmp/prof.json

torch.profiler adds its own cost to every operator (a profiled rollout runs slower than a plain one), so read the
shares, not the seconds.
"""

import argparse
import contextlib
import os
import resource
import sys
import time

import harness

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
    ap.add_argument("--rollouts", type=int, default=4, help="rollouts played (the last is profiled)")
    ap.add_argument("--top", type=int, default=12, help="operators listed")
    ap.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "profile_step.json"))
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_start = os.getloadavg()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common
    import starpo_frozenlake as fl

    memory_kept = common.keep_freed_memory()  # as the scripts start
    threads = common.thread_policy()
    args = fl.Args(**fl.PRESETS["tiny"])  # the default run's settings (StarPO-S's are the Args defaults)
    path = str(common.build_tiny_model(fl.TASK, fl.tiny_warmup_examples(args), **fl.TINY_BUILD))
    tok = AutoTokenizer.from_pretrained(path)
    kw = dict(dtype=torch.float32, attn_implementation=common.attention_implementation("cpu"))
    policy = AutoModelForCausalLM.from_pretrained(path, **kw)
    common.seed_everything(args.seed, "cpu")
    rubric = fl.weighted_rubric(fl.RUBRIC, args.rubric_weights)

    def generate(prompts, temperature, turn_cache=None):
        with torch.no_grad():
            return fl.hf_generate(
                policy, tok, prompts, temperature, args.top_p, args.max_tokens, args.gen_batch_size, turn_cache
            )

    G, n = args.n_groups, args.group_size
    rollouts, prof = [], None
    for k in range(a.rollouts):
        seeds = [10**6 + k * G + g for g in range(G) for _ in range(n)]
        last = k == a.rollouts - 1
        prof_ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if last else None
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        with prof_ctx or contextlib.nullcontext():
            trajs = fl.rollout(generate, tok, seeds, args, args.temperature, rubric)
        rollouts.append(
            {
                "s": round(time.perf_counter() - t, 2),
                "profiled": last,
                "turns_per_episode": round(sum(len(t.turns) for t in trajs) / len(trajs), 2),
                "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
            }
        )
        print("rollout", rollouts[-1], flush=True)
        prof = prof_ctx or prof

    # the update of that rollout, as main() runs it (turn-grpo, no critic, one optimizer step)
    scores = torch.tensor([t.score for t in trajs], dtype=torch.float64).view(G, n)
    kept = fl.filter_groups(scores, args.keep_ratio, args.filter_mode)
    kept_trajs = [trajs[g * n + j] for g in kept.tolist() for j in range(n)]
    rows = fl.training_rows(kept_trajs, args.max_context_turns)
    batch = fl.collate(rows, tok.pad_token_id, "cpu")
    mask = batch["loss_mask"]
    old, _ = fl.old_logprobs(policy, None, None, batch, mask, args, False, contextlib.nullcontext())
    per_turn = [[turn.reward for turn in t.turns] for t in kept_trajs]
    values = [
        v
        for g in range(0, len(per_turn), n)
        for v in common.turn_group_advantages(per_turn[g : g + n], args.gamma, args.norm_adv_by_std)
    ]
    advantages = fl.place_turn_values(rows, values, mask.shape[1]) * mask
    inputs = dict(mask=mask, advantages=advantages, returns=None, **old)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    plan = common.micro_batch_plan(batch["first_len"], batch["rest_len"], batch["group"], args.micro_batch_size)
    update_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    t = time.perf_counter()
    with update_prof:
        fl.ppo_update(policy, None, None, opt, None, batch, inputs, args, torch.Generator().manual_seed(0),
                      contextlib.nullcontext())  # fmt: skip
    update = {
        "s": round(time.perf_counter() - t, 2),
        "rows": len(rows),
        "padded_tokens": common.padded_tokens(plan, batch["first_len"], batch["rest_len"], batch["group"]),
    }
    print("update", update, flush=True)

    result = {
        "benchmark": "profile_step",
        "command": " ".join(["python bench/profile_step.py", *(argv or sys.argv[1:])]),
        "rollouts": rollouts,
        "rollout_top_ops": top_ops(prof, a.top),
        "update": update,
        "update_top_ops": top_ops(update_prof, a.top),
        "setup": {"threads": threads, "memory_kept": memory_kept, "torch": torch.__version__, "model": path},
        "machine": harness.machine(load_start),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
