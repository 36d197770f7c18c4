"""Keep the lesson from silting up: line budgets for what a learner reads, and the direction of imports.

A learner reads one script top to bottom and common.py's maths; the machinery lives in plumbing/. Size is a design
signal (../STYLE.md): when a script grows past its budget, ask what moved in that a learner never edits. Checked:

  * each file's lines: starpo_bandit.py 1,190, starpo_frozenlake.py 1,560, starpo_sokoban.py 1,650, common.py 600;
  * each script's main(): at most 135 lines, statements nested at most 4 blocks deep (for / if / with / while / try);
  * what main() can reach: the lines of every function and class main() uses, transitively, inside its own script
    and common.py (a name it calls, a class it builds, `common.X`), within the script's file budget;
  * imports: plumbing/ never imports a script; common.py imports nothing but math, torch and typing helpers;
  * README.md at most 25,000 bytes.

    python tools/check_budgets.py          # the sizes table, then every budget that is broken (exit 1 if any)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Raised with RAGEN-2 (#36) from 1,000 / 1,400 / 1,500 / 400 and 110: the filter's rules and the collapse estimators
# are maths (common.py), and a step gained two phases (the collapse diagnostics, the skipped empty batch).
# Raised with LoRA (#37) from 1,100 / 1,500 / 1,600 and 125: the adapter (LoRALinear), adapters_off (the KL
# reference) and the merge for vLLM are ~60 lines a learner should see; main() wires them and gradient
# checkpointing (6 lines).
BUDGETS = {"starpo_bandit.py": 1195, "starpo_frozenlake.py": 1570, "starpo_sokoban.py": 1665, "common.py": 600}
MAIN_LINES, MAIN_NESTING = 135, 4
README_BYTES = 25_000  # the genre's READMEs are 4-19 KB; the dated record lives in docs/RESULTS.md
COMMON_IMPORTS = {"__future__", "math", "torch", "typing", "dataclasses"}
BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)


def definitions(path: Path) -> dict[str, ast.AST]:
    """Top-level functions and classes of a file, by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def span(node: ast.AST) -> int:
    """Lines of a definition, decorators included."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - start + 1


def reachable(script: Path, common: Path) -> dict[str, int]:
    """{'file:name': lines} for main() and every function or class it reaches in the script and common.py."""
    own, maths = definitions(script), definitions(common)
    imported = {  # `from common import gae, ...`: those names are common's
        alias.asname or alias.name
        for n in ast.parse(script.read_text(encoding="utf-8")).body
        if isinstance(n, ast.ImportFrom) and n.module == "common"
        for alias in n.names
    }
    seen, todo = {}, [("script", "main")]
    while todo:
        where, name = todo.pop()
        node = (own if where == "script" else maths).get(name)
        key = f"{script.name if where == 'script' else common.name}:{name}"
        if node is None or key in seen:
            continue
        seen[key] = span(node)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                if where == "script" and sub.id in own and sub.id not in imported:
                    todo.append(("script", sub.id))
                elif sub.id in maths and (where == "common" or sub.id in imported):
                    todo.append(("common", sub.id))
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "common":
                todo.append(("common", sub.attr))
    return seen


def nesting(node: ast.AST, depth: int = 0) -> int:
    """How many blocks deep the deepest statement inside `node` sits (its own body is depth 0)."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # a nested function is read on its own
        inner = depth + 1 if isinstance(child, BLOCKS) else depth
        deepest = max(deepest, nesting(child, inner))
    return deepest


def imports(path: Path) -> set[str]:
    """The top-level module names a file imports (anywhere in it, functions included)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            out |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module.split(".")[0])
    return out


def sizes(root: Path = ROOT) -> list[dict]:
    """One row per budgeted file: lines, and for a script its main() and what main() reaches."""
    rows = []
    for name, budget in BUDGETS.items():
        path = root / name
        row = dict(file=name, lines=len(path.read_text(encoding="utf-8").splitlines()), budget=budget)
        if name.startswith("starpo_"):
            main = definitions(path)["main"]
            row.update(main=span(main), nesting=nesting(main), reach=sum(reachable(path, root / "common.py").values()))
        rows.append(row)
    return rows


def check(root: Path = ROOT) -> list[str]:
    """One message per broken budget or wrong-way import."""
    problems = []
    for r in sizes(root):
        if r["lines"] > r["budget"]:
            problems.append(f"{r['file']}: {r['lines']} lines, budget {r['budget']}")
        if "main" in r:
            if r["main"] > MAIN_LINES:
                problems.append(f"{r['file']}: main() is {r['main']} lines, budget {MAIN_LINES}")
            if r["nesting"] > MAIN_NESTING:
                problems.append(f"{r['file']}: main() nests {r['nesting']} blocks deep, budget {MAIN_NESTING}")
            if r["reach"] > r["budget"]:
                problems.append(
                    f"{r['file']}: main() reaches {r['reach']} lines here and in common.py, budget {r['budget']}"
                )
    scripts = {p.stem for p in root.glob("starpo_*.py")}
    for path in sorted((root / "plumbing").glob("*.py")):
        for module in sorted(imports(path) & scripts):
            problems.append(f"plumbing/{path.name} imports the script {module}: plumbing never imports a script")
    readme = root / "README.md"
    if readme.exists() and len(readme.read_bytes()) > README_BYTES:
        problems.append(
            f"README.md: {len(readme.read_bytes()):,} bytes, budget {README_BYTES:,}: the record is docs/RESULTS.md"
        )
    extra = imports(root / "common.py") - COMMON_IMPORTS
    if extra:
        problems.append(f"common.py imports {', '.join(sorted(extra))}: it holds the maths (math and torch) only")
    return problems


def table(root: Path = ROOT) -> str:
    lines = ["| file | lines (budget) | main() lines | main() reaches |", "|---|---|---|---|"]
    for r in sizes(root):
        main = f"{r['main']} (nesting {r['nesting']})" if "main" in r else ""
        reach = f"{r['reach']:,}" if "reach" in r else ""
        lines.append(f"| `{r['file']}` | {r['lines']:,} ({r['budget']:,}) | {main} | {reach} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root")
    a = ap.parse_args(argv)
    print(table(a.root))
    problems = check(a.root)
    for p in problems:
        print(p)
    if not problems:
        print("budgets: all within their limits; plumbing/ imports no script; common.py is maths only")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
