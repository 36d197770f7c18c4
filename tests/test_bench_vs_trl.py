"""bench/vs_trl.py's pure helpers: the TRL reward wrapper is starpo_bandit's rubric, and the two sides' settings match.

Fast, no model, no network. trl is a benchmark-only dependency: only the GRPOConfig checks need it (importorskip).
"""

import sys

import pytest

import plumbing.flags
import starpo_bandit as sb
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import vs_trl  # noqa: E402

THINK = "<think> Dragon sounds risky but big. </think>"
COMPLETIONS = [
    f"{THINK} <answer> Dragon </answer>",  # valid, formatted, high arm
    f"{THINK} <answer> Phoenix </answer>",  # valid, formatted, low arm
    "<answer> dragon </answer>",  # valid (case-insensitive), not formatted
    f"{THINK} <answer> Unicorn </answer>",  # formatted, invalid arm
    "I pick Dragon",  # no answer tag
    f"{THINK} <answer> Dragon </answer> <answer> Phoenix </answer>",  # repeated answer tag: no answer
    "<think>\nmulti\nline\n</think>\n<answer>Phoenix</answer>\n",  # DOTALL format, valid
    "",
]


def _seeds_by_dragon_payout():
    """A seed where Dragon pays and one where it does not (the draw is a pure function of the seed)."""
    env, paid, unpaid = sb.BanditEnv(), None, None
    for s in range(100):
        env.reset(s)
        if env.step("Dragon")[1] == 1.0:
            paid = s if paid is None else paid
        else:
            unpaid = s if unpaid is None else unpaid
    return paid, unpaid


class CharTokenizer:
    """Just enough tokenizer for starpo_bandit.rollout: one id per character, id 0 is the stop token."""

    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _rollout_scores(texts, seeds):
    """starpo_bandit's own rollout path (prompt, generate, decode, parse, step, score) with a scripted generator."""
    replies = iter(texts)

    def generate(prompts, temperature, seeds=None):
        out = []
        for _ in prompts:
            ids = [ord(c) for c in next(replies)] + [0]
            out.append((ids, [0.0] * len(ids)))
        return out

    trajs = sb.rollout(generate, CharTokenizer(), seeds, vs_trl.ENV_KWARGS, 1.0, 10**9, sb.RUBRIC)
    return [t.score for t in trajs]


def test_reward_wrapper_is_the_rubric_total_exactly():
    paid, unpaid = _seeds_by_dragon_payout()
    for s in (paid, unpaid, 12345, 10**7 + 3):
        seeds = [s] * len(COMPLETIONS)
        conversational = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
        got = vs_trl.bandit_reward(completions=conversational, seed=seeds, prompts=None, trainer_state=None)
        assert got == _rollout_scores(COMPLETIONS, seeds)  # bit-for-bit the training script's reward
        assert vs_trl.bandit_reward(COMPLETIONS, seeds) == got  # plain-text completions too


def test_reward_wrapper_hand_computed_values():
    paid, unpaid = _seeds_by_dragon_payout()
    # One completion a call, so each is member 0 of its group and draws the seed's first payout.
    r = [vs_trl.bandit_reward([[{"role": "assistant", "content": c}]], [paid])[0] for c in COMPLETIONS[:5]]
    # env + 0.1 * format + 0.1 * (-1 if invalid)
    assert r == pytest.approx([1.0 + 0.1, 0.1 + 0.1, 1.0, 0.1 - 0.1, -0.1])
    r = [
        vs_trl.bandit_reward([c], [unpaid])[0]
        for c in (f"{THINK} <answer> Dragon </answer>", "<answer> Phoenix </answer>")
    ]
    assert r == pytest.approx([0.0 + 0.1, 0.1])


def test_reward_wrapper_numbers_a_groups_copies_as_members():
    """TRL passes a group's copies side by side: the i-th copy of a seed draws member i's payout, as rollout does."""
    seed, n = 12345, 16
    got = vs_trl.bandit_reward([f"{THINK} <answer> Dragon </answer>"] * n, [seed] * n)
    draws = []
    for member in range(n):
        env = sb.BanditEnv(**vs_trl.ENV_KWARGS)
        env.reset(seed, member)
        draws.append(env.step("Dragon")[1])
    assert got == pytest.approx([d + 0.1 for d in draws])
    assert len(set(draws)) == 2  # the members' draws differ: not one shared draw


