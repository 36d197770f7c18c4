"""What every bench/*_cpu.py shares: run one training script in a temporary folder, time it, describe the machine."""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, flags: list[str], warm_cache: bool) -> dict:
    """Run `python SCRIPT --sample-every 0 FLAGS --output-dir TMP` offline; a cold run gets a fresh STARPO_CACHE, so
    the tiny model's build counts. Returns its metrics rows, config, start time, wall seconds and load at start."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if not warm_cache:
            env["STARPO_CACHE"] = str(Path(tmp) / "cache")
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, script, "--sample-every", "0", *flags, "--output-dir", str(run_dir)]  # flags may override
        load_start = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed:\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        config = json.loads((run_dir / "config.json").read_text())
    return dict(rows=rows, config=config, t0=t0, wall=wall, load_start=load_start)


def machine(load_start) -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_avg_at_start": [round(x, 2) for x in load_start],
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]}


def write_result(out: str, result: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "eval_curve"}, indent=1))
