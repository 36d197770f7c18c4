"""bench/gpu_smoke.py is the one command for the day a GPU is lent, so it must not rot before then: its CPU check
(`--device cpu --quick`, about a minute) runs every section and writes the JSON a GPU run would write."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_smoke_quick_on_cpu_runs_every_section(tmp_path):
    out = tmp_path / "gpu_smoke.json"
    cmd = [sys.executable, "bench/gpu_smoke.py", "--device", "cpu", "--quick", "--out", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["quick"] is True
    assert done.stdout.splitlines()[0] == result["versions"]  # said first: torch's and transformers' versions
    assert result["versions"].startswith(f"torch {torch.__version__}") and "requirements.txt" not in result["versions"]
    assert set(result["tiny"]) == {"bandit", "frozenlake", "sokoban"}
    runs = [*result["tiny"].values()] + [v for k, v in result.items() if k.startswith("qwen2.5_0.5b_architecture")]
    assert len(runs) == 7  # 3 tiny models, then the Qwen-sized model: plain, LoRA, checkpointing, the 24 GB line
    for run in runs:
        assert run["s_per_step"] and all(s > 0 for s in run["s_per_step"]), run
        assert run["peak_gpu_memory_gib"] is None  # no GPU: no figure, rather than a made-up one
    assert "--lora-rank" in result["qwen2.5_0.5b_architecture_lora_r64"]["argv"]
    assert "--gradient-checkpointing" in result["qwen2.5_0.5b_architecture_gradient_checkpointing"]["argv"]
    pair = result["torchrun_2_processes"]  # on a CPU: 2 gloo processes against 1, the same plumbing as on GPUs
    assert "failed" not in pair and "skipped" not in pair, pair
    assert pair["keys_that_differ"] == [] and pair["grad_norm_max_rel_diff"] < 1e-4, pair
    assert len(pair["s_per_step_2_processes"]) == len(pair["s_per_step_1_process"]) == 2
