"""Benchmark: starpo_bandit.py against TRL's GRPOTrainer on the same model, matched settings, one invocation.

Exports the embedded tiny model (after its format warm-up) to a directory, then trains it twice, one run after the
other: TRL's GRPOTrainer and `starpo_bandit.py --algo starpo-s --estimator grpo`, with the same prompts (the same
training seeds, in the same order), the same reward (starpo_bandit's rubric total), groups x group size, max new
tokens, learning rate, temperature, no KL, clip 0.2 / 0.28 and number of steps. Both final models are then scored by
the same evaluator (starpo_bandit.evaluate, fixed validation seeds, temperature 0.5) in this process. It also times
the hf backend's generation (starpo_bandit.hf_generate) next to plain model.generate on one batch.

Writes bench/results/vs_trl.json: median seconds per optimizer step for each, their ratio, total wall time, eval
high-arm rate after N steps for each, and generated tokens per second. Every figure comes from this run.
Target: StarPO median s/step <= 0.25 x TRL's, with an eval high-arm rate >= TRL's after N steps.

TRL is a benchmark-only dependency (requirements-bench.txt); the scripts and the default tests never need it:
    python -m venv /tmp/bench-venv
    /tmp/bench-venv/bin/pip install torch==2.13.0 -r requirements.txt -r requirements-bench.txt
    /tmp/bench-venv/bin/python bench/vs_trl.py                            # ~10 min on 2 cores
    python bench/vs_trl.py --skip-trl --steps 2 --val-size 32             # StarPO side only (no trl needed)

Both training runs are subprocesses of the same interpreter (sys.executable), the TRL one via `--_trl-worker`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import starpo_bandit as sb  # noqa: E402
import plumbing.engine  # noqa: E402
import plumbing.run  # noqa: E402
import plumbing.tiny  # noqa: E402

# The training environment both sides use: starpo_bandit's defaults (Phoenix 0.15, Dragon 1.0 w.p. 0.25).
_DEFAULT_ARGS = sb.Args()
ENV_KWARGS = dict(low_name=_DEFAULT_ARGS.low_arm_name, high_name=_DEFAULT_ARGS.high_arm_name)  # BanditEnv's payouts


########################################################################################################################
# Pure helpers (imported by tests/test_bench_vs_trl.py; no trl needed)
########################################################################################################################


def train_group_seeds(steps: int, n_groups: int, seed: int) -> list[int]:
    """The reset seeds starpo_bandit.py trains on, in order: step s, group g -> seed * 10**7 + (s - 1) * G + g."""
    return [seed * 10**7 + (step - 1) * n_groups + g for step in range(1, steps + 1) for g in range(n_groups)]


def trl_dataset_rows(steps: int, n_groups: int, seed: int, env_kwargs: dict | None = None) -> list[dict]:
    """One conversational row per group seed, in training order; TRL repeats each row num_generations times.

    The "seed" column is forwarded by TRL to the reward function, which re-creates the episode from it.
    """
    env = sb.BanditEnv(**(env_kwargs or ENV_KWARGS))
    return [{"prompt": sb.make_messages(env.reset(s)), "seed": s} for s in train_group_seeds(steps, n_groups, seed)]


def completion_text(completion) -> str:
    """TRL passes a conversational completion as [{"role": "assistant", "content": text}], a standard one as text."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role", "assistant") == "assistant")


def bandit_reward(completions, seed, **kwargs) -> list[float]:
    """TRL reward function: starpo_bandit's rubric total for each completion, on the episode its seed defines.

    Same path as starpo_bandit.rollout: reset the env with the row's seed and member index, parse <think>/<answer>,
    step the env with the answer ("" when missing), score the Turn with RUBRIC.
    """
    out, seen = [], {}
    for completion, s in zip(completions, seed, strict=True):
        member = seen.get(int(s), 0)  # TRL lays a group's copies side by side: the i-th copy is member i, as in rollout
        seen[int(s)] = member + 1
        env = sb.BanditEnv(**ENV_KWARGS)
        env.reset(int(s), member)
        text = completion_text(completion)
        think, answer = sb.parse_reply(text)
        _, reward, _, info = env.step(answer if answer is not None else "")
        total, _ = sb.score_turn(sb.Turn(text=text, think=think, answer=answer, payout=reward, info=info), sb.RUBRIC)
        out.append(total)
    return out


