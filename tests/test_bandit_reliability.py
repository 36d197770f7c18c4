"""Reliability of starpo_bandit.py: determinism, checkpoints and resume, numerical guards, degenerate batches,
hostile model output, bad input, safety."""

import dataclasses
import json
import unittest.mock
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plumbing.dist
import plumbing.engine
import plumbing.run
import starpo_bandit as sb
from plumbing.report import read_jsonl
from conftest import ROOT

SMALL = [
    "--n-groups",
    "2",
    "--group-size",
    "4",
    "--val-size",
    "8",
    "--eval-every",
    "2",
    "--sample-every",
    "0",
    "--max-tokens",
    "24",
]
TIMING = plumbing.dist.MEASURED


def metrics(run_dir):
    return [
        {k: v for k, v in row.items() if not k.startswith(TIMING)}
        for row in read_jsonl(Path(run_dir) / "metrics.jsonl")
    ]


def script(*flags, **kw):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "starpo_bandit.py"), *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def run(*flags, timeout=600):
    p = script(*flags)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


# ---- determinism and resume --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 5-step run that the interrupted ones must reproduce exactly."""
    out = tmp_path_factory.mktemp("ref")
    rc, _, err = run(*SMALL, "--steps", "5", "--save-every", "2", "--output-dir", str(out))
    assert rc == 0, err[-2000:]
    return out


def test_same_seed_gives_identical_metrics(reference_run, tmp_path):
    rc, _, err = run(*SMALL, "--steps", "5", "--save-every", "2", "--output-dir", str(tmp_path))
    assert rc == 0, err[-2000:]
    assert metrics(tmp_path) == metrics(reference_run)
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]


def test_sigkill_after_a_checkpoint_then_resume_matches_uninterrupted(reference_run, tmp_path):
    p = script(*SMALL, "--steps", "5", "--save-every", "2", "--output-dir", str(tmp_path))
    marker = tmp_path / "checkpoints" / "step-000002" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert marker.exists()
    rc, out, err = run("--resume", "--output-dir", str(tmp_path))  # the saved config supplies every other flag
    assert rc == 0, err[-2000:]
    assert metrics(tmp_path) == metrics(reference_run)  # no duplicated, missing or different steps
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [r["step"] for r in rollouts] == sorted(r["step"] for r in rollouts)


# The same script with every rollout made 1 s slower (patched in-process, results unchanged): a signal sent when step 1
# has been logged always lands mid-run, on any machine, so the SIGINT test can never pass by finishing first.
SLOW = """import sys, time
import starpo_bandit as sb
real = sb.rollout
def slow(*a, **k):
    time.sleep(1.0)
    return real(*a, **k)
sb.rollout = slow
sb.main(sys.argv[1:])"""


