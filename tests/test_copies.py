"""The training scripts' deliberate copies (`# Copied from starpo_X.name`) equal their sources, and a drifted copy
fails, naming the block and its first differing line (tools/check_copies.py, run here on temporary copies too)."""

import shutil
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import check_copies  # noqa: E402

SCRIPTS = ["starpo_bandit.py", "starpo_frozenlake.py", "starpo_sokoban.py"]
# The multi-turn core lives once, in starpo_sokoban.py; starpo_frozenlake.py carries it as marked copies.
MULTI_TURN_CORE = {
    "Turn",
    "anchors",
    "group_relative",
    "sum_parts",
    "think_judged",
    "Trajectory",
    "rollout",
    "context_ids",
    "Row",
    "training_rows",
    "place_rewards",
    "place_turn_values",
    "collate",
    "micro_view",
    "advantages_of",
    "policy_forward",
    "Critic",
    "evaluate",
    "print_sample",
    "parse_actions",
    "tiny_warmup_examples",
    "HIGH_LEVEL_GAMMA",
    "world_model_think",
    "world_model",
    "pick",
    "main",
}
# ... and what all three share lives once, in starpo_bandit.py (the machinery they share is plumbing/, not a copy).
SHARED_BY_ALL = {
    "vllm_engine",
    "vllm_engine_kwargs",
    "vllm_sampling_kwargs",
    "vllm_generate",
    "vllm_push_weights",
    "parse_reply",
    "_between",
    "score_turn",
    "old_logprobs",
    "ppo_update",
    "FORMAT_RE",
    "format_reward",
    "ALGOS",
    "SETTINGS",
    "models",
}


def markers(script: str) -> dict[str, tuple]:
    return {name: b.marker for name, b in check_copies.blocks(ROOT / script).items() if b.marker}


def test_every_copy_is_identical_to_its_source():
    assert check_copies.check(ROOT) == []


def test_the_shared_blocks_are_marked_copies_of_one_source():
    fl, sk = markers("starpo_frozenlake.py"), markers("starpo_sokoban.py")
    assert {n for n, m in fl.items() if m[0] == "starpo_sokoban"} == MULTI_TURN_CORE
    assert {n for n, m in fl.items() if m[0] == "starpo_bandit"} == SHARED_BY_ALL
    assert {n for n, m in sk.items() if m[0] == "starpo_bandit"} == SHARED_BY_ALL
    assert markers("starpo_bandit.py") == {}  # the bandit is a source only


def copy_scripts(tmp_path):
    for name in SCRIPTS:
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_a_changed_line_inside_a_copy_fails_naming_the_block_and_the_line(tmp_path):
    root = copy_scripts(tmp_path)
    path = root / "starpo_frozenlake.py"
    original = path.read_text()
    old = "            t.mask += [1] * len(r_ids)\n"
    assert original.count(old) == 1
    path.write_text(original.replace(old, "            t.mask += [1] * len(r_ids)  # edited\n"))
    (problem,) = check_copies.check(root)
    line = original[: original.index(old)].count("\n") + 1
    assert problem.startswith("starpo_frozenlake.py:") and " rollout: differs from starpo_sokoban.rollout" in problem
    assert f"at line {line} " in problem and "# edited" in problem
    # the command line says so too (exit 1), and --fix puts the source's text back
    cmd = [sys.executable, str(ROOT / "tools" / "check_copies.py"), "--root", str(root)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 1 and "rollout" in res.stdout
    assert subprocess.run(cmd + ["--fix"], capture_output=True, text=True).returncode == 0
    assert path.read_text() == original and check_copies.check(root) == []


def test_a_changed_source_fails_every_copy(tmp_path):
    root = copy_scripts(tmp_path)
    path = root / "starpo_bandit.py"
    text = path.read_text()
    old = '    return _between(text, "think"), _between(text, "answer")\n'
    path.write_text(text.replace(old, old.replace('"answer")', '"answer").strip()')))
    problems = check_copies.check(root)
    assert len(problems) == 2 and all("parse_reply: differs from starpo_bandit.parse_reply" in p for p in problems)


def test_bad_markers_and_unmarked_repetition_are_reported(tmp_path):
    root = copy_scripts(tmp_path)
    path = root / "starpo_sokoban.py"
    text = path.read_text()
    path.write_text(
        text.replace("# Copied from starpo_bandit.parse_reply\n", "# Copied from starpo_bandit.no_such_block\n")
    )
    assert any("starpo_bandit.no_such_block, which does not exist" in p for p in check_copies.check(root))
    path.write_text(text.replace("# Copied from starpo_bandit.parse_reply\n", ""))  # the same code, unmarked
    assert any("parse_reply" in p and "identical but not marked" in p for p in check_copies.check(root))


def test_the_shared_args_fields_are_checked_copies():
    """Every field the scripts' Args share reads the same (docstring included), but those each marker excepts."""
    lines = lambda s: (ROOT / s).read_text().splitlines()  # noqa: E731
    fl, sk = lines("starpo_frozenlake.py"), lines("starpo_sokoban.py")
    assert "# Copied fields from starpo_bandit.Args except estimator, max_tokens, gamma" in fl
    assert "# Copied fields from starpo_sokoban.Args except positions, outcomes" in fl
    assert "# Copied fields from starpo_bandit.Args except estimator, max_tokens, gamma" in sk
    shared = set(check_copies.fields(ROOT / "starpo_bandit.py", "Args")) & set(
        check_copies.fields(ROOT / "starpo_frozenlake.py", "Args")
    )
    assert len(shared) >= 40  # most of the surface is one checked copy


def test_a_drifted_field_fails_and_fix_restores_it(tmp_path):
    root = copy_scripts(tmp_path)
    path = root / "starpo_sokoban.py"
    original = path.read_text()
    old = '    """training rows per forward/backward (gradient accumulation; lower it if memory runs out)"""\n'
    assert original.count(old) == 1
    path.write_text(original.replace(old, old.replace("lower it", "halve it")))
    problems = check_copies.check(root)
    assert any(
        "Args: field micro_batch_size" in p and "differs from starpo_bandit.Args.micro_batch_size" in p
        for p in problems
    )
    check_copies.check(root, fix=True)
    assert path.read_text() == original and check_copies.check(root) == []


def test_an_except_that_is_not_needed_is_reported(tmp_path):
    root = copy_scripts(tmp_path)
    path = root / "starpo_sokoban.py"
    text = path.read_text()
    marker = "# Copied fields from starpo_bandit.Args except estimator, max_tokens, gamma\n"
    path.write_text(text.replace(marker, marker.replace("max_tokens", "max_tokens, lr")))
    assert any("'except lr': lr reads the same in both" in p for p in check_copies.check(root))
    path.write_text(text.replace(marker, marker.replace("max_tokens", "max_tokens, no_such_field")))
    assert any("no_such_field is not a field of both" in p for p in check_copies.check(root))
