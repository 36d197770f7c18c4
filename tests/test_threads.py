"""The same numbers whatever the threads (#37): MKL's strict mode (plumbing/__init__.py) makes the matrix products'
bits independent of the thread count, so 3 steps on 1 thread and on 2 give the same metrics and rollouts; the count
is recorded in config.json, a resumed run starts on it, and between steps the count follows the load."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plumbing.cpu
import plumbing.dist
from conftest import ROOT
from plumbing.report import read_jsonl

TIMING = plumbing.dist.MEASURED


def run(script, threads, out, *flags):
    env = dict(os.environ, STARPO_THREADS=str(threads), HF_HUB_OFFLINE="1")
    env.pop("MKL_CBWR", None)  # the scripts' own setting, as a user gets it
    r = subprocess.run([sys.executable, str(ROOT / script), *flags, "--output-dir", str(out)], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"threads: {threads} (STARPO_THREADS)" in r.stdout
    return [
        {k: v for k, v in row.items() if not k.startswith(TIMING)} for row in read_jsonl(Path(out) / "metrics.jsonl")
    ]


@pytest.mark.parametrize(
    "script,flags",
    [
        ("starpo_bandit.py", ["--steps", "3", "--eval-every", "0", "--val-size", "16"]),
        ("starpo_frozenlake.py", ["--steps", "3", "--eval-every", "0", "--val-size", "8", "--n-groups", "4"]),
    ],
)
def test_three_steps_on_one_and_on_two_threads_give_the_same_numbers(script, flags, tmp_path):
    one = run(script, 1, tmp_path / "one", *flags)
    two = run(script, 2, tmp_path / "two", *flags)
    assert [r["step"] for r in one] == [0, 1, 2, 3]
    assert one == two  # every metric, value for value: the update's too (actor/grad_norm, losses)
    rollouts = lambda d: [{k: v for k, v in r.items() if k != "timestamp"} for r in read_jsonl(d / "rollouts.jsonl")]
    assert rollouts(tmp_path / "one") == rollouts(tmp_path / "two")
    assert json.loads((tmp_path / "one" / "config.json").read_text())["threads"] == 1


def test_without_strict_mode_the_weight_gradients_depend_on_the_thread_count():
    """Why MKL_CBWR is set: the same product on 1 and 2 threads, in a fresh process with and without it."""
    code = """import torch
a, b = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0)), torch.randn(4096, 768)
torch.set_num_threads(1); one = a @ b
torch.set_num_threads(2); two = a @ b
print(torch.equal(one, two))"""
    same = {}
    for mode in ("", "AUTO,STRICT"):
        env = dict(os.environ, MKL_CBWR=mode)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        same[mode] = out.stdout.strip()
    if not torch.backends.mkl.is_available():
        pytest.skip("torch's BLAS here is not MKL")
    assert same["AUTO,STRICT"] == "True", same
    if same[""] == "True":  # a CPU where MKL's default path does not split this product's inner dimension
        pytest.skip(
            f"MKL here ({platform.processor() or 'this CPU'}) gives the same product on 1 and 2 threads "
            "without strict mode too (seen on AMD EPYC; the Xeons differ)"
        )
    assert same[""] == "False", same


def test_a_resumed_run_starts_on_the_count_its_run_started_with(monkeypatch):
    monkeypatch.setattr(plumbing.cpu, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        assert plumbing.cpu.thread_policy({}, lambda: 0.0, started_with=1) == "1 of 4 cores (as the run started)"
        assert torch.get_num_threads() == 1
        assert plumbing.cpu.thread_policy({"STARPO_THREADS": "3"}, lambda: 0.0, started_with=1) == "3 (STARPO_THREADS)"
    finally:
        torch.set_num_threads(before)


def test_the_count_follows_the_load_after_two_steps_that_ask_for_it(monkeypatch):
    """/proc/stat's busy seconds, this process's CPU seconds, wall seconds: samples at each step end."""
    before = torch.get_num_threads()
    samples = iter([
        (0.0, 0.0, 0.0),
        (2.0, 2.0, 1.0),  # step 1: only this process was busy -> 2 threads, already so
        (4.0, 3.0, 2.0),  # step 2: another process kept a core busy -> 1 wanted, not yet set
        (6.0, 4.0, 3.0),  # step 3: again -> 1
        (8.0, 6.0, 4.0),  # step 4: alone again -> 2 wanted
        (10.0, 8.0, 5.0),  # step 5: again -> 2
    ])  # fmt: skip
    monkeypatch.setattr(plumbing.cpu.LoadFollower, "sample", staticmethod(lambda: next(samples)))
    try:
        torch.set_num_threads(2)
        follow = plumbing.cpu.LoadFollower(cores=2)
        changes = [follow.step_end() for _ in range(5)]
        assert changes == [False, False, True, False, True] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_follower_runs_only_where_the_numbers_do_not_depend_on_the_count(monkeypatch, tmp_path):
    monkeypatch.delenv("STARPO_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
        plumbing.cpu.setup("cpu", "fp32")
        assert (plumbing.cpu.follower is not None) == torch.backends.mkl.is_available()
        monkeypatch.setenv("MKL_CBWR", "AUTO")  # a user's own, not strict: the count stays as chosen
        plumbing.cpu.setup("cpu", "fp32")
        assert plumbing.cpu.follower is None
        monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
        monkeypatch.setenv("STARPO_THREADS", "1")  # fixed by you: never changed
        plumbing.cpu.setup("cpu", "fp32")
        assert plumbing.cpu.follower is None
    finally:
        plumbing.cpu.follower = None
        torch.set_num_threads(before)