def test_dataset_rows_are_the_training_seeds_in_order():
    steps, G, seed = 3, 8, 2
    rows = vs_trl.trl_dataset_rows(steps, G, seed)
    assert len(rows) == steps * G
    env = sb.BanditEnv()
    for step in range(1, steps + 1):
        for g in range(G):
            row = rows[(step - 1) * G + g]
            assert row["seed"] == seed * 10**7 + (step - 1) * G + g  # starpo_bandit.main's group_seeds
            assert row["prompt"] == sb.make_messages(env.reset(row["seed"]))
    assert len({r["seed"] for r in rows}) == len(rows)


def test_matched_settings_agree():
    s = vs_trl.matched_settings(steps=7, n_groups=8, group_size=4, max_tokens=64, lr=1e-4, val_size=32, seed=3)
    a = plumbing.flags.parse_args(sb.Args, s["starpo_argv"] + ["--model", "unused"])
    g = s["grpo_config"]
    assert s["completions_per_step"] == a.n_groups * a.group_size == 32
    assert g["per_device_train_batch_size"] * g["gradient_accumulation_steps"] == a.n_groups * a.group_size
    assert g["steps_per_generation"] == 1 and g["num_iterations"] == 1 == a.ppo_epochs
    assert g["num_generations"] == a.group_size == 4
    assert g["max_completion_length"] == a.max_tokens == 64
    assert g["learning_rate"] == a.lr == 1e-4
    assert g["temperature"] == sb.SETTINGS["temperature"] == 1.0 and g["top_p"] == a.top_p == 1.0 and g["top_k"] == 0
    assert g["beta"] == a.kl_coef == 0.0
    assert (g["epsilon"], g["epsilon_high"], g["delta"]) == (*sb.ALGOS[a.algo]["clip"], sb.ALGOS[a.algo]["dual_clip"])
    assert g["max_steps"] == a.steps == 7 and a.eval_every == 7 and a.val_size == 32 and g["seed"] == a.seed == 3
    assert a.algo == "starpo-s" and a.estimator == "grpo" and a.norm_adv_by_std and g["scale_rewards"] == "group"
    assert a.loss_agg == "token-mean" and g["loss_type"] == "dapo"
    assert a.mini_batch_size >= 32 and a.micro_batch_size >= 32  # one optimizer step per training step
    assert g["entropy_coef"] == a.entropy_coef and g["weight_decay"] == sb.SETTINGS["weight_decay"]
    assert g["max_grad_norm"] == 1.0 and g["lr_scheduler_type"] == "constant"
    assert g["use_vllm"] is False and g["shuffle_dataset"] is False and g["bf16"] is False


def test_matched_settings_build_a_grpo_config(tmp_path):
    trl = pytest.importorskip("trl")
    s = vs_trl.matched_settings(steps=5, n_groups=8, group_size=4, max_tokens=64, lr=1e-4)
    c = trl.GRPOConfig(output_dir=str(tmp_path), **s["grpo_config"])
    # one optimizer step = one generation batch = n_groups prompts x group_size completions
    assert c.generation_batch_size == c.per_device_train_batch_size * c.gradient_accumulation_steps == 32
    assert c.generation_batch_size // c.num_generations == 8 and c.steps_per_generation == 1
    assert c.beta == 0.0 and c.epsilon == 0.2 and c.epsilon_high == 0.28 and c.num_iterations == 1
    assert c.max_completion_length == 64 and c.learning_rate == 1e-4 and c.temperature == 1.0


def test_step_seconds_helpers():
    assert vs_trl.step_seconds_from_stamps([10.0, 12.5, 14.0], [12.0, 14.0, 15.5]) == [2.0, 2.0, 1.5]
    rows = [
        {"step": 0, "val/success": 0.5},
        {"step": 1, "timing_s/step": 1.5},
        {"step": 2, "timing_s/step": 4.0, "timing_s/eval": 2.5},
    ]
    assert vs_trl.median_step_seconds_starpo(rows) == [1.5, 1.5]