def matched_settings(
    steps: int = 20,
    n_groups: int = 8,
    group_size: int = 4,
    max_tokens: int = 64,
    lr: float = 1e-4,
    val_size: int = 256,
    seed: int = 0,
) -> dict:
    """The two sides' settings, built from one set of numbers.

    starpo_argv: flags for starpo_bandit.py (the model and output directory are added by the caller).
    grpo_config: keyword arguments for trl.GRPOConfig (output_dir added by the caller). One optimizer step consumes
    exactly n_groups * group_size completions: per_device_train_batch_size = that number, no gradient accumulation,
    one generation per step (steps_per_generation 1, so generation_batch_size = per_device_train_batch_size on one
    process), num_generations = group_size, num_iterations 1 (one PPO epoch, fresh completions every step).
    """
    completions = n_groups * group_size
    starpo_argv = [
        "--algo",
        "starpo-s",
        "--estimator",
        "grpo",
        "--backend",
        "hf",
        "--device",
        "cpu",
        "--precision",
        "fp32",  # TRL trains in float32 here (bf16=False): like for like
        "--n-groups",
        str(n_groups),
        "--group-size",
        str(group_size),
        "--max-tokens",
        str(max_tokens),
        "--lr",
        str(lr),
        "--top-p",
        "1.0",
        "--kl-coef",
        "0",
        "--mini-batch-size",
        str(completions),
        "--micro-batch-size",
        str(completions),
        "--ppo-epochs",
        "1",
        "--steps",
        str(steps),
        "--eval-every",
        str(steps),
        "--val-size",
        str(val_size),
        "--seed",
        str(seed),
        "--sample-every",
        "0",
        "--log-rollouts-every",
        "0",
    ]
    grpo_config = dict(
        # batch geometry: one optimizer step = n_groups prompts x group_size completions
        num_generations=group_size,
        per_device_train_batch_size=completions,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=steps,
        shuffle_dataset=False,
        # generation (transformers' generate, no vLLM)
        max_completion_length=max_tokens,
        temperature=sb.SETTINGS["temperature"],  # the script's rollout temperature (1.0)
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        # loss: no KL, clip 0.2 / 0.28, dual clip 3 (TRL's `delta` caps the ratio: the same as a dual clip of 3
        # for negative advantages), token-mean aggregation over the whole step ("dapo"), group-std scaling,
        # entropy bonus 0.001 (starpo_bandit's --entropy-coef default)
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        delta=3.0,
        loss_type="dapo",
        scale_rewards="group",
        entropy_coef=0.001,
        mask_truncated_completions=False,
        # optimiser: AdamW (0.9, 0.999), weight decay 0.01, constant lr, grad clip 1.0 (starpo_bandit's defaults)
        **trl_plain_cpu(lr, 0.01, 1.0, seed),
    )
    return dict(starpo_argv=starpo_argv, grpo_config=grpo_config, completions_per_step=completions)


