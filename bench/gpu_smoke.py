"""GPU smoke test, for the day a GPU machine is lent: one command, under 10 minutes, writes bench/results/gpu_smoke.json.

It needs only torch and transformers (no vLLM, no download), so it runs on a bare GPU machine; it says first which
versions it found and where they fall outside requirements.txt (the lent machine's torch 2.11: RESULTS, GPU day):
  1. each script for a few steps on its embedded tiny model on CUDA (bf16 autocast, fp32 master weights), with its
     s/step and peak GPU memory;
  2. starpo_sokoban.py at RAGEN's batch sizes (8 groups x 16, 400 tokens a turn, 5 turns) on a randomly initialised
     model with Qwen2.5-0.5B-Instruct's architecture (24 layers, hidden 896, 14 heads, 2 KV heads) and the tiny
     tokenizer: its peak memory and s/step are what the paper-sized run costs (a random model never stops, so every
     reply runs to 400 tokens: an upper bound). Qwen's own vocabulary (151,936 tokens) would add ~136M embedding
     parameters; the tiny tokenizer's does not, and the JSON says so;
  3. the same for one step each with --lora-rank 64, with --gradient-checkpointing, and with the memory plan's 24 GB
     line (bench/memory_plan.py): peak memory to set beside the plan's computed rows;
  4. torchrun with 2 processes (nccl, one GPU each) against one process with --request-seeds, the bandit's tiny
     model: the metrics that must agree, and s/step of each. Skipped, saying so, with fewer than 2 GPUs.

What it cannot check: vLLM on CUDA (the lent machine has no vLLM and reaches no registry), so the engine, its weight
push and a merged LoRA model loaded by vLLM are not run on the GPU. bench/rehearsal.py runs them on vLLM's CPU build
(the same engine code) at the full size, Qwen's 151,936-row vocabulary included, with --resume and the memory plan.

    python bench/gpu_smoke.py                        # on a GPU machine
    python bench/gpu_smoke.py --device cpu --quick   # the same plumbing on a CPU in a minute or two (a check)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import plumbing.dist  # noqa: E402
import plumbing.tiny  # noqa: E402
import starpo_bandit as sb  # noqa: E402
import starpo_frozenlake as fl  # noqa: E402
import starpo_sokoban as ss  # noqa: E402


def run(script, argv: list[str], device: str) -> dict:
    """script.main(argv) in this process; s/step from its metrics, peak memory from torch (CUDA only)."""
    with tempfile.TemporaryDirectory() as tmp:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        script.main([*argv, "--device", device, "--backend", "hf", "--sample-every", "0", "--output-dir", tmp])
        rows = [json.loads(line) for line in open(Path(tmp) / "metrics.jsonl")]
    train = [r for r in rows if "timing_s/step" in r]
    return {
        "argv": " ".join(argv),
        "wall_s": round(time.time() - t0, 1),
        "s_per_step": [round(r["timing_s/step"], 2) for r in train],
        "gen_s": [round(r["timing_s/gen"], 2) for r in train],
        "update_s": [round(r["timing_s/update"], 2) for r in train],
        "response_length_mean": [round(r["response_length/mean"], 1) for r in train],
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        "final_val_success": [r["val/success"] for r in rows if "val/success" in r][-1],
    }


def torchrun_pair(device: str, small: list[str]) -> dict:
    """starpo_bandit.py on 2 processes (torchrun) against 1 with --request-seeds: the keys that differ (timings and
    the per-micro-batch means aside; tests/test_torchrun.py holds the same on CPUs) and each run's s/step."""
    count = torch.cuda.device_count() if device == "cuda" else 2  # on a CPU: 2 gloo processes, a plumbing check
    if count < 2:
        return {"skipped": f"needs 2 GPUs, found {count}"}
    argv = ["--model", "tiny", *small, "--device", device, "--backend", "hf", "--sample-every", "0", "--mi-every", "0"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, cmd in (
            (1, [*plumbing.dist.launcher(1), "starpo_bandit.py", "--request-seeds"]),
            (2, [*plumbing.dist.launcher(2), "starpo_bandit.py"]),
        ):
            out = Path(tmp) / f"n{n}"
            done = subprocess.run([*cmd, *argv, "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                return {"failed": f"{n} process(es), exit {done.returncode}: {done.stderr[-2000:]}"}
            runs[n] = [json.loads(line) for line in open(out / "metrics.jsonl")]
    differ = sorted({k for a, b in zip(*runs.values()) for k in plumbing.dist.differing_metrics(a, b)})
    norms = [(a["actor/grad_norm"], b["actor/grad_norm"]) for a, b in zip(*runs.values()) if "actor/grad_norm" in a]
    return {
        "argv": " ".join(argv),
        "keys_that_differ": differ,  # expected: none
        "grad_norm_max_rel_diff": max((abs(a - b) / max(abs(a), 1e-12) for a, b in norms), default=None),
        "s_per_step_1_process": [round(r["timing_s/step"], 2) for r in runs[1] if "timing_s/step" in r],
        "s_per_step_2_processes": [round(r["timing_s/step"], 2) for r in runs[2] if "timing_s/step" in r],
    }


def qwen_sized_model(out: Path, quick: bool) -> str:
    """Qwen2.5-0.5B-Instruct's architecture, randomly initialised, with the tiny Sokoban model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tiny = plumbing.tiny.build_tiny_model(
        "sokoban", ss.tiny_warmup_examples(ss.Args(**ss.PRESETS["tiny"])), **ss.TINY_BUILD
    )
    tok = AutoTokenizer.from_pretrained(tiny)
    layers, hidden, inter, heads = (2, 128, 256, 2) if quick else (24, 896, 4864, 14)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out), sum(p.numel() for p in model.parameters())


def versions() -> str:
    """torch's and transformers' versions here against requirements.txt's ranges, said before anything runs."""
    import transformers
    from packaging.requirements import Requirement

    lines = [line for line in (ROOT / "requirements.txt").read_text().splitlines() if line and line[0] != "#"]
    asked = {r.name: r for r in map(Requirement, lines)}
    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    return "; ".join(
        f"{name} {v}"
        + ("" if asked[name].specifier.contains(v.split("+")[0]) else f" (requirements.txt: {asked[name]})")
        for name, v in found.items()
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes everywhere: checks the plumbing, measures nothing")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_smoke.json"))
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA device is visible (use --device cpu --quick to check the plumbing)")
    found = versions()
    print(found, flush=True)
    small = ["--steps", "2" if a.quick else "4", "--eval-every", "0", "--val-size", "8" if a.quick else "64"]
    if a.quick:
        small += ["--n-groups", "2", "--group-size", "2"]
    result = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "versions": found,
        "quick": a.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "tiny": {},
    }
    for name, script in (("bandit", sb), ("frozenlake", fl), ("sokoban", ss)):
        result["tiny"][name] = run(script, ["--model", "tiny", *small], a.device)
        print(name, result["tiny"][name], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, params = qwen_sized_model(Path(tmp) / "qwen-sized", a.quick)
        paper = ["--model", path, "--preset", "paper", "--steps", "2", "--eval-every", "0", "--val-size", "8"]
        if a.quick:
            paper += ["--n-groups", "2", "--group-size", "2", "--max-tokens", "16"]
        result["qwen2.5_0.5b_architecture"] = {
            "params": params,
            "vocab": "the tiny tokenizer's (Qwen's own adds ~136M embedding parameters)",
            **run(ss, paper, a.device),
        }
        print("qwen-sized", result["qwen2.5_0.5b_architecture"], flush=True)
        # The memory plan's levers at the same sizes, one step each (bench/memory_plan.py prices them): LoRA rank 64,
        # gradient checkpointing, and the plan's 24 GB command for 0.5B with a critic (one row per micro-batch).
        for key, flags in (
            ("lora_r64", ["--lora-rank", "64"]),
            ("gradient_checkpointing", ["--gradient-checkpointing"]),
            ("plan_24gb", ["--micro-batch-size", "1", "--gradient-checkpointing"]),
        ):
            one = [*paper, "--steps", "1", *flags]
            result[f"qwen2.5_0.5b_architecture_{key}"] = run(ss, one, a.device)
            print(key, result[f"qwen2.5_0.5b_architecture_{key}"], flush=True)
    result["torchrun_2_processes"] = torchrun_pair(a.device, small)
    print("torchrun", result["torchrun_2_processes"], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
