"""Benchmark: starpo_frozenlake.py against TRL's multi-turn GRPO (GRPOTrainer with a rollout_func) on one model.

Both sides start from the same copy of the shipped tiny FrozenLake model and train on the same non-slippery maps
(the script's training seeds, step by step, in order), with the same groups x group size, reply cap, turns and moves,
sampling (temperature 1.0, top-p 0.95), learning rate, no KL, clip 0.2 / 0.28 and number of steps. TRL's side is
what its documentation shows for multi-turn agents: a `rollout_func` that plays the episodes and returns prompt
ids, completion ids (every reply with the observations between them), their log-probs and an `env_mask` (1 on the
model's tokens, 0 on the environment's), generating each turn with transformers' `model.generate`, as TRL does
without vLLM. The episodes themselves are played by starpo_frozenlake.rollout (the same environment, parser and
rubric), so only the generation and the trainer differ. Both final models are then scored by the script's own
256-map evaluation (temperature 0.5) in this process.

    /tmp/bench-venv/bin/python bench/multiturn_vs_trl.py           # ~15 min on 2 cores (needs requirements-bench.txt)
    python bench/multiturn_vs_trl.py --skip-trl --steps 2 --val-size 16   # the StarPO side only (no trl needed)

Writes bench/results/multiturn_vs_trl.json: median s/step for each side, their ratio, the generation / update split,
val/success after the same number of steps. Target (#16): StarPO's median s/step <= 0.25 x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import plumbing.engine  # noqa: E402
import plumbing.flags  # noqa: E402
import plumbing.tiny  # noqa: E402
import starpo_frozenlake as fl  # noqa: E402
import vs_trl  # noqa: E402  (the bandit benchmark: its step-time and subprocess helpers)

GEN_BATCH = 256  # prompts per generate call, both sides (the CPU engine's default)


def starpo_flags(steps: int, val_size: int, seed: int, keep_ratio: float | None = None) -> list[str]:
    """starpo_frozenlake.py's flags (model and output directory added by the caller): the tiny preset, GRPO."""
    flags = ["--preset", "tiny", "--algo", "starpo-s", "--estimator", "grpo", "--no-slippery", "--backend", "hf"]
    flags += ["--device", "cpu", "--precision", "fp32"]  # TRL trains in float32 here (bf16=False): like for like
    flags += ["--steps", str(steps), "--eval-every", str(steps), "--val-size", str(val_size)]
    flags += ["--seed", str(seed), "--sample-every", "0", "--kl-coef", "0"]
    return flags + (["--keep-ratio", str(keep_ratio)] if keep_ratio is not None else [])


def script_args(model_dir: str, flags: list[str], scratch: str) -> fl.Args:
    """The script's own resolved arguments for these flags: what both sides play with."""
    argv = ["--model", model_dir, *flags, "--output-dir", scratch]
    return fl.resolve_args(plumbing.flags.parse_args(fl.Args, argv, presets=fl.PRESETS, algos=fl.ALGOS))[0]


def grpo_config(a: fl.Args) -> dict:
    """trl.GRPOConfig keyword arguments matched to the script's (output_dir added by the caller)."""
    completions = a.n_groups * a.group_size
    return dict(
        num_generations=a.group_size,
        per_device_train_batch_size=completions,  # one optimizer step = n_groups maps x group_size episodes
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=a.steps,
        shuffle_dataset=False,
        max_completion_length=a.max_model_len,  # a completion is the whole episode after the first prompt
        temperature=fl.SETTINGS["temperature"],
        top_p=a.top_p,
        top_k=0,
        use_vllm=False,
        beta=0.0,
        epsilon=fl.ALGOS[a.algo]["clip"][0],
        epsilon_high=fl.ALGOS[a.algo]["clip"][1],
        delta=fl.ALGOS[a.algo]["dual_clip"] or None,
        loss_type="grpo",  # per-episode token mean, then the batch mean: the script's seq-mean-token-mean
        scale_rewards="group",
        entropy_coef=a.entropy_coef,
        mask_truncated_completions=False,
        **vs_trl.trl_plain_cpu(a.lr, fl.SETTINGS["weight_decay"], 1.0, a.seed),  # the scripts clip gradients at 1.0,
    )


def train_seeds(a: fl.Args) -> list[int]:
    """The maps the script trains on, in order (its main loop: seed * 10**7 + (step - 1) * n_groups + g)."""
    return [a.seed * 10**7 + (s - 1) * a.n_groups + g for s in range(1, a.steps + 1) for g in range(a.n_groups)]


