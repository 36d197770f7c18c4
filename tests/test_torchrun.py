"""Several processes (plumbing/dist.py): torchrun with 2 CPU processes (gloo) gives the run of one process with
--request-seeds: the same episodes, filter, metrics and weights; a run resumes on another process count.

The bandit's tiny model, 3 groups over 2 processes: the blocks are uneven (1 and 2 groups) and the filter keeps one
group, so one process trains no row in the step and must still take part in the gradient sum without a hang.
"""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen
from safetensors.torch import load_file

from plumbing.dist import differing_metrics, launcher

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--steps", "2", "--n-groups", "3", "--val-size", "8", "--eval-every", "1", "--mi-every", "0"]


def run(out: Path, processes: int, *extra: str) -> list[dict]:
    cmd = [*launcher(processes), "starpo_bandit.py", *FLAGS, "--output-dir", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd + list(extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_gigpo_and_rollout_reuse_on_two_processes_equal_one(tmp_path):
    """FrozenLake's GiGPO on a batch trained twice (--rollout-reuse 2): the state groups, the reused batch and the
    stale gap are the same on 2 processes as on 1."""
    flags = ["--steps", "2", "--n-groups", "3", "--group-size", "4", "--val-size", "4", "--eval-every", "0"]
    flags += ["--mi-every", "0", "--max-turns", "4", "--estimator", "gigpo", "--rollout-reuse", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    rows = {}
    for n, extra in ((1, ["--request-seeds"]), (2, [])):
        cmd = [*launcher(n), "starpo_frozenlake.py", *flags, *extra, "--output-dir", str(tmp_path / str(n))]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        rows[n] = [json.loads(line) for line in (tmp_path / str(n) / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows[1], rows[2]):
        assert differing_metrics(a, b) == {}, a["step"]
        for k in ("rollout/stale_logprob_diff_mean", "actor/grad_norm"):  # the updated weights' float order
            assert (k in a) == (k in b) and (k not in a or b[k] == pytest.approx(a[k], rel=1e-4)), k
    assert [r.get("rollout/policy_age") for r in rows[2]] == [None, 0, 1] and "gigpo/step_groups" in rows[2][1]


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
        # episodes, rewards, filter, kept groups, evaluation: exactly equal
        assert differing_metrics(a, b) == {}, a["step"]
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
    assert (tmp_path / "rollouts.jsonl").read_text() == (out1 / "rollouts.jsonl").read_text()  # the same episodes


def test_resume_on_another_process_count(one, tmp_path):
    out1, m1 = one
    first = run(tmp_path, 2, "--steps", "1")  # stop after step 1 on 2 processes ...
    assert [r["step"] for r in first] == [0, 1]
    resumed = run(tmp_path, 1, "--resume", "--steps", "2")  # ... and finish on 1
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert differing_metrics(m1[2], resumed[2]) == {}
    assert resumed[2]["actor/grad_norm"] == pytest.approx(m1[2]["actor/grad_norm"], rel=1e-5)


def test_resume_from_one_process_on_two(one, tmp_path):
    out1, m1 = one
    run(tmp_path, 1, "--request-seeds", "--steps", "1")
    resumed = run(tmp_path, 2, "--resume", "--steps", "2")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert differing_metrics(m1[2], resumed[2]) == {}
    assert resumed[2]["actor/grad_norm"] == pytest.approx(m1[2]["actor/grad_norm"], rel=1e-5)


def test_an_empty_step_is_skipped_by_every_process(tmp_path):
    """Every score 0: no group has a signal, top-p keeps none, and both processes skip the step together (a process
    that went on to the update would wait for the other forever); five empty steps in a row (SETTINGS) end the run."""
    zero = ["--algo", "starpo-s2", "--rubric-weights", "env_reward=0,format_reward=0,invalid_answer_penalty=0"]
    rows = run(tmp_path, 2, *zero, "--steps", "7", "--eval-every", "0")
    steps = [r for r in rows if "rollout/empty_after_filter" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and all(r["rollout/empty_after_filter"] == 1 for r in steps)
    assert all(not any(k.startswith("actor/") for k in r) for r in steps)  # no update ran


def update_worker(rank: int, world: int, port: int, out: str) -> None:
    """One PPO update of a random float64 Qwen2 on a fixed batch of 4 groups x 3 rows, this rank training its block
    of the groups (2 optimizer steps of 6 rows, micro-batches of 2): rank 0 saves the weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    import plumbing.dist as dist
    import starpo_bandit as sb

    dist.init("cpu")
    policy = tiny_qwen().double()
    g = torch.Generator().manual_seed(1)
    trajs = []
    for group in range(4):
        prompt = torch.randint(2, 64, (3 + group,), generator=g).tolist()
        for _ in range(3):
            reply = torch.randint(2, 64, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            trajs.append(sb.Trajectory(group, prompt, reply, [-1.0] * len(reply), None, 0.0, {}))
    batch = sb.collate(trajs, 0, "cpu")
    batch["mine"] = torch.tensor([i // 3 in dist.block(4) for i in range(len(trajs))])
    mask = batch["reply_mask"].double()
    inputs = dict(
        mask=mask,
        advantages=torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask,
        returns=None,
        old_logp=(batch["gen_logprobs"].double() - 0.1 * torch.rand(mask.shape, generator=g, dtype=torch.float64)),
        ref_logp=None,
        old_values=None,
        tis=None,
    )
    args = sb.Args(ppo_epochs=2, mini_batch_size=6, micro_batch_size=2, entropy_coef=0.01)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)  # the step is the gradient (Adam would amplify 1e-16s)
    shuffle = torch.Generator().manual_seed(0)
    sb.ppo_update(policy, None, None, opt, None, batch, inputs, args, shuffle, contextlib.nullcontext())
    if dist.is_main():
        torch.save(policy.state_dict(), out)
    dist.finish()


def test_one_update_on_two_processes_equals_one_in_float64(tmp_path):
    """The update's weights at N = 2 equal N = 1 to 1e-10 in float64: each shuffled mini-batch's rows fall unevenly
    between the ranks (and are of unequal lengths), the gradient is summed once per optimizer step."""
    import torch.multiprocessing as mp

    outs = {}
    for world, port in ((1, 29611), (2, 29612)):
        outs[world] = str(tmp_path / f"n{world}.pt")
        mp.spawn(update_worker, args=(world, port, outs[world]), nprocs=world, join=True)
    one, two = torch.load(outs[1]), torch.load(outs[2])
    start = tiny_qwen().double().state_dict()
    moved = [k for k in one if not torch.equal(one[k], start[k])]
    assert len(moved) > 10  # the update moved the weights
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-10)


def test_torchrun_needs_an_output_dir():
    env = dict(os.environ, HF_HUB_OFFLINE="1", WORLD_SIZE="2", RANK="0")
    done = subprocess.run(
        [sys.executable, "starpo_bandit.py", "--steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "--output-dir" in done.stderr and "torchrun" in done.stderr
