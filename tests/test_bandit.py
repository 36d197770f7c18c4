"""starpo_bandit.py: environment, parsing, rubric, log-prob consistency, flags, smoke and learning runs."""

import json
import statistics
import subprocess
import sys

import pytest
import torch

import common
import plumbing.engine
import plumbing.flags
import plumbing.run
import plumbing.tiny
import starpo_bandit as sb
from conftest import ROOT, run_script_file

# ---- environment ------------------------------------------------------------------------------------------------


def test_payout_statistics():
    env = sb.BanditEnv()
    high = []
    for seed in range(20000):
        env.reset(seed)
        high.append(env.step("Dragon")[1])
    assert set(high) == {0.0, 1.0}
    assert statistics.mean(high) == pytest.approx(0.25, abs=0.015)  # 4 sigma at n = 20000
    for seed in range(200):
        env.reset(seed)
        _, reward, done, info = env.step("Phoenix")
        assert reward == 0.1 and done and not info["success"] and info["action_is_valid"]  # RAGEN's lo_arm_score


def test_papers_payout_and_custom_arms():
    env = sb.BanditEnv(low_name="Teacher", high_name="Engineer", low_reward=0.15)
    obs = env.reset(3)
    assert "Teacher" in obs and "Engineer" in obs and "Phoenix" not in obs
    assert env.step("teacher")[1] == 0.15


@pytest.mark.parametrize("flags,payout", [([], 0.1), (["--low-arm-payout", "0.15"], 0.15)])
def test_low_arm_payout_flag_reaches_the_env(flags, payout, tmp_path):
    """RAGEN's code pays 0.1 on the low arm by default; the paper's 0.15 is one flag away, for training and eval."""
    args = plumbing.flags.parse_args(sb.Args, flags + ["--output-dir", str(tmp_path / "run")])
    args = sb.resolve_args(args)[0]
    for split in ("train", "val"):
        env = sb.BanditEnv(**sb.env_kwargs_of(args, split))
        env.reset(7)
        assert env.step("Phoenix")[1] == payout and env.step("Dragon")[1] in (0.0, 1.0)


def test_name_order_is_random_per_seed_and_deterministic():
    env = sb.BanditEnv()
    firsts = []
    for seed in range(4000):
        obs = env.reset(seed)
        firsts.append(obs.index("Dragon") < obs.index("Phoenix"))
        assert env.reset(seed) == obs  # same seed, same prompt
    assert statistics.mean(firsts) == pytest.approx(0.5, abs=0.04)


def test_same_seed_same_payout_draw():
    """A group shares its seed, hence its luck (documented in the module docstring)."""
    env = sb.BanditEnv()
    for seed in range(50):
        env.reset(seed)
        a = env.step("Dragon")[1]
        env.reset(seed)
        assert env.step("Dragon")[1] == a


@pytest.mark.parametrize(
    "action,valid,success",
    [
        ("Dragon", True, True),
        ("  dRaGoN \n", True, True),
        ("Phoenix", True, False),
        ("PHOENIX", True, False),
        ("", False, False),
        ("Dragon Phoenix", False, False),
        ("Drag", False, False),
        ("<answer>Dragon</answer>", False, False),
    ],
)
def test_step_validity(action, valid, success):
    env = sb.BanditEnv()
    env.reset(0)
    _, reward, done, info = env.step(action)
    assert info["action_is_valid"] is valid and info["success"] is success and done
    if not valid:
        assert reward == 0.0


