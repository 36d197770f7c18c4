"""Benchmark: would bf16 autocast speed up the CPU path? (#16's next rung; the scripts run fp32 on the CPU today.)

Times the shipped FrozenLake tiny model in float32 and under torch.autocast("cpu", bfloat16), same weights, in this
process: the update's inner loop (forward + backward on a batch of token rows) and the generation of one turn
(starpo_frozenlake.hf_generate on the default run's 64 first-turn prompts, 48 new tokens, KV cache). CPUs with
AMX-BF16 or AVX512-BF16 (lscpu's flags, recorded in the JSON) run bf16 matrix products natively; others may get slower.
Nothing here changes what the scripts do.

    python bench/cpu_bf16.py                       # writes bench/results/cpu_bf16.json
    python bench/cpu_bf16.py --reps 1 --out /tmp/bf16.json
"""

import argparse
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

    def generate(bf16: bool) -> None:
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
    for name, fn in (("update", update), ("generate", generate)):
        fp32, bf16 = seconds(fn, False), seconds(fn, True)
        result[name] = {"fp32_s": fp32, "bf16_s": bf16, "speedup": round(fp32 / bf16, 2)}
    with autocast(True), torch.no_grad():  # the matrix products really ran in bf16 under autocast
        result["autocast_logits_dtype"] = str(model(input_ids=rows[:1, :8]).logits.dtype)
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


if __name__ == "__main__":
    main()
