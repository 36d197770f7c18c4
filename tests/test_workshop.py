"""WORKSHOP.md: every command in the handout runs (with a tiny step count), and every exercise is complete.

The commands are parsed from WORKSHOP.md by bench/workshop.py (which also produces the figures the handout quotes),
so the handout, these tests and the figures cannot drift apart.
"""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import workshop  # noqa: E402

TEXT = (ROOT / "WORKSHOP.md").read_text()
COMMANDS = workshop.workshop_commands()
EXERCISES = re.split(r"^## Exercise ", TEXT, flags=re.M)[1:]


def test_the_handout_has_at_least_six_complete_exercises():
    assert len(EXERCISES) >= 6
    for ex in EXERCISES:
        number = ex.split(maxsplit=1)[0].rstrip(":.")
        for part in ("**Goal.**", "**Edit.**", "**Run.**", "**Time.**", "**Look at.**", "**What a run showed.**"):
            assert part in ex, f"exercise {number} lacks {part}"
        assert "```bash" in ex, f"exercise {number} has no command"
    assert {n for n, _ in COMMANDS} >= set(range(1, 7))


def test_every_command_uses_the_tiny_model_and_its_own_output_dir():
    dirs = [workshop.flag(argv, "--output-dir") for _, argv in COMMANDS]
    assert all(argv[argv.index("--model") + 1] == "tiny" for _, argv in COMMANDS)
    assert None not in dirs and len(set(dirs)) == len(dirs)


def test_quoted_figures_come_from_the_recorded_runs():
    """Every command has a recorded run in bench/results/workshop.json (written by bench/workshop.py)."""
    runs = json.loads((ROOT / "bench/results/workshop.json").read_text())["runs"]
    for _, argv in COMMANDS:
        assert " ".join(["python", *argv]) in runs, f"no recorded run for: python {' '.join(argv)}"


def short(argv: list[str], out_dir) -> list[str]:
    """The same command with one training step, a small evaluation and a temporary output folder."""
    argv = list(argv)
    for name, value in (("--steps", "1"), ("--val-size", "4"), ("--output-dir", str(out_dir))):
        if name in argv:
            argv[argv.index(name) + 1] = value
        else:
            argv += [name, value]
    return argv


@pytest.mark.parametrize(
    "exercise,argv",
    COMMANDS,
    ids=[f"ex{n}-{'-'.join(a[a.index('--output-dir') + 1].split('/')[-1:])}" for n, a in COMMANDS],
)
def test_workshop_command_runs(exercise, argv, tmp_path):
    proc = subprocess.run(
        [sys.executable, *short(argv, tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert (tmp_path / "run/report.html").exists()
