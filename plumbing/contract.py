"""What plumbing/ reads of a script, by name, in one place: the fields of its Args, the entries of its SETTINGS, and
the fields of its Trajectory and Turn. A script checks them at start-up (`check`, first thing in resolve_args), so a
fork that renames one (`n_groups`, `t.turns`) learns it in one line before any model loads, not deep in a step.
tests/test_contract.py keeps this list whole: it scans plumbing/ for the Args fields it reads.
"""

from __future__ import annotations

import dataclasses
import os
import sys

# Args fields, and the plumbing module that reads each (flags.py: the checks every script shares and resolve_run).
ARGS = {
    **dict.fromkeys(("model", "resume", "output_dir", "device", "backend", "preset", "algo", "overwrite"), "flags.py"),
    **dict.fromkeys(("n_groups", "group_size", "estimator", "keep_ratio", "filter", "lr", "critic_lr"), "flags.py"),
    **dict.fromkeys(("kl_coef", "top_p", "max_tokens", "max_model_len", "val_size", "val_samples"), "flags.py"),
    **dict.fromkeys(("ppo_epochs", "mini_batch_size", "micro_batch_size", "lora_rank", "tis_cap"), "flags.py"),
    **dict.fromkeys(("vllm_sleep", "vllm_gpu_memory_utilization", "request_seeds", "mi_every"), "flags.py"),
    **dict.fromkeys(("judge", "judge_model_id", "rubric_norm"), "flags.py"),
    **dict.fromkeys(("steps", "eval_every", "save_every", "sample_every"), "run.py"),
    **dict.fromkeys(("seed",), "run.py"),
}
MULTI_TURN_ARGS = {  # and those flags.multi_turn_checks reads of the multi-turn scripts
    **dict.fromkeys(("max_turns", "max_actions_per_turn", "max_actions_per_traj", "max_context_turns"), "flags.py"),
    **dict.fromkeys(("gigpo_history", "gigpo_omega", "rollout_reuse"), "flags.py"),
}
SETTINGS = {
    "temperature": "collapse.py",
    "max_skipped": "run.py",
    "filter_stat": "run.py",
    "empty_stop_steps": "run.py",
}
# Trajectory and Turn fields (or properties) of each kind of script: multi-turn (FrozenLake, Sokoban) and one-turn
# (the bandit), and the plumbing module that reads each (metrics.py: the logged statistics; report.py: rollouts.jsonl).
MULTI_TURN = {
    "Trajectory": {
        **dict.fromkeys(("seed", "score", "success", "turns"), "report.py"),
        **dict.fromkeys(("parts", "num_actions", "context_overflow", "truncated", "ids"), "metrics.py"),
        **dict.fromkeys(("turn_start", "turn_last_index"), "metrics.py"),
    },
    "Turn": {
        **dict.fromkeys(("state", "before", "after", "text", "world", "answer", "actions", "payout"), "report.py"),
        **dict.fromkeys(("reward", "parts"), "report.py"),
        **dict.fromkeys(("think", "had_invalid", "infos"), "metrics.py"),
    },
}
ONE_TURN = {
    "Trajectory": {
        **dict.fromkeys(("seed", "score", "parts", "turn", "state", "view"), "report.py"),
        **dict.fromkeys(("context_overflow", "truncated", "prompt_ids", "reply_ids"), "metrics.py"),
    },
    "Turn": {
        **dict.fromkeys(("text", "answer", "payout"), "report.py"),
        **dict.fromkeys(("think", "info"), "metrics.py"),
    },
}


def names(cls) -> set[str]:
    """A class's dataclass fields, attributes and properties."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return fields | set(dir(cls))


def missing(args_cls, settings: dict, classes: dict, kind: dict) -> list[str]:
    """One line per name plumbing reads that the script lacks (an empty list: the script keeps the contract)."""
    out = [
        f"Args has no field '{k}', which plumbing/{who} reads"
        for k, who in (ARGS if kind is ONE_TURN else ARGS | MULTI_TURN_ARGS).items()
        if k not in names(args_cls)
    ]
    out += [
        f"SETTINGS has no entry '{k}', which plumbing/{who} reads" for k, who in SETTINGS.items() if k not in settings
    ]
    for cls_name, wanted in kind.items():
        have = names(classes[cls_name])
        out += [
            f"{cls_name} has no field '{k}', which plumbing/{who} reads" for k, who in wanted.items() if k not in have
        ]
    return out


def check(args_cls, settings: dict, trajectory_cls, turn_cls, one_turn: bool = False) -> None:
    """Stop with one line on stderr (exit status 2) naming the first name plumbing reads that the script lacks."""
    kind = ONE_TURN if one_turn else MULTI_TURN
    problems = missing(args_cls, settings, dict(Trajectory=trajectory_cls, Turn=turn_cls), kind)
    if problems:
        script = os.path.basename(getattr(sys.modules[args_cls.__module__], "__file__", None) or args_cls.__module__)
        print(f"error: {script}: {problems[0]} (plumbing/contract.py lists what plumbing reads)", file=sys.stderr)
        raise SystemExit(2)