# ---- parsing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,think,answer",
    [
        ("<think> hm </think> <answer> Dragon </answer>", "hm", "Dragon"),
        ("<think>line one\nline two</think>\n<answer>\nPhoenix\n</answer>", "line one\nline two", "Phoenix"),
        ("<answer>Dragon</answer>", None, "Dragon"),  # missing think: the answer still counts, the format does not
        ("<think>x</think>", "x", None),  # missing answer
        ("<think>x</think><answer>Dragon", "x", None),  # unclosed
        ("<think>x</think><answer>Dragon</answer><answer>Phoenix</answer>", "x", None),  # repeated
        ("<answer><answer>Dragon</answer></answer>", None, None),  # nested
        ("</answer>Dragon<answer>", None, None),  # reversed
        ("<ANSWER>Dragon</ANSWER>", None, None),  # tags are case-sensitive
        ("<think><think>a</think></think><answer>Dragon</answer>", None, "Dragon"),
        ("", None, None),
    ],
)
def test_parse_reply(text, think, answer):
    assert sb.parse_reply(text) == (think, answer)


def test_parse_reply_huge_and_binary_looking_text():
    junk = "".join(chr(c) for c in range(0, 0x2FF)) + "\ufffd\x00" * 1000
    huge = "<think>" + "a" * 2_000_000 + "</think><answer>Dragon</answer>"
    assert sb.parse_reply(junk) == (None, None)
    assert sb.parse_reply(huge)[1] == "Dragon"
    assert sb.format_reward(sb.Turn(huge, "a", "Dragon", 0.0, {"action_is_valid": True})) == 1.0
    assert sb.parse_reply("<answer>" + junk + "</answer>")[1] is not None


# ---- rubric -----------------------------------------------------------------------------------------------------


def run_rubric(text: str, seed: int = 0):
    env = sb.BanditEnv()
    env.reset(seed)
    think, answer = sb.parse_reply(text)
    _, reward, _, info = env.step(answer if answer is not None else "")
    return sb.score_turn(sb.Turn(text, think, answer, reward, info), sb.RUBRIC)


def weights():
    return {fn.__name__: w for fn, w in sb.RUBRIC}


@pytest.mark.parametrize(
    "text,fmt,invalid",
    [
        ("<think>risky pays more on average</think> <answer>Dragon</answer>", 1.0, 0.0),
        ("<think>\nsafe\n</think>\n<answer>Phoenix</answer>\n", 1.0, 0.0),  # multi-line thinking must match
        ("<answer>Dragon</answer>", 0.0, 0.0),  # valid answer, no thinking
        ("I pick Dragon", 0.0, -1.0),
        ("<think>x</think><answer>Unicorn</answer>", 1.0, -1.0),  # well formed but not an arm
        ("<think>x</think><answer>Dragon</answer> trailing words", 0.0, 0.0),
        ("<think>a<answer>Dragon</answer></think>", 0.0, 0.0),  # answer inside think: a valid arm, bad format
    ],
)
def test_rubric_components(text, fmt, invalid):
    total, parts = run_rubric(text)
    assert parts["format_reward"] == fmt
    assert parts["invalid_answer_penalty"] == invalid
    assert parts["high_arm_judged"] is None  # a judge component no judge was asked for: no score, left out
    assert total == pytest.approx(sum(weights()[k] * v for k, v in parts.items() if v is not None))


def test_rubric_env_reward_is_the_payout():
    for seed in range(100):
        env = sb.BanditEnv()
        env.reset(seed)
        payout = env.step("Dragon")[1]
        total, parts = run_rubric("<think>t</think><answer>Dragon</answer>", seed)
        assert parts["env_reward"] == payout
        assert total == pytest.approx(payout + weights()["format_reward"])


def test_weight_zero_logs_but_does_not_count(monkeypatch):
    monkeypatch.setattr(sb, "RUBRIC", [(sb.env_reward, 1.0), (sb.format_reward, 0.0), (sb.invalid_answer_penalty, 0.1)])
    total, parts = run_rubric("<think>t</think><answer>Phoenix</answer>")
    assert parts["format_reward"] == 1.0 and total == pytest.approx(0.1)


# ---- log-prob consistency: generation vs the update pass ---------------------------------------------------------