def trl_plain_cpu(lr: float, weight_decay: float, grad_clip: float, seed: int) -> dict:
    """GRPOConfig's optimiser, machine and bookkeeping arguments both TRL benchmarks share: AdamW (0.9, 0.999) at
    a constant lr, fp32 on the CPU without gradient checkpointing (the scripts have none either), no saving."""
    return dict(
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=grad_clip,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        seed=seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def step_timer():
    """A transformers TrainerCallback that stamps each optimizer step's begin and end (time.time())."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begins, self.ends = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

    return StepTimer()


def median_step_seconds_starpo(rows: list[dict]) -> list[float]:
    """Per-step seconds from starpo_bandit's metrics.jsonl, eval time taken out (step 0 is the pre-training eval)."""
    return [
        r["timing_s/step"] - r.get("timing_s/eval", 0.0) for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r
    ]


def step_seconds_from_stamps(begins: list[float], ends: list[float]) -> list[float]:
    """Seconds per optimizer step from TrainerCallback stamps: first step end - begin, then end-to-end gaps."""
    if not ends:
        return []
    return [ends[0] - begins[0]] + [b - a for a, b in zip(ends, ends[1:])]


########################################################################################################################
# TRL side (runs in a subprocess: python bench/vs_trl.py --_trl-worker CONFIG.json)
########################################################################################################################


def trl_worker(config_path: str) -> None:
    import datasets
    import transformers
    import trl

    cfg = json.loads(Path(config_path).read_text())
    out_dir = Path(cfg["out_dir"])
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()

    rows = trl_dataset_rows(cfg["steps"], cfg["n_groups"], cfg["seed"])
    dataset = datasets.Dataset.from_list(rows)
    config = trl.GRPOConfig(output_dir=str(out_dir / "trainer"), **cfg["grpo_config"])
    timer = step_timer()
    t0 = time.time()
    trainer = trl.GRPOTrainer(
        model=cfg["model_dir"], reward_funcs=bandit_reward, args=config, train_dataset=dataset, callbacks=[timer]
    )
    t_init = time.time() - t0
    t1 = time.time()
    trainer.train()
    t_train = time.time() - t1
    trainer.save_model(str(out_dir / "final"))
    effective = {
        k: getattr(config, k)
        for k in (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "generation_batch_size",
            "steps_per_generation",
            "num_generations",
        )
    }
    (out_dir / "trl_result.json").write_text(
        json.dumps(
            dict(
                trl_version=trl.__version__,
                step_begin=timer.begins,
                step_end=timer.ends,
                init_s=t_init,
                train_s=t_train,
                global_step=trainer.state.global_step,
                effective=effective,
                log_history=trainer.state.log_history,
            ),
            indent=1,
        )
    )


########################################################################################################################
# Measurements in this process: evaluation and generation throughput
########################################################################################################################


def load(model_dir: str, tok_dir: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir or model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


def evaluate_model(model_dir: str, tok_dir: str, val_size: int, max_tokens: int, seed: int) -> dict:
    """starpo_bandit.evaluate on val seeds at temperature 0.5, with an hf_generate closure; same RNG seed each time."""
    import torch

    model, tok = load(model_dir, tok_dir)
    args = sb.Args(
        val_size=val_size,
        max_tokens=max_tokens,
        val_low_arm_name=ENV_KWARGS["low_name"],
        val_high_arm_name=ENV_KWARGS["high_name"],
    )

    def generate(prompts, temperature, seeds=None):
        return plumbing.engine.hf_generate(model, tok, prompts, temperature, 1.0, max_tokens)

    torch.manual_seed(seed)
    t0 = time.time()
    val, _ = sb.evaluate(generate, tok, args, sb.RUBRIC)
    return {k: round(float(v), 4) for k, v in val.items()} | {"eval_s": round(time.time() - t0, 1)}


def generation_throughput(
    model_dir: str, n_prompts: int, group_size: int, max_tokens: int, seed: int, reps: int
) -> dict:
    """Generated tokens per second: starpo_bandit.hf_generate vs plain model.generate, same model and batch.

    The batch is n_prompts distinct bandit prompts, each repeated group_size times (a training step's shape).
    Tokens counted: each reply up to and including its first stop token (or max_tokens). Median over reps,
    the two alternating.
    """
    import torch

    model, tok = load(model_dir)
    stops = plumbing.engine.stop_token_ids(tok)
    env = sb.BanditEnv(**ENV_KWARGS)
    prompts = []
    for s in range(n_prompts):
        text = tok.apply_chat_template(
            sb.make_messages(env.reset(10**8 + s)), add_generation_prompt=True, tokenize=False
        )
        prompts += [tok(text, add_special_tokens=False)["input_ids"]] * group_size
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), tok.pad_token_id)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1

    def run_hf():
        replies = plumbing.engine.hf_generate(model, tok, prompts, 1.0, 1.0, max_tokens, batch_size=len(prompts))
        return sum(len(ids) for ids, _ in replies)

    @torch.no_grad()
    def run_plain():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
        )
        new = out[:, width:].tolist()
        return sum(next((j + 1 for j, t in enumerate(row) if t in stops), len(row)) for row in new)

    torch.manual_seed(seed)
    run_hf(), run_plain()  # warm-up (allocator, kernels)
    rates = {"hf_generate": [], "model_generate": []}
    secs = {"hf_generate": [], "model_generate": []}
    for _ in range(reps):
        for name, fn in (("hf_generate", run_hf), ("model_generate", run_plain)):
            t0 = time.perf_counter()
            n = fn()
            dt = time.perf_counter() - t0
            rates[name].append(n / dt)
            secs[name].append(dt)
    hf, plain = statistics.median(rates["hf_generate"]), statistics.median(rates["model_generate"])
    return {
        "batch": f"{n_prompts} distinct prompts x {group_size} = {len(prompts)} replies, up to {max_tokens} new tokens",
        "reps": reps,
        "hf_generate_tokens_per_s": round(hf, 1),
        "model_generate_tokens_per_s": round(plain, 1),
        "hf_generate_s_per_batch": round(statistics.median(secs["hf_generate"]), 3),
        "model_generate_s_per_batch": round(statistics.median(secs["model_generate"]), 3),
        "speedup": round(hf / plain, 2),
    }


########################################################################################################################
# Orchestration
########################################################################################################################


