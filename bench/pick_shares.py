"""Which words a run's thinks picked, and whether the picks were honest, from its rollouts.jsonl (--outcomes runs).

    python bench/pick_shares.py RUN_DIR_OR_ROLLOUTS_JSONL [more] [--split val] [--out bench/results/x.json]

With --outcomes the think restates the Moves line and ends with a pick, a word and a move ("... push Left. push
Left"), and the answer plays the move. For each logged step (evaluation rollouts by default): the share of turns
whose pick is honest (the script's own `pick` rubric component: the word is what the move does, and the answer plays
that move), by turn too, the share of each picked word ("BAD": no pick), the share of picks whose word the Moves
line does not have, and how many dishonest picks after the first turn repeat the previous turn's pick. A run whose picks stop matching their
moves has lost the lookup the warm-up taught; one whose words drift to `wall` is gaming a reward for honesty.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def shares(path: Path, split: str = "val") -> dict:
    """{step: {"honest": share, "honest_by_turn": [...], "words": {word: share}, "turns": n}} for one run."""
    import starpo_frozenlake
    import starpo_sokoban

    scripts = {"frozenlake": starpo_frozenlake, "sokoban": starpo_sokoban}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    honest, by_turn, words, absent, repeats = (collections.defaultdict(list) for _ in range(5))
    for r in rows:
        if r["split"] != split:
            continue
        script, step, last = scripts[r["task"]], r["step"], None
        for j, t in enumerate(r["turns"]):
            turn = types.SimpleNamespace(think=t["think"], world=t["world"], actions=t["actions"])
            ok = script.pick(turn)
            said = (t["think"] or "").strip().rsplit(". ", 1)[-1].split()
            line_words = {fact.split()[0] for fact in t["world"].split(", ") if len(fact.split()) == 2}
            honest[step].append(ok)
            by_turn[step].append((j, ok))
            words[step].append(said[0] if len(said) == 2 else "BAD")
            absent[step].append(len(said) == 2 and said[0] not in line_words)  # a word the Moves line does not have
            if j and not ok:  # a dishonest later pick: the previous turn's pick, word for word?
                repeats[step].append(said == last)
            last = said
    out = {}
    for step in sorted(honest):
        n_turns = max(j for j, _ in by_turn[step]) + 1
        per = [[ok for j, ok in by_turn[step] if j == k] for k in range(n_turns)]
        count = collections.Counter(words[step])
        out[step] = {
            "turns": len(honest[step]),
            "honest": round(sum(honest[step]) / len(honest[step]), 3),
            "honest_by_turn": [round(sum(p) / len(p), 3) if p else None for p in per],
            "words": {w: round(c / len(words[step]), 3) for w, c in count.most_common()},
            "word_not_on_line": round(sum(absent[step]) / len(absent[step]), 3),
            "dishonest_later_picks_repeating_the_last": round(sum(repeats[step]) / len(repeats[step]), 3)
            if repeats[step]
            else None,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (their rollouts.jsonl) or rollouts.jsonl files")
    ap.add_argument("--split", default="val", choices=["val", "train"])
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    result = {}
    for run in a.runs:
        path = Path(run)
        path = path / "rollouts.jsonl" if path.is_dir() else path
        result[run] = shares(path, a.split)
        for step, s in result[run].items():
            words = " ".join(f"{w} {v:.2f}" for w, v in s["words"].items())
            print(
                f"{run} step {step}: honest {s['honest']:.2f} by turn {s['honest_by_turn']} | {words} | not on the "
                f"line {s['word_not_on_line']:.2f}, dishonest repeats {s['dishonest_later_picks_repeating_the_last']}"
            )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {"command": "python bench/pick_shares.py " + " ".join(argv or sys.argv[1:]), "runs": result}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
