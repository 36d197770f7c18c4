"""Several processes (plumbing/dist.py): torchrun with 2 CPU processes (gloo) gives the run of one process with
--request-seeds: the same episodes, filter, metrics and weights; a run resumes on another process count.

The bandit's tiny model, 3 groups over 2 processes: the blocks are uneven (1 and 2 groups) and the filter keeps one
group, so one process trains no row in the step and must still take part in the gradient sum without a hang.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--steps", "2", "--n-groups", "3", "--val-size", "8", "--eval-every", "1", "--mi-every", "0"]
# Means over micro-batches: their split follows the rows each process holds, so these differ (the gradient does not)
PER_MICRO_BATCH = ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/pg_clipfrac", "critic/vf_loss")


def run(out: Path, processes: int, *extra: str) -> list[dict]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    cmd = (launcher if processes > 1 else [sys.executable]) + ["starpo_bandit.py", *FLAGS, "--output-dir", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd + list(extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same(a: dict, b: dict) -> dict:
    """The keys whose values differ, timings and the per-micro-batch means left out."""
    skip = lambda k: (
        k.startswith(("timing_s/", "time_s", "timestamp")) or k in PER_MICRO_BATCH or k == "actor/grad_norm"
    )
    return {k: (a[k], b.get(k)) for k in a if not skip(k) and a[k] != b.get(k)}


def weights(out: Path, step: int) -> dict:
    return load_file(out / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    out = tmp_path_factory.mktemp("n1")
    return out, run(out, 1, "--request-seeds", "--save-every", "1")


def test_two_processes_equal_one(one, tmp_path):
    out1, m1 = one
    m2 = run(tmp_path, 2)
    assert [r["step"] for r in m2] == [0, 1, 2]
    for a, b in zip(m1, m2):
        assert same(a, b) == {}, a["step"]  # episodes, rewards, filter, kept groups, evaluation: exactly equal
        if "actor/grad_norm" in a:  # the gradient summed over processes is the one-process gradient
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
    assert m1[1]["rollout/filter_kept_count"] == 1  # one group kept: one process trained no row
    w1, w2 = weights(out1, 2), weights(tmp_path, 2)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["processes"] == 2 and config["request_seeds"] is True
    groups = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert len(groups) == 2  # written once (rank 0), not once per process


def test_resume_on_another_process_count(one, tmp_path):
    out1, m1 = one
    first = run(tmp_path, 2, "--steps", "1")  # stop after step 1 on 2 processes ...
    assert [r["step"] for r in first] == [0, 1]
    resumed = run(tmp_path, 1, "--resume", "--steps", "2")  # ... and finish on 1
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert same(m1[2], resumed[2]) == {}
    assert resumed[2]["actor/grad_norm"] == pytest.approx(m1[2]["actor/grad_norm"], rel=1e-5)


def test_torchrun_needs_an_output_dir():
    env = dict(os.environ, HF_HUB_OFFLINE="1", WORLD_SIZE="2", RANK="0")
    done = subprocess.run(
        [sys.executable, "starpo_bandit.py", "--steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "--output-dir" in done.stderr and "torchrun" in done.stderr