def run_logged(cmd: list[str], log_path: Path, env: dict) -> float:
    """Run a subprocess with its output in log_path; return its wall time; exit with the log's tail on failure."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{log_path.read_text()[-3000:]}")
    return wall


def summarise_steps(secs: list[float]) -> dict:
    return {
        "median_s_per_step": round(statistics.median(secs), 3),
        "mean_s_per_step": round(statistics.mean(secs), 3),
        "min_s_per_step": round(min(secs), 3),
        "s_per_step": [round(s, 3) for s in secs],
    }


def write_result(out: dict, path: Path, t_bench: float, load_at_start: list, quiet: tuple) -> None:
    """Add the wall time, the machine and the date, write the JSON, print it (less the `quiet` keys)."""
    out["bench_wall_s"] = round(time.time() - t_bench, 1)
    out["machine"] = {
        "cpus": os.cpu_count(),
        "torch_threads": __import__("torch").get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_at_start": load_at_start,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in quiet}, indent=1))


def newest_model_dir(run_dir: Path) -> Path:
    """The policy of a starpo_bandit run's newest checkpoint."""
    ckpt = plumbing.run.latest_checkpoint(run_dir)
    if ckpt is None:
        sys.exit(f"no checkpoint under {run_dir}")
    return ckpt / "policy"