@pytest.fixture(scope="session")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = plumbing.tiny.build_tiny_model("bandit", sb.tiny_warmup_examples([("Phoenix", "Dragon")]))
    attn = plumbing.engine.attention_implementation("cpu")  # what the script loads on a CPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def test_tiny_model_is_a_loadable_qwen2_with_chat_format(tiny):
    model, tok = tiny
    assert model.config.model_type == "qwen2" and 1e6 < model.num_parameters() < 1e7
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    weird = "<answer>\x00\ufffd 龍 🐉</answer>"
    assert tok.decode(tok(weird, add_special_tokens=False)["input_ids"]) == weird  # byte-level: lossless


def test_generation_logprobs_match_update_pass(tiny):
    """hf backend, float32: the update pass re-scores the sampled tokens exactly as the sampler saw them,
    including left padding (prompts of different lengths in one batch) and the temperature."""
    model, tok = tiny
    torch.manual_seed(0)
    env = sb.BanditEnv()
    full = [
        tok(
            tok.apply_chat_template(sb.make_messages(env.reset(s)), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for s in range(4)
    ]
    prompts = [full[0], full[1][9:], full[2][3:], full[3], full[0]]  # ragged lengths force left padding
    replies = plumbing.engine.hf_generate(model, tok, prompts, 0.7, 1.0, 24, batch_size=64)
    trajs = [sb.Trajectory(0, p, r, lp, None, 0.0, {}) for p, (r, lp) in zip(prompts, replies)]
    batch = sb.collate(trajs, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logp, _ = sb.policy_forward(model, sb.micro_view(batch, torch.arange(len(trajs))), 0.7)
    mask = batch["reply_mask"].bool()
    gen_lp = torch.zeros_like(logp)
    for i, t in enumerate(trajs):
        gen_lp[i, : len(t.gen_logprobs)] = torch.tensor(t.gen_logprobs)
    assert mask.sum() > 20 and len({len(p) for p in prompts}) >= 3
    torch.testing.assert_close(logp[mask], gen_lp[mask], atol=1e-4, rtol=0)
    # and the temperature matters: scoring at 1.0 would not match
    with torch.no_grad():
        logp_t1, _ = sb.policy_forward(model, sb.micro_view(batch, torch.arange(len(trajs))), 1.0)
    assert (logp_t1[mask] - gen_lp[mask]).abs().max() > 1e-2


def test_micro_view_trims_to_the_rows_it_holds(tiny):
    _, tok = tiny
    mk = lambda p, r: sb.Trajectory(0, p, r, [0.0] * len(r), None, 0.0, {})  # noqa: E731
    batch = sb.collate([mk([1, 2, 3, 4], [5]), mk([6], [7, 8, 9]), mk([1, 2, 3, 4], [10, 11])], tok.pad_token_id, "cpu")
    pad = tok.pad_token_id
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 4, 5, pad, pad],
        [pad] * 3 + [6, 7, 8, 9],
        [1, 2, 3, 4, 10, 11, pad],
    ]
    assert batch["position_ids"][1, 3:].tolist() == [0, 1, 2, 3]
    assert batch["group"].tolist() == [0, 1, 0]
    view = sb.micro_view(batch, torch.tensor([1]))
    assert view["prompt_ids"].tolist() == [[6]] and view["reply_ids"].tolist() == [[7, 8, 9]]
    assert view["reply_in"].tolist() == [[7, 8]] and view["reply_pos"].tolist() == [[1, 2]]
    view = sb.micro_view(batch, torch.tensor([2, 0]))  # one distinct prompt, stored once
    assert view["prompt_ids"].tolist() == [[1, 2, 3, 4]] and view["row"].tolist() == [0, 0]
    assert view["reply_ids"].tolist() == [[10, 11], [5, pad]] and view["reply_mask"].tolist() == [[1, 1], [1, 0]]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_forward_equals_one_pass_per_row(tiny, checkpointing):
    """reply_outputs runs each distinct prompt once and the replies on its copied KV cache: log-probs, entropies,
    critic values and the gradients they send back must equal an unpadded full-sequence pass per row. Under
    --gradient-checkpointing (transformers drops a KV cache there) it runs the full rows in one pass: the same."""
    model, tok = tiny
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()  # checkpointing acts in training mode only (dropout is 0 in these models)
    try:
        shared_prompt_forward_equals_one_pass_per_row(model, tok, checkpointing)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


def shared_prompt_forward_equals_one_pass_per_row(model, tok, checkpointing):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, model.config.vocab_size, (n,), generator=gen).tolist() for n in (30, 17)]
    trajs = []
    for p in prompts:
        for r in (1, 6, 11):
            trajs.append(
                sb.Trajectory(
                    0, p, torch.randint(5, model.config.vocab_size, (r,), generator=gen).tolist(), [], None, 0.0, {}
                )
            )
    batch = sb.collate(trajs, tok.pad_token_id, "cpu")
    mb = sb.micro_view(batch, torch.tensor([4, 0, 2, 5, 1, 3]))  # shuffled, two groups, ragged prompts and replies
    assert mb["prompt_ids"].shape[0] == 2
    critic = sb.Critic(str(model.name_or_path), torch.float32, sb.Args(gradient_checkpointing=checkpointing))
    critic.train(checkpointing)
    assert model.is_gradient_checkpointing == critic.body.is_gradient_checkpointing == checkpointing
    torch.nn.init.normal_(critic.head.weight, std=0.1)  # a non-zero head, so values (and their gradients) say something
    model.zero_grad(), critic.zero_grad()
    logp, ent = sb.policy_forward(model, mb, 0.7)
    values = critic(mb)
    m = mb["reply_mask"]
    ((logp * m).sum() + (ent * m).sum() + (values * m).sum()).backward()
    shared = [q.grad.clone() for q in model.parameters()] + [q.grad.clone() for q in critic.parameters()]

    model.zero_grad(), critic.zero_grad()
    total = 0.0
    for b, i in enumerate(mb["idx"].tolist()):
        t = trajs[i]
        ids = torch.tensor([t.prompt_ids + t.reply_ids])
        span = slice(len(t.prompt_ids) - 1, len(ids[0]) - 1)  # the positions that predict the reply tokens
        logits = model(input_ids=ids).logits[0, span].float() / 0.7
        ref_logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.reply_ids)[:, None]).squeeze(-1)
        ref_ent = common.entropy_from_logits(logits)
        ref_val = critic.head(critic.body(input_ids=ids).last_hidden_state[0, span]).squeeze(-1)
        n = len(t.reply_ids)
        torch.testing.assert_close(logp[b, :n], ref_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[b, :n], ref_ent, atol=1e-5, rtol=0)
        torch.testing.assert_close(values[b, :n], ref_val, atol=1e-5, rtol=0)
        total = total + ref_logp.sum() + ref_ent.sum() + ref_val.sum()
    total.backward()
    one_by_one = [q.grad for q in model.parameters()] + [q.grad for q in critic.parameters()]
    for a, b in zip(shared, one_by_one):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    assert sum(float(g.abs().sum()) for g in shared) > 0
    model.zero_grad(set_to_none=True)


