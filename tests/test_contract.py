"""The contract between a script and plumbing/ (plumbing/contract.py): every name plumbing reads of a script is listed
there, every script has them all, and a fork that renames one stops at start-up with one line naming it, before any
model loads."""

import ast
import os
import re
import subprocess
import sys

import pytest

import starpo_bandit as sb
import starpo_frozenlake as fl
import starpo_sokoban as ss
from conftest import ROOT
from plumbing import contract


@pytest.mark.parametrize("script", [sb, fl, ss])
def test_every_script_keeps_the_contract(script):
    kind = contract.ONE_TURN if script is sb else contract.MULTI_TURN
    classes = dict(Trajectory=script.Trajectory, Turn=script.Turn)
    assert contract.missing(script.Args, script.SETTINGS, classes, kind) == []


def test_the_contract_lists_every_args_field_plumbing_reads():
    """`args.X`, `self.args.X`, `run.args.X` (and run.py's `a = self.args`) anywhere in plumbing/: X is listed."""
    read = {}
    for path in sorted((ROOT / "plumbing").glob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"\b(?:args|a)\.([a-z_]+)\b", text):
            read.setdefault(m.group(1), path.name)
    not_fields = {"given"}  # set by flags.parse_args on the instance, not a field
    strings = {"join", "startswith", "option_strings", "to", "items", "split"}  # `a` is also a string or an action
    unlisted = {
        k: v
        for k, v in read.items()
        if k not in contract.ARGS | contract.MULTI_TURN_ARGS and k not in not_fields | strings
    }
    assert unlisted == {}, f"plumbing reads these Args fields without listing them in plumbing/contract.py: {unlisted}"
    settings_read = set(
        re.findall(r'settings\["([a-z_]+)"\]', "".join(p.read_text() for p in (ROOT / "plumbing").glob("*.py")))
    )
    assert settings_read == set(contract.SETTINGS)


def test_a_missing_name_is_reported_with_its_reader():
    class Args:  # noqa: D401 - a fork's Args without n_groups
        pass

    problems = contract.missing(Args, {}, dict(Trajectory=object, Turn=object), contract.MULTI_TURN)
    assert "Args has no field 'n_groups', which plumbing/flags.py reads" in problems
    assert "SETTINGS has no entry 'max_skipped', which plumbing/run.py reads" in problems
    assert "Trajectory has no field 'turns', which plumbing/report.py reads" in problems


def fork(tmp_path, script: str, old: str, new: str):
    """A copy of a script in tmp_path with one line changed (its imports still find plumbing/ and common.py)."""
    text = (ROOT / script).read_text()
    assert text.count(old) == 1, old
    (tmp_path / script).write_text(text.replace(old, new))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return lambda *flags: subprocess.run(
        [sys.executable, str(tmp_path / script), *flags, "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_a_fork_that_renames_a_flag_stops_in_one_line(tmp_path):
    run = fork(tmp_path, "starpo_bandit.py", "    n_groups: int = 8\n", "    num_groups: int = 8\n")
    r = run("--steps", "1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "error: starpo_bandit.py: Args has no field 'n_groups', which plumbing/flags.py reads "
        "(plumbing/contract.py lists what plumbing reads)"
    )
    assert not (tmp_path / "run" / "config.json").exists()  # nothing started


def test_a_fork_that_renames_a_trajectory_field_stops_in_one_line(tmp_path):
    run = fork(tmp_path, "starpo_frozenlake.py", "    turns: list = field(", "    turn_list: list = field(")
    r = run("--steps", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "Trajectory has no field 'turns', which plumbing/report.py reads" in r.stderr


def test_the_contract_module_is_torch_free():
    tree = ast.parse((ROOT / "plumbing" / "contract.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "os", "sys"}
