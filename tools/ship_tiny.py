"""Build the multi-turn tiny models and the bandit's tiny judges and ship them in tiny/, where
plumbing.tiny.build_tiny_model finds them when your own cache ($STARPO_CACHE) has no build for today's recipe: a first
FrozenLake or Sokoban run (or a bandit run with --judge tiny or tiny-gullible) then starts at once instead of after a
build. Both multi-turn models have a 1,500-step reading stage, then 600 warm-up steps: FrozenLake's about 37 minutes
on two idle cores (its reading stage 768 s, then 1,459 s of warm-up on ten-turn episodes), Sokoban's 33 (888 s, then
1,088 s); build_info.json's build_seconds counts the warm-up alone when a cached reading stage is reused. Each judge
takes a few minutes (its build_seconds). The bandit's own model (1.5 minutes) is built on first use.

    python tools/ship_tiny.py                # fresh builds in a temporary cache (about an hour on two cores)
    python tools/ship_tiny.py --from-cache   # copy the builds $STARPO_CACHE already holds for today's keys
    python tools/ship_tiny.py --task sokoban # one task's model (Sokoban's: about 30 minutes)
    python tools/ship_tiny.py --task bandit-judge --task bandit-judge-gullible   # the judges

A FrozenLake or Sokoban build ships only if its greedy answers play the think's pick (the warm-up's one copy: "...
wall Up. to Down" then <answer> Down </answer>) on PLAYS_PICK of 200 held-out first turns (bench/tiny_probe.py's
world probe): a warm-up can end on the plateau before that copy forms (loss ~0.13 where a formed one ends ~0.06),
and such a build did not learn RL (RESULTS 2026-12-08).

Run it after changing a multi-turn script's warm-up, its TINY_BUILD, the bandit's tiny_judge_examples or
TINY_JUDGE, or plumbing.tiny.TINY_VERSION: tests/test_tiny_shipped.py fails until you do. It replaces the task's
older shipped builds and rewrites tiny/SHA256SUMS.
"""

import argparse
import hashlib
import importlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import plumbing.flags  # noqa: E402
import plumbing.tiny  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import tiny_probe  # noqa: E402

TASKS = ("frozenlake", "sokoban", "bandit-judge", "bandit-judge-gullible")  # the bandit's tiny judges: --judge tiny*
MAX_MODEL_BYTES = 16 * 2**20  # what a shipped model.safetensors may weigh
PLAYS_PICK = 0.8  # a multi-turn build's answers must play their think's pick this often (greedy, held-out first turns)
PROBE_TURNS = 200  # the held-out first turns plays_pick reads


def default_build(task: str, scratch: str) -> tuple[list, dict]:
    """The warm-up examples and build recipe the script's own `--model tiny` run uses (scratch: an unused run dir)."""
    script = importlib.import_module(f"starpo_{task.split('-')[0]}")
    flags = ["--model", "tiny", "--output-dir", scratch]
    args = script.resolve_args(
        plumbing.flags.parse_args(script.Args, flags, presets=script.PRESETS, algos=script.ALGOS)
    )[0]
    if task.startswith("bandit-judge"):  # --judge tiny*, on the default arms; other arms build theirs on first use
        build, examples, recipe = script.tiny_judge_build(
            "tiny" + task.removeprefix("bandit-judge"), script.arm_pairs(args)
        )
        if build != task:
            sys.exit(f"error: starpo_bandit.tiny_judge_build names {build!r} for the task {task!r}")
        return examples, recipe
    return script.tiny_warmup_examples(args), script.TINY_BUILD


def plays_pick(task: str, model: Path) -> float:
    """The share of PROBE_TURNS held-out first turns on which the model's greedy answer plays its think's pick."""
    return tiny_probe.world_probe(task, PROBE_TURNS, 0, outcomes=True, model_dir=str(model))["answer_copies_pick"]


def shipped(task: str, root: Path = ROOT / "tiny") -> list[Path]:
    """The task's builds in tiny/: tiny-<task>-<12 hex digits> (so bandit-judge's are not bandit-judge-gullible's)."""
    return sorted(p for p in root.glob(f"tiny-{task}-*") if re.fullmatch(f"tiny-{task}-[0-9a-f]{{12}}", p.name))


def checksums(root: Path) -> str:
    """sha256sum's format for every file of every shipped build, sorted."""
    lines = []
    for path in sorted(p for p in root.glob("tiny-*/*") if p.is_file()):
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(root)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-cache", action="store_true", help="copy existing builds from $STARPO_CACHE")
    ap.add_argument("--task", choices=TASKS, action="append", help="build only this task's model (repeatable)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.from_cache:
            os.environ["STARPO_CACHE"] = str(Path(tmp) / "cache")
        plumbing.tiny.SHIPPED_TINY = Path(tmp) / "none"  # never answer with what is shipped already
        for task in args.task or TASKS:
            examples, recipe = default_build(task, str(Path(tmp) / "run"))
            built = plumbing.tiny.tiny_cache_root() / plumbing.tiny.tiny_model_name(task, examples, **recipe)
            if args.from_cache and not (built / "build_info.json").exists():
                sys.exit(f"error: {built} is not built; run without --from-cache")
            built = plumbing.tiny.build_tiny_model(task, examples, **recipe)
            size = (built / "model.safetensors").stat().st_size
            if size > MAX_MODEL_BYTES:
                sys.exit(
                    f"error: {built.name} weighs {size / 2**20:.1f} MB, over the {MAX_MODEL_BYTES >> 20} MB allowed"
                )
            if task in tiny_probe.TASKS:  # multi-turn: the warm-up always plays its pick; RL steers by its word
                plays = plays_pick(task, built)
                print(f"{built.name}: the answer plays the think's pick on {plays:.2f} of {PROBE_TURNS} first turns")
                if plays < PLAYS_PICK:  # RESULTS 2026-12-08: such a build did not learn Sokoban
                    sys.exit(f"error: {built.name} plays its pick on {plays:.2f} (< {PLAYS_PICK}): not shipped")
            target = ROOT / "tiny" / built.name
            for old in shipped(task):
                if old != target:
                    shutil.rmtree(old)
            if not target.exists():
                shutil.copytree(built, target)
            print(f"shipped {target.relative_to(ROOT)} ({size / 2**20:.1f} MB)")
    (ROOT / "tiny" / "SHA256SUMS").write_text(checksums(ROOT / "tiny"))
    print("wrote tiny/SHA256SUMS")


if __name__ == "__main__":
    main()
