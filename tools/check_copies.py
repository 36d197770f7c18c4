"""Keep the scripts' deliberate copies identical (the idea of transformers' utils/check_copies.py).

The training scripts repeat code on purpose, so that each reads on its own. Every repeated block carries a marker
on the line above it, naming its source:

    # Copied from starpo_sokoban.rollout
    def rollout(...):

The block is the top-level definition that follows the marker (a function, a class or an assignment, decorators
included). It must equal the definition of that name in the source file, character for character; `with A->B`
after the name (`# Copied from starpo_sokoban.Args with rooms->maps`) replaces A by B in the source first.

    python tools/check_copies.py          # list every copy that drifted: block, file, line, first difference
    python tools/check_copies.py --fix    # rewrite each drifted copy from its source
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^# Copied from (\w+)\.(\w+)(?: with (.+))?$")


@dataclass
class Block:
    file: Path
    name: str
    start: int  # 0-based index of the block's first line (decorators included)
    end: int  # one past its last line
    marker: tuple | None  # (source module, source name, replacements) or None


def blocks(path: Path) -> dict[str, Block]:
    """The top-level definitions of a file, by name, with the copy marker above each (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = {}
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        m = MARKER.match(lines[start - 1]) if start > 0 else None
        subs = (
            [tuple(x.strip() for x in pair.split("->", 1)) for pair in m.group(3).split(",")]
            if m and m.group(3)
            else []
        )
        out[name] = Block(path, name, start, node.end_lineno, (m.group(1), m.group(2), subs) if m else None)
    return out


def check(root: Path = ROOT, fix: bool = False) -> list[str]:
    """One message per problem: a copy that differs from its source, a marker naming nothing, a copy of a copy,
    and identical definitions that are not marked as copies."""
    problems = []
    files = sorted(root.glob("starpo_*.py"))
    parsed = {p.stem: blocks(p) for p in files}
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        fixed = list(lines)
        for b in sorted(parsed[path.stem].values(), key=lambda b: -b.start):  # bottom up: --fix keeps indices valid
            if b.marker is None:
                continue
            module, name, subs = b.marker
            where = f"{path.name}:{b.start + 1}: {name}"
            src = parsed.get(module, {}).get(name)
            if src is None:
                problems.append(f"{where}: marked as copied from {module}.{name}, which does not exist")
                continue
            if src.marker is not None:
                problems.append(
                    f"{where}: its source {module}.{name} is itself a copy; point the marker at the original"
                )
                continue
            want = src.file.read_text(encoding="utf-8").splitlines()[src.start : src.end]
            for a, c in subs:
                want = [line.replace(a, c) for line in want]
            have = lines[b.start : b.end]
            if have == want:
                continue
            k = next((i for i, (x, y) in enumerate(zip(have, want)) if x != y), min(len(have), len(want)))
            got = have[k] if k < len(have) else "<end of block>"
            exp = want[k] if k < len(want) else "<end of block>"
            problems.append(
                f"{where}: differs from {module}.{name} at line {b.start + k + 1} "
                f"(line {k + 1} of the block): {got.strip()!r} != {exp.strip()!r}"
            )
            fixed[b.start : b.end] = want
        if fix and fixed != lines:
            path.write_text("\n".join(fixed) + "\n", encoding="utf-8")
    # Repetition that is not a marked copy: the same definition, word for word, in two scripts, neither marked.
    texts = {}
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        for b in parsed[path.stem].values():
            if b.marker is None and b.end - b.start >= 3:
                texts.setdefault("\n".join(lines[b.start : b.end]), []).append(f"{path.stem}.{b.name}")
    for text, where in texts.items():
        if len(where) > 1:
            problems.append(
                f"{' and '.join(where)} are identical but not marked: mark all but one '# Copied from {where[0]}'"
            )
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fix", action="store_true", help="rewrite drifted copies from their sources")
    ap.add_argument("--root", type=Path, default=ROOT, help="folder holding the starpo_*.py scripts")
    a = ap.parse_args(argv)
    problems = check(a.root, a.fix)
    for p in problems:
        print(p)
    if not problems:
        print("copies: all identical to their sources")
    return 1 if problems and not a.fix else 0


if __name__ == "__main__":
    sys.exit(main())