# ---- flags: bad input fails in one line, before any model loads --------------------------------------------------


def run_script(*flags, timeout=900, env_extra=None):
    return run_script_file("starpo_bandit.py", *flags, timeout=timeout, env_extra=env_extra)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--estimator", "grpo", "--group-size", "1"], "--group-size"),
        (["--keep-ratio", "0"], "--keep-ratio"),
        (["--keep-ratio", "1.5"], "--keep-ratio"),
        (["--backend", "tensorrt"], "--backend"),
        (["--backend", "vllm"], "--backend"),
        (["--model", "no-such-org/no-such-model"], "--model"),
        (["--lr", "-1"], "--lr"),
        (["--steps", "ten"], "--steps"),
        (["--high-arm-name", "phoenix"], "--high-arm-name"),
        (["--low-arm-payout", "-0.1"], "--low-arm-payout"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flags_fail_fast_with_one_line(flags, needle, tmp_path):
    out = tmp_path / "run"
    r = run_script(*flags, "--output-dir", str(out), timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error:"), r.stderr
    assert not out.exists()  # failed before doing anything
    if needle == "--model":
        assert "--model tiny" in lines[0]


@pytest.mark.parametrize("script", ["starpo_bandit.py", "starpo_frozenlake.py", "starpo_sokoban.py"])
def test_help_answers_before_torch_loads(script):
    """--help prints the flags from the Args dataclass and exits before torch, numpy or transformers are imported
    (torch alone takes seconds to load): `python -X importtime` lists every module a run imported."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / script), "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0 and "--group-size" in r.stdout and "--seed" in r.stdout, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "plumbing.flags" in imported and "argparse" in imported  # the log is what we think it is
    assert not imported & {"torch", "numpy", "transformers", "common"}, sorted(imported & {"torch", "numpy"})
    assert "(default: None)" not in r.stdout  # every flag says its default in words, or has a real one


def test_help_lists_kebab_case_flags_with_docs():
    r = run_script("--help", timeout=120)
    assert r.returncode == 0
    assert "--group-size" in r.stdout and "--keep-ratio" in r.stdout and "rollouts per group" in r.stdout


# ---- whole-script runs -------------------------------------------------------------------------------------------

EXPECTED_KEYS = {
    "train/success",
    "train/reward",
    "rollout/in_group_std",
    "rollout/chosen_in_group_std",
    "rollout/zero_std_frac",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
    "think_length/mean",
    "rubric/env_reward",
    "rubric/format_reward",
    "rubric/invalid_answer_penalty",
    "timing_s/gen",
    "timing_s/env",
    "timing_s/logprob",
    "timing_s/update",
    "timing_s/step",
    "actor/skipped_updates",
    "train/context_overflow",
    "rollout/truncated_frac",
}


def read_metrics(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


@pytest.mark.parametrize("algo,estimator", [("starpo-s", "gae"), ("starpo", "grpo")])
def test_smoke_two_steps(algo, estimator, tmp_path):
    r = run_script(
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--val-size",
        "8",
        "--n-groups",
        "2",
        "--group-size",
        "4",
        "--algo",
        algo,
        "--estimator",
        estimator,
        "--sample-every",
        "1",
        "--output-dir",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert EXPECTED_KEYS <= set(rows[1]), EXPECTED_KEYS - set(rows[1])
    assert {"val/success", "val/reward"} <= set(rows[0]) and {"val/success", "val/reward"} <= set(rows[2])
    if plumbing.run.peak_rss_gb() is not None:  # Linux: each phase's peak resident memory, and the process's
        phases = {k: v for k, v in rows[1].items() if k.startswith("memory_gb/") and k != "memory_gb/peak"}
        assert {"memory_gb/gen", "memory_gb/update", "memory_gb/eval"} <= set(phases), sorted(rows[1])
        assert 0.1 < max(phases.values()) <= rows[1]["memory_gb/peak"] < 100
        assert rows[0]["memory_gb/peak"] <= rows[1]["memory_gb/peak"] <= rows[2]["memory_gb/peak"]
    ckpt = plumbing.run.latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000002"
    state = plumbing.run.load_checkpoint_state(ckpt)
    if estimator == "gae":
        assert "critic/vf_loss" in rows[1] and "critic" in state
    else:
        assert "actor/kl_loss" in rows[1] and "critic" not in state  # starpo keeps the KL term
    assert rows[1]["rollout/filter_kept_count"] == (1 if algo == "starpo-s" else 2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["algo"] == algo and config["model_path"] and config["task"] == "bandit"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "policy")  # a plain save_pretrained folder
    assert (tmp_path / "report.html").exists() and (tmp_path / "rollouts.jsonl").exists()
    assert "sample (seed" in r.stdout + r.stderr  # the rollout printout with its rubric breakdown


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_precision_on_the_cpu(precision, tmp_path):
    """--precision bf16 on a CPU: a bf16 copy of the policy samples, refreshed after every update, and the update
    recomputes the old log-probs at its own precision and logs the gap (bf16-sized). A copy left stale would drift
    from the trainer at this learning rate (with the refresh removed, steps 2 and 3 measured mean gaps of 1.5 and 8.1). fp32
    reuses the sampler's own log-probs: no second pass, no gap to log."""
    flags = ("--steps", "3", "--eval-every", "0", "--val-size", "8", "--n-groups", "2", "--group-size", "4")
    r = run_script("--precision", precision, *flags, "--lr", "3e-3", "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"precision: {precision}" in r.stdout + r.stderr
    assert json.loads((tmp_path / "config.json").read_text())["precision"] == precision
    rows = read_metrics(tmp_path)[1:]
    if precision == "fp32":
        assert not any("rollout/logprob_diff_mean" in row for row in rows)
        return
    gaps = [(row["rollout/logprob_diff_mean"], row["rollout/logprob_diff_max"]) for row in rows]
    assert len(gaps) == 3 and all(0 < mean < 0.02 and worst < 0.5 for mean, worst in gaps), gaps


@pytest.mark.slow
def test_learns_the_bandit(tmp_path):
    """The README command, unchanged: StarPO-S with the tiny model must reach >= 0.9 eval high-arm rate."""
    # ~1 min on an idle machine; the timeout only guards against a hang (a loaded CPU has made it 10x slower)
    r = run_script("--output-dir", str(tmp_path), "--sample-every", "0", timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[0]["val/success"] < 0.75  # it starts indifferent: the warm-up did not teach the task
    assert rows[-1]["val/success"] >= 0.9, [row.get("val/success") for row in rows]


def test_zero_steps_evaluates_once_and_exits_cleanly(tmp_path):
    proc = run_script("--model", "tiny", "--steps", "0", "--val-size", "4", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert "none saved" in proc.stdout + proc.stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()] == [0]


def test_append_in_place_cache_matches_transformers_dynamic_cache(tiny):
    """hf_generate's cache (in-place appends into a doubling buffer) gives the same logits as DynamicCache, across a
    prefill, a batch_select_indices (group expansion) and many single-token steps that force the buffer to grow."""
    from transformers import DynamicCache

    model, _ = tiny
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (2, 7), generator=gen)
    steps = torch.randint(5, model.config.vocab_size, (3, 20), generator=gen)
    outs = []
    for cache in (DynamicCache(), plumbing.engine.append_in_place_cache()):
        with torch.no_grad():
            logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits]
            cache.batch_select_indices(torch.tensor([0, 1, 1]))
            for t in range(steps.shape[1]):  # 7 + 20 tokens: the 14-slot buffer doubles on the way
                logits.append(model(input_ids=steps[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        outs.append(logits)
        assert cache.get_seq_length() == 27
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bf16_decode_steps_match_transformers_sdpa(tiny):
    """A bf16 model on a CPU (--precision bf16's sampler) decodes with plumbing.engine.decode_attention instead of torch's flash
    kernel: the same logits as transformers' own sdpa attention, up to bf16 rounding, over a left-padded prefill
    and steps that grow the cache."""
    import copy

    model, _ = tiny
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (3, 9), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, :4] = 0  # row 1 is left-padded
    steps = torch.randint(5, model.config.vocab_size, (3, 12), generator=gen)
    outs = []
    for impl in (plumbing.engine.attention_implementation("cpu"), "sdpa"):
        m = copy.deepcopy(model).to(torch.bfloat16)
        m.set_attn_implementation(impl)
        cache, mask, logits = plumbing.engine.append_in_place_cache(), attn, []
        with torch.no_grad():
            for t in range(-1, steps.shape[1]):
                x = ids if t < 0 else steps[:, t : t + 1]
                mask = mask if t < 0 else torch.cat([mask, torch.ones_like(x)], 1)
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1] :]
                out = m(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
        outs.append(torch.stack(logits))
    assert outs[0].abs().max() > 1  # real logits, not zeros
    torch.testing.assert_close(outs[0], outs[1], atol=0.1, rtol=0.01)  # measured: at most 0.0625, one bf16 step at 8-16