def run_starpo(name: str, argv: list[str], export_dir: Path, work: Path, env: dict) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "starpo_bandit.py", "--model", str(export_dir), *argv, "--output-dir", str(run_dir)]
    print(f"[vs_trl] {name}: {' '.join(cmd[1:])}", flush=True)
    wall = run_logged(cmd, work / f"{name}.log", env)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    secs = median_step_seconds_starpo(rows)
    train = [r for r in rows if r.get("step", 0) >= 1]
    internal = [r["val/success"] for r in rows if "val/success" in r]
    return dict(
        command="python starpo_bandit.py --model <export> " + " ".join(argv),
        wall_s_total=round(wall, 1),
        **summarise_steps(secs),
        median_gen_s=round(statistics.median(r["timing_s/gen"] for r in train), 3),
        median_update_s=round(statistics.median(r["timing_s/update"] for r in train), 3),
        train_s=round(sum(secs), 1),
        train_reward_per_step=[round(r["train/reward"], 3) for r in train],
        train_success_per_step=[round(r["train/success"], 3) for r in train],
        internal_val_success_step0_and_final=internal,  # starpo_bandit's own evals (its own RNG stream)
        final_dir=str(newest_model_dir(run_dir)),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps for each side")
    ap.add_argument("--n-groups", type=int, default=8, help="distinct prompts per step")
    ap.add_argument("--group-size", type=int, default=4, help="completions per prompt (TRL num_generations)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max new tokens per completion")
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate (the tiny model's default)")
    ap.add_argument("--val-size", type=int, default=256, help="evaluation seeds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tps-group-size", type=int, default=8, help="tokens/s batch: n-groups prompts x this")
    ap.add_argument("--tps-reps", type=int, default=3, help="tokens/s: timed repetitions of each generator")
    ap.add_argument("--skip-trl", action="store_true", help="StarPO side only (quick checks; trl not needed)")
    ap.add_argument(
        "--no-keep-all",
        action="store_true",
        help="skip the secondary StarPO run without the uncertainty filter (--keep-ratio 1)",
    )
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary run directories (printed)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_trl.json"))
    ap.add_argument("--_trl-worker", dest="trl_worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_worker:
        return trl_worker(a.trl_worker)

    t_bench = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    settings = matched_settings(a.steps, a.n_groups, a.group_size, a.max_tokens, a.lr, a.val_size, a.seed)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    work = Path(tempfile.mkdtemp(prefix="vs_trl-"))
    try:
        # ---- the model both sides start from: the embedded tiny model after its format warm-up ----------------------
        cached = plumbing.tiny.build_tiny_model(
            "bandit", sb.tiny_warmup_examples([(ENV_KWARGS["low_name"], ENV_KWARGS["high_name"])])
        )
        export_dir = work / "tiny-bandit-export"
        shutil.copytree(cached, export_dir)
        info = json.loads((export_dir / "build_info.json").read_text())
        print(f"[vs_trl] exported {cached} -> {export_dir} ({info['params'] / 1e6:.2f}M parameters)", flush=True)

        print("[vs_trl] generation throughput: hf_generate vs model.generate", flush=True)
        tps = generation_throughput(str(export_dir), a.n_groups, a.tps_group_size, a.max_tokens, a.seed, a.tps_reps)

        result: dict = {}
        trl_version = None
        if not a.skip_trl:
            import trl  # noqa: F401  (fail early, before the StarPO run, if the bench venv lacks it)

            trl_version = trl.__version__
            trl_dir = work / "trl"
            trl_dir.mkdir()
            cfg_path = work / "trl_config.json"
            cfg_path.write_text(
                json.dumps(
                    dict(
                        model_dir=str(export_dir),
                        out_dir=str(trl_dir),
                        steps=a.steps,
                        n_groups=a.n_groups,
                        seed=a.seed,
                        grpo_config=settings["grpo_config"],
                    )
                )
            )
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_trl-worker", str(cfg_path)]
            print(f"[vs_trl] TRL {trl_version} GRPOTrainer: {a.steps} steps", flush=True)
            wall = run_logged(cmd, work / "trl.log", env)
            tr = json.loads((trl_dir / "trl_result.json").read_text())
            secs = step_seconds_from_stamps(tr["step_begin"], tr["step_end"])
            logs = [h for h in tr["log_history"] if "reward" in h]
            result["trl"] = dict(
                trl_version=trl_version,
                wall_s_total=round(wall, 1),
                trainer_init_s=round(tr["init_s"], 1),
                train_s=round(tr["train_s"], 1),
                steps=tr["global_step"],
                **summarise_steps(secs),
                trl_step_time_metric_median=round(statistics.median(h["step_time"] for h in logs), 3)
                if logs and "step_time" in logs[0]
                else None,
                train_reward_per_step=[round(h["reward"], 3) for h in logs],
                effective_batch=tr["effective"],
                final_dir=str(trl_dir / "final"),
            )

        print("[vs_trl] starpo_bandit.py (starpo-s, grpo)", flush=True)
        result["starpo"] = run_starpo("starpo", settings["starpo_argv"], export_dir, work, env)
        if not a.no_keep_all:
            print(
                "[vs_trl] starpo_bandit.py with --keep-ratio 1 (no uncertainty filter: trains all groups, like TRL)",
                flush=True,
            )
            result["starpo_keep_all"] = run_starpo(
                "starpo_keep_all", settings["starpo_argv"] + ["--keep-ratio", "1"], export_dir, work, env
            )

        # ---- the same evaluator for every final model (and the starting point) -------------------------------------
        evals = {"initial": evaluate_model(str(export_dir), str(export_dir), a.val_size, a.max_tokens, a.seed)}
        print(f"[vs_trl] eval initial: {evals['initial']}", flush=True)
        for name, side in result.items():
            evals[name] = evaluate_model(side["final_dir"], str(export_dir), a.val_size, a.max_tokens, a.seed)
            side["eval"] = evals[name]
            print(f"[vs_trl] eval {name}: {evals[name]}", flush=True)
        for side in result.values():
            side.pop("final_dir")

        starpo_med = result["starpo"]["median_s_per_step"]
        out = {
            "command": " ".join(["python bench/vs_trl.py", *(argv if argv is not None else sys.argv[1:])]),
            "python_executable": sys.executable,
            "model": {
                "what": "embedded tiny model (starpo_bandit's, after its format warm-up), exported",
                "params": info["params"],
                "cache_key": cached.name,
            },
            "settings": {
                "steps": a.steps,
                "n_groups": a.n_groups,
                "group_size": a.group_size,
                "completions_per_step": settings["completions_per_step"],
                "max_tokens": a.max_tokens,
                "lr": a.lr,
                "temperature": sb.SETTINGS["temperature"],
                "val_size": a.val_size,
                "val_temperature": sb.SETTINGS["val_temperature"],
                "seed": a.seed,
            },
            "trl_version": trl_version,
            "grpo_config": settings["grpo_config"] if not a.skip_trl else None,
            "starpo_argv": settings["starpo_argv"],
            "eval_initial": evals["initial"],
            **result,
            "generation_throughput": tps,
        }
        if "trl" in result:
            trl_med = result["trl"]["median_s_per_step"]
            out["starpo_over_trl_median_s_per_step"] = round(starpo_med / trl_med, 4)
            out["trl_over_starpo_speedup"] = round(trl_med / starpo_med, 2)
            out["eval_success_after_n_steps"] = {k: evals[k]["val/success"] for k in ("initial", *result)}
            out["target"] = "starpo median s/step <= 0.25 x TRL's, and eval high-arm rate >= TRL's after the same steps"
            out["target_met"] = {
                "speed": starpo_med <= 0.25 * trl_med,
                "learning": evals["starpo"]["val/success"] >= evals["trl"]["val/success"],
            }
        write_result(out, Path(a.out), t_bench, load_at_start, ("grpo_config", "starpo_argv"))
    finally:
        if a.keep_work:
            print(f"[vs_trl] work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
