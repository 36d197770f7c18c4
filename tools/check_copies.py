"""Keep the scripts' deliberate copies identical (the idea of transformers' utils/check_copies.py).

The training scripts repeat code on purpose, so that each reads on its own. Every repeated block carries a marker
on the line above it, naming its source:

    # Copied from starpo_sokoban.rollout
    def rollout(...):

The block is the top-level definition that follows the marker (a function, a class or an assignment, decorators
included). It must equal the definition of that name in the source file, character for character; `with A->B`
after the name (`# Copied from starpo_sokoban.Args with rooms->maps`) replaces A by B in the source first.

A class may instead copy some of its fields: each `# Copied fields from starpo_bandit.Args except a, b` line above it
(several may stand there) says that every field the two classes both define, but a and b, reads exactly as in the
source, its docstring included (the scripts' Args: one checked surface). A field named after `except` must be one that
both define and that differs.

    python tools/check_copies.py          # list every copy that drifted: block, file, line, first difference
    python tools/check_copies.py --fix    # rewrite each drifted copy (block or field) from its source
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
FIELDS_MARKER = re.compile(r"^# Copied fields from (\w+)\.(\w+)(?: except (.+))?$")


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


def fields(path: Path, cls: str) -> dict[str, tuple[int, int]]:
    """{field: (start, end)} of a dataclass's fields in a file: 0-based, end exclusive, its docstring included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    out, body = {}, node.body if node else []
    for f, nxt in zip(body, body[1:] + [None]):
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name):
            doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
            out[f.target.id] = (f.lineno - 1, (nxt if doc else f).end_lineno)
    return out


def field_markers(lines: list[str], b: Block) -> list[tuple[str, str, list[str]]]:
    """The `# Copied fields from module.Class except a, b` lines right above a block: (module, class, [a, b])."""
    out, k = [], b.start - 1
    while k >= 0 and (m := FIELDS_MARKER.match(lines[k])):
        out.append((m.group(1), m.group(2), [x.strip() for x in (m.group(3) or "").split(",") if x.strip()]))
        k -= 1
    return out


def check_fields(root: Path, path: Path, parsed: dict, fix: bool) -> list[str]:
    """Field-level copies (FIELDS_MARKER) in one script; with fix, drifted fields are rewritten from their source."""
    problems, lines = [], path.read_text(encoding="utf-8").splitlines()
    fixed = list(lines)
    edits = {}  # span -> the source's lines (two markers may name one field)
    for b in parsed[path.stem].values():
        for module, cls, skip in field_markers(lines, b):
            where = f"{path.name}:{b.start + 1}: {b.name}"
            src_path = root / f"{module}.py"
            if module not in parsed or cls not in parsed[module]:
                problems.append(f"{where}: fields marked as copied from {module}.{cls}, which does not exist")
                continue
            mine, theirs = fields(path, b.name), fields(src_path, cls)
            src_lines = src_path.read_text(encoding="utf-8").splitlines()
            text = lambda ls, span: ls[span[0] : span[1]]  # noqa: E731
            for name in skip:
                if name not in mine or name not in theirs:
                    problems.append(f"{where}: 'except {name}': {name} is not a field of both {b.name} and {cls}")
                elif text(lines, mine[name]) == text(src_lines, theirs[name]):
                    problems.append(f"{where}: 'except {name}': {name} reads the same in both; drop it from the list")
            for name in sorted(set(mine) & set(theirs) - set(skip)):
                have, want = text(lines, mine[name]), text(src_lines, theirs[name])
                if have != want:
                    problems.append(
                        f"{where}: field {name} (line {mine[name][0] + 1}) differs from {module}.{cls}.{name}: "
                        f"{' '.join(have).strip()[:80]!r} != {' '.join(want).strip()[:80]!r}"
                    )
                    edits[mine[name]] = want
    for (a, z), want in sorted(edits.items(), key=lambda e: -e[0][0]):
        fixed[a:z] = want
    if fix and fixed != lines:
        path.write_text("\n".join(fixed) + "\n", encoding="utf-8")
    return problems


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
    for path in files:
        problems += check_fields(root, path, {p.stem: blocks(p) for p in files} if fix else parsed, fix)
    for _ in range(len(files) if fix else 0):  # a field copied from a copy: fix until every copy has its source's text
        for path in files:
            check_fields(root, path, {p.stem: blocks(p) for p in files}, fix)
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