def test_sigint_checkpoints_at_the_step_boundary_and_resumes(reference_run, tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", SLOW, *SMALL, "--steps", "5", "--save-every", "0", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_step = tmp_path / "metrics.jsonl"
    deadline = time.time() + 600
    while (not first_step.exists() or len(first_step.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 130, err[-2000:]  # stopped after the step in progress, never finished first
    assert "--resume" in out + err
    assert plumbing.run.latest_checkpoint(tmp_path) is not None
    rc, _, err = run("--resume", "--output-dir", str(tmp_path))
    assert rc == 0, err[-2000:]
    assert metrics(tmp_path) == metrics(reference_run)


def test_existing_run_needs_resume_or_overwrite(reference_run, tmp_path):
    rc, _, err = run(*SMALL, "--steps", "1", "--output-dir", str(reference_run))
    assert rc == 2 and err.strip().count("\n") == 0 and "--resume" in err and "--overwrite" in err
    empty = tmp_path / "empty"
    rc, _, err = run("--resume", "--output-dir", str(empty))
    assert rc == 2 and "--resume" in err
    rc, _, err = run(*SMALL, "--steps", "1", "--resume", "--overwrite", "--output-dir", str(reference_run))
    assert rc == 2 and "--overwrite" in err


def test_overwrite_replaces_the_old_run(tmp_path):
    for _ in range(2):
        rc, _, err = run(*SMALL, "--steps", "1", "--overwrite", "--output-dir", str(tmp_path))
        assert rc == 0, err[-2000:]
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1]


def test_torn_and_partial_checkpoints_are_skipped(reference_run, tmp_path, capsys):
    import shutil

    shutil.copytree(reference_run / "checkpoints", tmp_path / "checkpoints")
    good = plumbing.run.latest_checkpoint(tmp_path)
    torn = tmp_path / "checkpoints" / "step-000099"
    shutil.copytree(good, torn)
    (torn / "state.pt").write_bytes(b"not a checkpoint")  # torn write
    partial = tmp_path / "checkpoints" / "step-000098"
    shutil.copytree(good, partial)
    (partial / "COMPLETE").unlink()  # crashed before the end
    assert plumbing.run.latest_checkpoint(tmp_path) == good
    err = capsys.readouterr().err
    assert "step-000099" in err and "step-000098" in err


def test_only_the_newest_two_checkpoints_are_kept(reference_run):
    assert sorted(p.name for p in (reference_run / "checkpoints").iterdir()) == ["step-000004", "step-000005"]


def test_truncate_jsonl_drops_later_steps_and_torn_lines(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "x": ')
    plumbing.run.truncate_jsonl(f, 1)
    assert read_jsonl(f) == [{"step": 0}, {"step": 1}]


# ---- numerical guards and degenerate batches (in-process, with the loop's pieces patched) ------------------------


def in_process(tmp_path, *flags):
    sb.main([*SMALL, "--output-dir", str(tmp_path), *flags])
    return metrics(tmp_path)


def test_non_finite_loss_skips_updates_then_stops(tmp_path, monkeypatch, capsys):
    real = sb.policy_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(sb, "policy_loss", nan_loss)
    monkeypatch.setitem(sb.SETTINGS, "max_skipped", 2)
    with pytest.raises(SystemExit) as e:
        in_process(tmp_path, "--steps", "5", "--save-every", "1")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SETTINGS['max_skipped']" in err and "non-finite" in err
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["actor/skipped_updates"] >= 1 for r in rows[1:])
    # the skipped updates never touched the weights: the checkpoint still equals the initial model
    ckpt = plumbing.run.latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000001"
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(json.loads((tmp_path / "config.json").read_text())["model_path"])
    saved = AutoModelForCausalLM.from_pretrained(ckpt / "policy")
    assert all(torch.equal(a, b) for a, b in zip(init.state_dict().values(), saved.state_dict().values()))


def test_every_group_zero_std(tmp_path, monkeypatch):
    def constant(t):
        return 1.0

    monkeypatch.setattr(sb, "RUBRIC", [(constant, 1.0)])
    rows = in_process(tmp_path, "--steps", "2", "--algo", "starpo", "--estimator", "grpo")
    assert all(r["rollout/zero_std_frac"] == 1.0 and r["rollout/in_group_std"] == 0.0 for r in rows[1:])
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/skipped_updates"] == 0 for r in rows[1:])


def test_empty_replies(tmp_path, monkeypatch):
    real = plumbing.engine.hf_generate

    def some_empty(model, tok, prompts, *a, **k):
        out = real(model, tok, prompts, *a, **k)
        return [([], []) if i % 2 else r for i, r in enumerate(out)]

    monkeypatch.setattr(plumbing.engine, "hf_generate", some_empty)
    rows = in_process(tmp_path, "--steps", "2")
    assert all(math.isfinite(r["actor/pg_loss"]) and r["train/action_is_valid"] <= 0.5 for r in rows[1:])


def weights_after(tmp_path, *flags):
    with unittest.mock.patch.dict(sb.SETTINGS, weight_decay=0.0):  # AdamW's decay would move untrained weights
        in_process(
            tmp_path,
            "--steps",
            "1",
            "--entropy-coef",
            "0",
            "--max-tokens",
            "3",
            "--estimator",
            "grpo",
            "--keep-ratio",
            "1",
            *flags,
        )
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(json.loads((tmp_path / "config.json").read_text())["model_path"])
    saved = AutoModelForCausalLM.from_pretrained(plumbing.run.latest_checkpoint(tmp_path) / "policy")
    return [torch.equal(a, b) for a, b in zip(init.state_dict().values(), saved.state_dict().values())]


def test_mask_truncated_on_means_cut_replies_are_not_trained(tmp_path, monkeypatch):
    """--max-tokens 3 cuts every reply: with --mask-truncated nothing is trained (weights unchanged), without it
    the cut replies are trained like any other. (A length-based rubric gives the cut replies distinct rewards, so
    there is a signal to train on.)"""

    def reply_length(t):
        return float(len(t.text))

    monkeypatch.setattr(sb, "RUBRIC", [(reply_length, 1.0)])
    assert all(weights_after(tmp_path / "masked", "--mask-truncated"))
    rows = metrics(tmp_path / "masked")
    assert rows[1]["rollout/truncated_frac"] == 1.0
    assert not all(weights_after(tmp_path / "trained", "--no-mask-truncated"))


def test_context_overflow_ends_episodes_cleanly(tmp_path):
    rows = in_process(tmp_path, "--steps", "1", "--max-model-len", "40", "--max-tokens", "8")
    assert rows[1]["train/context_overflow"] == 8 and rows[1]["train/action_is_valid"] == 0
    assert math.isfinite(rows[1]["train/reward"])


# ---- hostile model output ----------------------------------------------------------------------------------------

TAGS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "Dragon",
        "Phoenix",
        " || ",
        "\n",
        "\x00",
        "\ufffd",
        "<|im_end|>",
        "<answer><answer>",
        "dragon ",
        "🐉",
    ]
)
HOSTILE = st.one_of(
    st.text(max_size=400),
    st.lists(st.one_of(TAGS, st.text(max_size=8)), max_size=60).map("".join),
    st.binary(max_size=300).map(lambda b: b.decode("utf-8", errors="replace")),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=HOSTILE, seed=st.integers(0, 2**31 - 1))