def model_generate(model, tok, a: fl.Args):
    """A generate(prompts, temperature, turn_cache) for rollout() on transformers' model.generate: what a TRL user's
    rollout_func runs without vLLM. Left-padded batch, sampled replies cut after the first stop token, log-probs of
    the processed (tempered, top-p) distribution."""
    import torch

    stops = plumbing.engine.stop_token_ids(tok)

    @torch.no_grad()
    def generate(prompts, temperature, turn_cache=None, seeds=None):
        out = []
        for i in range(0, len(prompts), GEN_BATCH):
            chunk = prompts[i : i + GEN_BATCH]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, p in enumerate(chunk):
                ids[j, width - len(p) :], attn[j, width - len(p) :] = torch.tensor(p), 1
            res = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=temperature,
                top_p=a.top_p,
                top_k=0,
                max_new_tokens=a.max_tokens,
                eos_token_id=stops,
                pad_token_id=tok.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            logps = model.compute_transition_scores(res.sequences, res.scores, normalize_logits=True)
            for row, lp in zip(res.sequences[:, width:].tolist(), logps.tolist()):
                out.append(plumbing.engine.cut_at_stop(row, lp, stops))
        return out

    return generate


def trl_worker(config_path: str) -> None:
    """The TRL side, in its own process: GRPOTrainer + rollout_func, timed per step and per rollout."""
    import datasets
    import torch
    import transformers
    import trl

    cfg = json.loads(Path(config_path).read_text())
    out_dir = Path(cfg["out_dir"])
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    a = script_args(cfg["model_dir"], cfg["flags"], str(out_dir / "unused-run"))
    rubric = plumbing.flags.weighted_rubric(fl.RUBRIC, a.preset, a.rubric_weights)[0]
    rows, seed_of = [], {}
    for s in train_seeds(a):
        prompt = fl.first_messages(fl.make_env(a).reset(s), a)
        rows.append({"prompt": prompt, "seed": s})
        seed_of[json.dumps(prompt)] = s  # rollout_func sees prompts only: the map's seed from its first prompt
    gen_s: list[float] = []

    def rollout_func(prompts, trainer) -> dict:
        t0 = time.time()
        model, tok = trainer.model, trainer.processing_class
        was_training = model.training
        model.eval()
        seeds = [seed_of[json.dumps(p)] for p in prompts]
        trajs = fl.rollout(model_generate(model, tok, a), tok, seeds, a, fl.SETTINGS["temperature"], rubric)
        model.train(was_training)
        gen_s.append(time.time() - t0)
        return {
            "prompt_ids": [t.ids[: t.first_len] for t in trajs],
            "completion_ids": [t.ids[t.first_len :] for t in trajs],
            "logprobs": [t.gen_logprobs[t.first_len :] for t in trajs],
            "env_mask": [t.mask[t.first_len :] for t in trajs],  # 1 = the model's tokens, 0 = the environment's
            "score": [t.score for t in trajs],
            "success": [float(t.success) for t in trajs],
        }

    def episode_score(completions, score, **kwargs) -> list[float]:
        return list(score)  # the script's rubric total for the episode, computed as it was played

    torch.manual_seed(a.seed)
    config = trl.GRPOConfig(output_dir=str(out_dir / "trainer"), **cfg["grpo_config"])
    timer = vs_trl.step_timer()
    trainer = trl.GRPOTrainer(
        model=cfg["model_dir"],
        reward_funcs=episode_score,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        rollout_func=rollout_func,
        callbacks=[timer],
    )
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    trainer.save_model(str(out_dir / "final"))
    result = dict(
        trl_version=trl.__version__,
        step_begin=timer.begins,
        step_end=timer.ends,
        rollout_s=gen_s,
        train_s=train_s,
        global_step=trainer.state.global_step,
        log_history=trainer.state.log_history,
    )
    (out_dir / "trl_result.json").write_text(json.dumps(result, indent=1))


