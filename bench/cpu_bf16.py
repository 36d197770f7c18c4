"""Benchmark: what does --precision bf16 buy on this CPU? (#16; `--precision auto` keeps a CPU in float32.)

Times the shipped FrozenLake tiny model in float32 and in bf16, same weights, in this process: the update's inner
loop (forward + backward on a batch of token rows, fp32 weights under torch.autocast("cpu", bfloat16), as the scripts
train) and the generation of one turn (starpo_frozenlake.hf_generate on the default run's 64 first-turn prompts, 48
new tokens, KV cache) by a bf16 copy of the model, as the scripts sample, and under autocast for comparison. Then,
unless --run-steps 0, the default command itself: `starpo_frozenlake.py` on the same seeds in each precision,
alternating, with the weights held still (--lr 1e-12), so both play the same kind of episodes: seconds per step,
generation per turn played, and the update with its log-prob pass (weights held still flatter bf16: in training
it was no faster here, bench/results/frozenlake_20steps_*.json). CPUs with AMX-BF16 or AVX512-BF16 (cpuinfo's
flags, recorded in the JSON) run bf16 matrix products natively; others get slower.

    python bench/cpu_bf16.py                       # writes bench/results/cpu_bf16.json
    python bench/cpu_bf16.py --reps 1 --run-steps 0 --out /tmp/bf16.json
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import harness

sys.path.insert(0, str(harness.ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each measurement (after one warm-up)")
    ap.add_argument("--rows", type=int, default=32, help="rows of the update's batch")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per row of the update's batch")
    ap.add_argument("--run-steps", type=int, default=4, help="steps of each default run (0: skip the runs)")
    ap.add_argument("--run-reps", type=int, default=2, help="default runs per precision, alternating")
    ap.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "cpu_bf16.json"))
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_start = os.getloadavg()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common
    import starpo_frozenlake as fl

    threads = common.thread_policy()  # what the scripts choose at start, before any model work
    args = fl.Args(**fl.PRESETS["tiny"])
    path = common.build_tiny_model(fl.TASK, fl.tiny_warmup_examples(args), **fl.TINY_BUILD)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    rows = torch.randint(0, model.config.vocab_size, (a.rows, a.tokens))
    prompts = []
    for i in range(args.n_groups * args.group_size):
        env = fl.make_env(args)
        text = tok.apply_chat_template(
            fl.first_messages(env.reset(10**6 + i), args), add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])

    def autocast(bf16: bool):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def update(bf16: bool) -> None:
        model.train()
        with autocast(bf16):
            logits = model(input_ids=rows).logits
        logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    sampler = copy.deepcopy(model).to(torch.bfloat16).eval()  # what the scripts sample with under bf16

    def generate(bf16: bool) -> None:
        model.eval()
        with torch.no_grad():
            fl.hf_generate(sampler if bf16 else model, tok, prompts, 1.0, args.top_p, args.max_tokens, len(prompts))

    def generate_autocast(bf16: bool) -> None:
        model.eval()
        with autocast(bf16), torch.no_grad():
            fl.hf_generate(model, tok, prompts, 1.0, args.top_p, args.max_tokens, len(prompts))

    def seconds(fn, bf16: bool) -> float:
        fn(bf16)  # warm-up: oneDNN picks its kernels on the first call
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            fn(bf16)
            times.append(time.perf_counter() - t)
        return round(statistics.median(times), 3)

    result = {"benchmark": "cpu_bf16", "command": " ".join(["python bench/cpu_bf16.py", *(argv or sys.argv[1:])])}
    for name, fn in (("update", update), ("generate", generate), ("generate_autocast", generate_autocast)):
        fp32, bf16 = seconds(fn, False), seconds(fn, True)
        result[name] = {"fp32_s": fp32, "bf16_s": bf16, "speedup": round(fp32 / bf16, 2)}
    with autocast(True), torch.no_grad():  # the matrix products really ran in bf16 under autocast
        result["autocast_logits_dtype"] = str(model(input_ids=rows[:1, :8]).logits.dtype)
    if a.run_steps:
        result["default_run"] = default_runs(a.run_steps, a.run_reps)
    result["setup"] = {
        "model": Path(path).name,
        "update_batch": [a.rows, a.tokens],
        "generate_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "reps": a.reps,
        "threads": threads,
        "torch": torch.__version__,
    }
    flags = (
        Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0] if Path("/proc/cpuinfo").exists() else ""
    )
    result["cpu_bf16_flags"] = sorted(f for f in flags.split() if "bf16" in f or f.startswith("amx"))
    result["machine"] = harness.machine(load_start)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    harness.write_result(a.out, result)


def default_runs(steps: int, reps: int) -> dict:
    """starpo_frozenlake.py's defaults for `steps` steps in each precision (alternating, `reps` runs each), weights held
    still: medians over the runs of the per-step means."""
    flags = ["--steps", str(steps), "--eval-every", "0", "--val-size", "8", "--lr", "1e-12"]
    runs: dict[str, list] = {"fp32": [], "bf16": []}
    for _ in range(reps):
        for precision in runs:
            run = harness.run_script("starpo_frozenlake.py", [*flags, "--precision", precision], warm_cache=True)
            rows = run["rows"][1:]
            turns = sum(r["train/num_turns"] for r in rows)
            runs[precision].append(
                {
                    "s_per_step": sum(r["timing_s/step"] - r.get("timing_s/eval", 0.0) for r in rows) / len(rows),
                    "gen_s_per_turn": sum(r["timing_s/gen"] for r in rows) / turns,
                    "logprob_and_update_s_per_step": sum(r["timing_s/logprob"] + r["timing_s/update"] for r in rows)
                    / len(rows),
                    "turns_per_step": turns / len(rows),
                }
            )
    out = {"command": "python starpo_frozenlake.py --sample-every 0 " + " ".join(flags) + " --precision {fp32,bf16}"}
    for precision, rs in runs.items():
        out[precision] = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
    out["speedup_s_per_step"] = round(out["fp32"]["s_per_step"] / out["bf16"]["s_per_step"], 2)
    return out


if __name__ == "__main__":
    main()
