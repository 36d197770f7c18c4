"""The lesson stays a lesson: tools/check_budgets.py holds the line budgets and the import direction, and each check
fails on a temporary copy of the tree broken the way it guards against."""

import shutil
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import check_budgets  # noqa: E402


def test_the_tree_is_within_its_budgets():
    assert check_budgets.check(ROOT) == []


def test_the_command_prints_the_sizes_table_and_exits_zero():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_budgets.py")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    assert res.stdout.startswith("| file | lines (budget) |") and "`starpo_frozenlake.py`" in res.stdout


def copy_tree(tmp_path):
    for name in [*check_budgets.BUDGETS, "plumbing"]:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    return tmp_path


def test_flags_and_plumbing_calls_are_counted():
    rows = {r["file"]: r for r in check_budgets.sizes(ROOT)}
    assert rows["starpo_frozenlake.py"]["flags"] == len(fl_fields()) <= check_budgets.FLAGS
    calls = check_budgets.plumbing_calls(ROOT / "starpo_frozenlake.py")
    assert {"flags.parse_args", "Run.timer", "dist.gather"} <= calls and "rollout" not in calls  # plumbing only


def fl_fields():
    import dataclasses

    import starpo_frozenlake

    return dataclasses.fields(starpo_frozenlake.Args)


def test_a_grown_script_a_long_main_and_deep_nesting_fail(tmp_path):
    root = copy_tree(tmp_path)
    path = root / "starpo_bandit.py"
    text = path.read_text()
    path.write_text(text + "\n\ndef unused():\n" + "    x = 1\n" * 1000)
    assert any(
        "starpo_bandit.py: " in p and f"lines, budget {check_budgets.BUDGETS['starpo_bandit.py']}" in p
        for p in check_budgets.check(root)
    )
    deep = "    if args.seed:\n        if 1:\n            if 2:\n                if 3:\n                    if 4:\n" + (
        "                        pass\n"
    )
    body = "".join("    _ = 0\n" for _ in range(120))
    path.write_text(text.replace("def main(argv=None):\n", "def main(argv=None):\n" + deep + body, 1))
    problems = check_budgets.check(root)
    assert any("main() is" in p and f"budget {check_budgets.MAIN_LINES}" in p for p in problems)
    assert any("nests 5 blocks deep" in p for p in problems)


def test_too_many_flags_fail(tmp_path):
    root = copy_tree(tmp_path)
    path = root / "starpo_bandit.py"
    extra = "".join(f'    knob_{i}: int = 0\n    """a knob"""\n' for i in range(check_budgets.FLAGS))
    path.write_text(path.read_text().replace("    # ---- run ----\n", "    # ---- run ----\n" + extra, 1))
    problems = check_budgets.check(root)
    assert any(
        p.startswith("starpo_bandit.py: ") and f"flags (Args fields), budget {check_budgets.FLAGS}" in p
        for p in problems
    )
    assert any("say in the closing note what it needs and why" in p for p in problems)  # the rule, in the message


def test_plumbing_importing_a_script_or_common_importing_machinery_fails(tmp_path):
    root = copy_tree(tmp_path)
    run = root / "plumbing" / "run.py"
    run.write_text(run.read_text() + "\n\ndef late():\n    import starpo_sokoban\n\n    return starpo_sokoban\n")
    assert any("plumbing/run.py imports the script starpo_sokoban" in p for p in check_budgets.check(root))
    common = root / "common.py"
    common.write_text("import transformers\n" + common.read_text())
    assert any("common.py imports transformers" in p for p in check_budgets.check(root))


def test_a_long_readme_fails(tmp_path):
    root = copy_tree(tmp_path)
    (root / "README.md").write_text("x" * 25_001)
    assert any(p.startswith("README.md: 25,001 bytes") for p in check_budgets.check(root))


def test_the_readme_prints_the_sizes_the_tool_reports():
    """The README's Files section holds `python tools/check_budgets.py`'s table as it is now (paste it after a change)."""
    assert check_budgets.table(ROOT) in (ROOT / "README.md").read_text()