def evaluate_model(model_dir: str, tok_dir: str, a: fl.Args) -> dict:
    """The script's 256-map evaluation (its val seeds, temperature 0.5) with hf_generate; same RNG seed each time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    attn = plumbing.engine.attention_implementation("cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        return plumbing.engine.hf_generate(
            model, tok, prompts, temperature, a.top_p, a.max_tokens, turn_cache, GEN_BATCH
        )

    torch.manual_seed(a.seed)
    val, _ = fl.evaluate(generate, tok, a, plumbing.flags.weighted_rubric(fl.RUBRIC, a.preset, a.rubric_weights)[0])
    return {k: round(float(v), 4) for k, v in val.items() if k in ("val/success", "val/reward", "val/num_turns")}


def run_starpo(name: str, model_dir: Path, flags: list[str], work: Path, env: dict) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "starpo_frozenlake.py", "--model", str(model_dir), *flags, "--output-dir", str(run_dir)]
    print(f"[multiturn_vs_trl] {name}: {' '.join(cmd[1:])}", flush=True)
    wall = vs_trl.run_logged(cmd, work / f"{name}.log", env)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if r.get("step", 0) >= 1]
    return dict(
        command="python starpo_frozenlake.py --model <copy of the shipped tiny model> " + " ".join(flags),
        wall_s_total=round(wall, 1),
        **vs_trl.summarise_steps(vs_trl.median_step_seconds_starpo(rows)),
        median_gen_s=round(statistics.median(r["timing_s/gen"] for r in train), 3),
        median_update_s=round(statistics.median(r["timing_s/update"] + r["timing_s/logprob"] for r in train), 3),
        train_success_per_step=[round(r["train/success"], 3) for r in train],
        final_dir=str(vs_trl.newest_model_dir(run_dir)),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps for each side")
    ap.add_argument("--val-size", type=int, default=256, help="evaluation maps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-trl", action="store_true", help="StarPO side only (quick checks; trl not needed)")
    ap.add_argument("--no-keep-all", action="store_true", help="skip the StarPO run with --keep-ratio 1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multiturn_vs_trl.json"))
    ap.add_argument("--_trl-worker", dest="trl_worker", default=None, help=argparse.SUPPRESS)
    o = ap.parse_args(argv)
    if o.trl_worker:
        return trl_worker(o.trl_worker)
    t_bench, load_at_start = time.time(), [round(x, 2) for x in os.getloadavg()]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    work = Path(tempfile.mkdtemp(prefix="multiturn_vs_trl-"))
    try:
        flags = starpo_flags(o.steps, o.val_size, o.seed)
        a = script_args("tiny", flags, str(work / "unused-run"))
        shipped = plumbing.tiny.build_tiny_model(fl.TASK, fl.tiny_warmup_examples(a), **fl.TINY_BUILD)
        model_dir = work / "model"
        shutil.copytree(shipped, model_dir)
        a = script_args(str(model_dir), flags, str(work / "unused-run"))
        result: dict = {}
        if not o.skip_trl:
            import trl

            (work / "trl").mkdir()
            cfg = dict(model_dir=str(model_dir), out_dir=str(work / "trl"), flags=flags, grpo_config=grpo_config(a))
            (work / "trl_config.json").write_text(json.dumps(cfg))
            print(f"[multiturn_vs_trl] TRL {trl.__version__} GRPOTrainer + rollout_func: {o.steps} steps", flush=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_trl-worker", str(work / "trl_config.json")]
            wall = vs_trl.run_logged(cmd, work / "trl.log", env)
            tr = json.loads((work / "trl" / "trl_result.json").read_text())
            secs = vs_trl.step_seconds_from_stamps(tr["step_begin"], tr["step_end"])
            rollout = statistics.median(tr["rollout_s"])
            result["trl"] = dict(
                trl_version=tr["trl_version"],
                wall_s_total=round(wall, 1),
                steps=tr["global_step"],
                **vs_trl.summarise_steps(secs),
                median_gen_s=round(rollout, 3),  # the rollout_func: model.generate turn by turn + the environment
                median_update_s=round(statistics.median(secs) - rollout, 3),
                train_reward_per_step=[round(h["reward"], 3) for h in tr["log_history"] if "reward" in h],
                final_dir=str(work / "trl" / "final"),
            )
        result["starpo"] = run_starpo("starpo", model_dir, flags, work, env)
        if not o.no_keep_all:
            result["starpo_keep_all"] = run_starpo(
                "starpo_keep_all", model_dir, starpo_flags(o.steps, o.val_size, o.seed, 1.0), work, env
            )
        evals = {"initial": evaluate_model(str(model_dir), str(model_dir), a)}
        for name, side in result.items():
            side["eval"] = evals[name] = evaluate_model(side.pop("final_dir"), str(model_dir), a)
            print(f"[multiturn_vs_trl] eval {name}: {evals[name]}", flush=True)
        out = {
            "command": " ".join(["python bench/multiturn_vs_trl.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": {"what": "the shipped tiny FrozenLake model (world-model warm-up), copied", "dir": shipped.name},
            "settings": {
                k: getattr(a, k)
                for k in ("steps", "n_groups", "group_size", "max_tokens", "max_turns", "max_actions_per_turn")
                + ("top_p", "lr", "val_size", "seed", "slippery")
            }
            | {k: fl.SETTINGS[k] for k in ("temperature", "val_temperature")},
            "starpo_flags": flags,
            "grpo_config": grpo_config(a) if not o.skip_trl else None,
            "eval_initial": evals["initial"],
            **result,
        }
        if "trl" in result:
            ratio = result["starpo"]["median_s_per_step"] / result["trl"]["median_s_per_step"]
            out["starpo_over_trl_median_s_per_step"] = round(ratio, 4)
            out["target"] = "starpo median s/step <= 0.25 x TRL's on matched settings"
            out["target_met"] = ratio <= 0.25
        vs_trl.write_result(out, Path(o.out), t_bench, load_at_start, ("grpo_config", "starpo_flags"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