def test_parser_and_rubric_take_any_text(text, seed):
    think, answer = sb.parse_reply(text)
    assert think is None or isinstance(think, str)
    env = sb.BanditEnv()
    env.reset(seed)
    _, reward, done, info = env.step(answer if answer is not None else "")
    assert done and reward in (0.0, 0.1, 1.0)
    assert info["action_is_valid"] == (answer is not None and answer.strip().lower() in ("dragon", "phoenix"))
    total, parts = sb.score_turn(sb.Turn(text, think, answer, reward, info), sb.RUBRIC)
    assert math.isfinite(total)
    assert 0.0 <= parts["env_reward"] <= 1.0 and parts["format_reward"] in (0.0, 1.0)
    assert parts["invalid_answer_penalty"] in (-1.0, 0.0)


@settings(max_examples=50, deadline=None)
@given(text=HOSTILE)
def test_huge_hostile_text_is_fine(text):
    t0 = time.perf_counter()
    _, answer = sb.parse_reply(text * 2000 + "<answer>Dragon</answer>")  # must return, not raise
    assert time.perf_counter() - t0 < 5.0  # plain string search is linear; a backtracking regex would take minutes
    assert answer in (None, "Dragon") or "<answer>" in text


# ---- bad input: the README's table is the specification -----------------------------------------------------------


def readme_bad_flags():
    rows = []
    section = (ROOT / "README.md").read_text().split("### Bad flags", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = re.match(r"\|\s*`python starpo_bandit.py ([^`]*)`\s*\|\s*`([^`]*)`\s*\|", line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def test_readme_lists_bad_flags():
    assert len(readme_bad_flags()) >= 8


@pytest.mark.parametrize("flags,message", readme_bad_flags())
def test_readme_bad_flag_table(flags, message, tmp_path):
    rc, _, err = run(*flags.split(), "--output-dir", str(tmp_path / "x"), timeout=120)
    assert rc == 2 and err.strip() == message.strip(), err
    assert not (tmp_path / "x").exists()


# ---- safety ------------------------------------------------------------------------------------------------------


def test_no_eval_or_exec_and_no_remote_code():
    """Model text is never run, and neither is a model's own Python code: no flag turns trust_remote_code on."""
    for path in [ROOT / "common.py", *ROOT.glob("starpo_*.py"), *ROOT.glob("plumbing/*.py")]:
        src = path.read_text()
        assert not re.search(r"(?<![.\w])(eval|exec)\s*\(", src), f"{path.name} calls eval/exec"
        assert set(re.findall(r"trust_remote_code=(\w+)", src)) <= {"False"}, path.name
    assert not any(f.name == "trust_remote_code" for f in dataclasses.fields(sb.Args))
