"""Keep the lesson from silting up: budgets for what a learner reads, and the direction of imports.

A learner reads one script top to bottom and common.py's maths; the machinery lives in plumbing/. When a script grows,
ask what moved in that a learner never edits. Checked (the numbers are BUDGETS and the constants below them):

  * each file's lines;
  * each script's main(): its lines, and statements nested at most 4 blocks deep (for / if / with / while / try);
  * each script's flags: the fields of its Args (the one surface a user types);
  * imports: plumbing/ never imports a script; common.py imports nothing but math, torch and typing helpers;
  * README.md's bytes.

The table also counts the plumbing functions main() names: how much machinery a reader of main meets.

    python tools/check_budgets.py          # the sizes table, then every budget that is broken (exit 1 if any)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A budget is a cap, set by an issue that names the number (these: "The one-process lesson"). A change that needs
# more lines takes them from elsewhere, or stops and says in its closing note what it needs and why; a budget changes
# only by an issue that names the new number, never in the commit that would break it.
# "Credit where it is due" allows 30 lines more to each multi-turn script and 80 to common.py, and "Judges in the
# rubric" 40 more to each script, beyond the one-process lesson's 1,100 / 1,480 / 1,580 / 520.
BUDGETS = {"starpo_bandit.py": 1140, "starpo_frozenlake.py": 1550, "starpo_sokoban.py": 1650, "common.py": 600}
MAIN_LINES, MAIN_NESTING, FLAGS = 120, 4, 60
README_BYTES = 25_000  # the genre's READMEs are 4-19 KB; the dated record lives in docs/RESULTS.md
COMMON_IMPORTS = {"__future__", "math", "torch", "typing", "dataclasses"}
RULE = "take the lines from elsewhere, or say in the closing note what it needs and why (budgets change by issue)"
BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)


def definitions(path: Path) -> dict[str, ast.AST]:
    """Top-level functions and classes of a file, by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def span(node: ast.AST) -> int:
    """Lines of a definition, decorators included."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - start + 1


def flags(script: Path) -> int:
    """The fields of the script's Args: its flags."""
    cls = definitions(script)["Args"]
    return sum(isinstance(n, ast.AnnAssign) for n in cls.body)


def plumbing_calls(script: Path) -> set[str]:
    """The plumbing functions main() names (`run.timer` on a Run counts as Run.timer): module.name, distinct."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    modules = {  # `from plumbing import dist, engine` and `from plumbing.run import Run, write_line`
        a.asname or a.name: (n.module, a.name)
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("plumbing")
        for a in n.names
    }
    out, main = set(), definitions(script)["main"]
    for sub in ast.walk(main):
        if isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
                out.add(f"{f.value.id}.{f.attr}")
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "run":
                out.add(f"Run.{f.attr}")
            elif isinstance(f, ast.Name) and f.id in modules:
                out.add(f.id)
    return out


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
    """One row per budgeted file: lines, and for a script its main(), its flags and the plumbing main() names."""
    rows = []
    for name, budget in BUDGETS.items():
        path = root / name
        row = dict(file=name, lines=len(path.read_text(encoding="utf-8").splitlines()), budget=budget)
        if name.startswith("starpo_"):
            main = definitions(path)["main"]
            row.update(main=span(main), nesting=nesting(main), flags=flags(path), plumbing=len(plumbing_calls(path)))
        rows.append(row)
    return rows


def check(root: Path = ROOT) -> list[str]:
    """One message per broken budget or wrong-way import."""
    problems = []
    for r in sizes(root):
        if r["lines"] > r["budget"]:
            problems.append(f"{r['file']}: {r['lines']} lines, budget {r['budget']}: {RULE}")
        if "main" in r:
            if r["main"] > MAIN_LINES:
                problems.append(f"{r['file']}: main() is {r['main']} lines, budget {MAIN_LINES}: {RULE}")
            if r["nesting"] > MAIN_NESTING:
                problems.append(f"{r['file']}: main() nests {r['nesting']} blocks deep, budget {MAIN_NESTING}")
            if r["flags"] > FLAGS:
                problems.append(f"{r['file']}: {r['flags']} flags (Args fields), budget {FLAGS}: {RULE}")
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
    lines = [
        "| file | lines (budget) | main() lines | flags | plumbing functions main() names |",
        "|---|---|---|---|---|",
    ]
    for r in sizes(root):
        main = f"{r['main']} (nesting {r['nesting']})" if "main" in r else ""
        lines.append(
            f"| `{r['file']}` | {r['lines']:,} ({r['budget']:,}) | {main} | {r.get('flags', '')} "
            f"| {r.get('plumbing', '')} |"
        )
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
        print(
            f"budgets: all within their limits (main() {MAIN_LINES} lines, {FLAGS} flags a script); plumbing/ imports "
            "no script; common.py is maths only"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
