"""Flags from a dataclass, without torch: `python starpo_X.py --help` answers before torch and transformers load.

Each script defines `Args` (one field per flag, its help text the docstring under it: the CleanRL / tyro convention),
`PRESETS` and `ALGOS` first, then calls `answer_help`, and only then imports torch, which takes seconds to load.
common.py re-exports parse_args, so the scripts call it as common.parse_args.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing


def _field_docs(cls) -> dict[str, str]:
    """The docstring written under each dataclass field (the CleanRL / tyro convention), read from the source."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the whole usage block; we print the one line that matters
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # a flag whose text already says its default gets no "(default: None)"
        if action.default is None and "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(cls, argv=None, description: str | None = None, presets: dict | None = None, algos: dict | None = None):
    """Turn a dataclass into kebab-case flags (field `group_size` -> `--group-size`) and parse argv into it.

    presets / algos: {name: {field: value}} (a script's PRESETS and ALGOS), shown in --help next to each field's
    default. The returned instance carries `given`, the set of fields set on the command line, so that a preset or
    a resumed run's config fills only the others (a flag you type always wins).
    """
    overrides = {f"--preset {k}": v for k, v in (presets or {}).items()} | {
        f"--algo {k}": v for k, v in (algos or {}).items()
    }

    def build(suppress: bool) -> argparse.ArgumentParser:
        parser = _OneLineParser(description=description, formatter_class=_DefaultsFormatter)
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            text = docs.get(f.name, " ")
            shown = [f"{name}: {p[f.name]}" for name, p in overrides.items() if f.name in p]
            if shown:
                text += " [" + "; ".join(shown) + "]"
            tp = hints[f.name]
            kw = {"default": argparse.SUPPRESS if suppress else f.default, "help": text.replace("%", "%%")}
            args = typing.get_args(tp)
            if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
                tp = next(a for a in args if a is not type(None))  # Optional[X] -> X
                args = typing.get_args(tp)
            if tp is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(tp) is typing.Literal:
                kw["choices"], kw["type"] = list(args), type(args[0])
            else:
                kw["type"] = tp
            parser.add_argument(flag, **kw)
        return parser

    args = cls(**vars(build(False).parse_args(argv)))
    args.given = frozenset(vars(build(True).parse_args(argv)))  # not a field: never saved in config.json
    return args


def answer_help(module_name: str, cls, description: str, presets: dict, algos: dict) -> None:
    """When a script runs with -h / --help, print its help and exit, before the script imports torch."""
    if module_name == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
        parse_args(cls, sys.argv[1:], description, presets, algos)  # argparse prints the help and exits
