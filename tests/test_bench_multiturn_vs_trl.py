"""bench/multiturn_vs_trl.py's matched settings: TRL's side trains on the script's maps, in the script's order, with
the script's batch geometry, sampling, clipping and learning rate; and the model.generate sampler it gives TRL's
rollout_func returns replies cut after their stop token, as hf_generate does. No trl needed."""

import sys

import torch

import plumbing.engine
import plumbing.flags
import plumbing.tiny
import starpo_frozenlake as fl
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import multiturn_vs_trl as mt  # noqa: E402


def test_trl_settings_are_the_scripts(tmp_path):
    a = mt.script_args("tiny", mt.starpo_flags(7, 32, 3), str(tmp_path / "run"))
    assert (a.steps, a.val_size, a.seed, a.slippery, a.estimator, a.kl_coef) == (7, 32, 3, False, "grpo", 0.0)
    cfg = mt.grpo_config(a)
    assert cfg["num_generations"] == a.group_size and cfg["per_device_train_batch_size"] == a.n_groups * a.group_size
    assert (cfg["steps_per_generation"], cfg["num_iterations"], cfg["gradient_accumulation_steps"]) == (1, 1, 1)
    assert (cfg["temperature"], cfg["top_p"], cfg["top_k"]) == (fl.SETTINGS["temperature"], a.top_p, 0)
    clip = fl.ALGOS[a.algo]["clip"]
    assert (cfg["learning_rate"], cfg["epsilon"], cfg["epsilon_high"], cfg["beta"]) == (a.lr, *clip, 0)
    assert (cfg["max_steps"], cfg["shuffle_dataset"], cfg["use_vllm"]) == (7, False, False)
    seeds = mt.train_seeds(a)
    assert len(seeds) == len(set(seeds)) == 7 * a.n_groups
    assert seeds[: a.n_groups] == [3 * 10**7 + g for g in range(a.n_groups)]  # the script's step-1 groups
    assert mt.starpo_flags(7, 32, 3, 1.0)[-2:] == ["--keep-ratio", "1.0"]


def test_model_generate_replies_end_at_their_stop_token(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = fl.resolve_args(plumbing.flags.parse_args(fl.Args, ["--model", "tiny", "--output-dir", str(tmp_path / "run")]))[
        0
    ]
    path = plumbing.tiny.build_tiny_model(fl.TASK, fl.tiny_warmup_examples(a), **fl.TINY_BUILD)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    text = tok.apply_chat_template(
        fl.first_messages(fl.make_env(a).reset(5), a), add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    replies = mt.model_generate(model, tok, a)([prompt, prompt[3:]], 1.0)
    stops = plumbing.engine.stop_token_ids(tok)
    for ids, logps in replies:
        assert 1 <= len(ids) == len(logps) <= a.max_tokens
        assert all(t not in stops for t in ids[:-1]) and all(lp <= 0 for lp in logps)
    assert any(ids[-1] in stops for ids, _ in replies)
