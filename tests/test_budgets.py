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


def test_reach_counts_what_main_uses_in_the_script_and_common():
    reach = check_budgets.reachable(ROOT / "starpo_frozenlake.py", ROOT / "common.py")
    assert "starpo_frozenlake.py:main" in reach and "starpo_frozenlake.py:rollout" in reach
    assert "common.py:policy_loss" in reach  # via ppo_update, imported by name
    assert "common.py:turn_group_advantages" in reach  # via advantages_of, as common.X
    assert "starpo_frozenlake.py:success_dp" in reach  # via baselines
    assert reach["starpo_frozenlake.py:main"] == check_budgets.sizes(ROOT)[1]["main"]


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


def test_main_reaching_too_much_fails_even_when_the_file_fits(tmp_path):
    root = copy_tree(tmp_path)
    path = root / "starpo_bandit.py"
    text = path.read_text()
    # a big function in common.py that main now calls: the file stays small, what main reaches does not
    (root / "common.py").write_text((root / "common.py").read_text() + "\n\ndef big():\n" + "    y = 2\n" * 120)
    path.write_text(text.replace("def main(argv=None):\n", "def main(argv=None):\n    common.big()\n", 1))
    problems = check_budgets.check(root)
    assert any(p.startswith("starpo_bandit.py: main() reaches") for p in problems), problems
    assert not any("lines, budget" in p for p in problems)  # every file itself is within its budget


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
