"""Run management: the run directory, metrics files, checkpoints and resume, Ctrl-C / SIGTERM, timers, the progress
bar and the collapse warnings: everything in a script's main() that is not the algorithm.

checkpoints/step-000040/ holds policy/ (a save_pretrained model + tokenizer, loadable on its own; under LoRA the
adapters alone, policy/adapters.pt, which tools/merge_lora.py folds into a model of their own), state.pt (critic,
optimizers, RNG states, step, history) and COMPLETE, written last. It is built under a temporary name and renamed
into place, so a crash mid-save never leaves a half checkpoint that looks whole.

Under torchrun only rank 0 writes (files, report, checkpoints, printed lines); the others read a checkpoint to resume.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from plumbing import cpu, dist
from plumbing.lora import ADAPTERS, adapter_state, load_adapters
from plumbing.flags import fail
from plumbing.report import build_report, read_jsonl


LOGS = ("metrics.jsonl", "rollouts.jsonl", "groups.jsonl", "collapse.jsonl")  # a run's jsonl files, one line per step
# the metrics collapse_warnings reads, kept per step in Run.history (and in checkpoints, so a resume keeps them)
HISTORY_KEYS = (
    "step",
    "rollout/in_group_std",
    "actor/grad_norm",
    "collapse/mi_zscore_ema",
    "collapse/marginal_std_ema",  # the z-score's running std: the next measurement continues from it
    "collapse/marginal_std_ema_seq",
    "collapse/retrieval_accuracy",
    "collapse/retrieval_chance_level",
    "judge/agreement",
    "val/success",
)


class Metrics:
    """Appends one JSON object per line to `path` (flushed every write so a crashed run keeps its history)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8") if dist.is_main() else None  # torchrun: rank 0 writes

    def write(self, record: dict) -> None:
        if self._f is None:
            return
        # numpy / torch scalars and arrays as plain numbers and lists (groups.jsonl and collapse.jsonl hold lists)
        clean = {
            k: (v.tolist() if isinstance(v, (np.generic, np.ndarray, torch.Tensor)) else v) for k, v in record.items()
        }
        self._f.write(json.dumps(clean, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def prepare_run_dir(out_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run. Refuses to mix two runs in one directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not dist.is_main():  # torchrun: rank 0 checks and clears the folder; the others only find the checkpoint
        return latest_checkpoint(out_dir) if resume else None
    has_run = (out_dir / "metrics.jsonl").exists() or (out_dir / "checkpoints").exists()
    if resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            fail("--resume", f"no complete checkpoint under {out_dir / 'checkpoints'}")
        return ckpt
    if has_run and not overwrite:
        fail(
            "--output-dir", f"{out_dir} already holds a run; pass --resume to continue it or --overwrite to replace it"
        )
    for name in (*LOGS, "report.html", "config.json"):
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    shutil.rmtree(out_dir / "warmup", ignore_errors=True)
    return None


def _load_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)  # weights_only: a checkpoint cannot run code


def latest_checkpoint(out_dir: Path) -> Path | None:
    """Newest complete checkpoint; torn or partial ones are skipped with a warning."""
    root = Path(out_dir) / "checkpoints"
    for ckpt in sorted(root.glob("step-*"), reverse=True) if root.exists() else []:
        try:
            policy = ckpt / "policy"
            if not (ckpt / "COMPLETE").exists() or not any((policy / f).exists() for f in ("config.json", ADAPTERS)):
                raise ValueError("incomplete")
            _load_state(ckpt / "state.pt")
            return ckpt
        except Exception as e:  # noqa: BLE001 - any damage means: do not resume from this one
            print(f"warning: skipping damaged checkpoint {ckpt} ({type(e).__name__}: {e})", file=sys.stderr)
    return None


def rng_state(*generators: torch.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": [torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
        "generators": [g.get_state() for g in generators],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, *generators: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(tuple(x.numpy() if torch.is_tensor(x) else x for x in state["numpy"]))
    torch.set_rng_state(state["torch"])
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, step: int, policy, tok, state: dict, keep: int = 2) -> Path:
    """Write checkpoints/step-<step> atomically and keep only the newest `keep` checkpoints."""
    root = Path(out_dir) / "checkpoints"
    final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    adapters = adapter_state(policy)
    if adapters:  # LoRA: the frozen base is the run's model_path (config.json); the adapters are all that moved
        (tmp / "policy").mkdir(parents=True)
        torch.save(adapters, tmp / "policy" / ADAPTERS)
    else:
        policy.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    torch.save(state, tmp / "state.pt")
    (tmp / "COMPLETE").write_text(f"{step}\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint_state(ckpt: Path) -> dict:
    return _load_state(Path(ckpt) / "state.pt")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of a metrics/rollouts file up to `last_step` (and drop a torn last line): on resume, the
    steps after the checkpoint are run again, so they must not appear twice."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to checkpoint and stop at the next step boundary; a second Ctrl-C stops now."""

    def __init__(self):
        self.requested: str | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(
            f"\n{self.requested}: finishing this step, then saving a checkpoint and stopping "
            "(press Ctrl-C again to stop at once)",
            file=sys.stderr,
        )


#### The run: everything in main() that is not the algorithm ##########################################################


class Run:
    """Start or resume a run, and after every step write its metrics, checkpoint it, and stop cleanly on a signal.

    main() builds the models, then hands this object what a checkpoint must hold; from there main() reads as the
    algorithm (rollout -> filter -> old log-probs -> advantages -> update -> log) and this object does the rest:
      * start: config.json (fresh run), or resume: optimizer / critic / RNG state back, the jsonl files cut back
        to the checkpoint's step, time_s continuing where it stopped;
      * per step: phase timers (`with run.timer("gen"):`), the collapse warnings, metrics.jsonl, report.html after
        every evaluation (and every evaluation printed), the progress bar, the non-finite-update guard,
        checkpoints every --save-every steps, and the Ctrl-C / SIGTERM stop with a copy-pasteable resume command.
    """

    def __init__(self, args, task: str, resume_from: Path | None, policy, tok, state: dict, config: dict):
        """state: what a checkpoint holds besides the policy, by name: optimizers, the critic (None: nothing),
        torch.Generators (saved with the RNG states). config: extra entries for config.json (device, backend and
        precision as resolved replace the flags' "auto"; any other entry must not share a flag's name, or --resume
        would read it back as that flag)."""
        self.args, self.script, self.policy, self.tok = args, f"starpo_{task}.py", policy, tok
        self.settings = config["settings"]  # the script's SETTINGS: what no flag changes
        judged = config.get("judged") or {}  # judge components the rubric rewards: their curves, for the warnings
        self.history_keys = (*HISTORY_KEYS, *(f"rubric/{name}" for name in judged.get("rewarded", ())))
        if policy is not None:
            write_line(parameter_line(policy, state.get("critic")))
        if config.get("backend") == "vllm":  # vLLM's CPU kernels run in this process on threads of their own choosing
            cpu.follower = None
        self.generators = [v for v in state.values() if isinstance(v, torch.Generator)]
        self.state = {k: v for k, v in state.items() if v is not None and not isinstance(v, torch.Generator)}
        self.out_dir = Path(args.output_dir)
        self.resume_from = resume_from
        self.start_step, self.history, self.warned, self.skipped_in_a_row, self.time_before = 1, [], set(), 0, 0.0
        self.empty_in_a_row, self.stopped_at = 0, None  # steps in a row whose filter kept no group; an early stop
        if resume_from is None and dist.is_main():
            config = dict(config, threads=torch.get_num_threads(), processes=dist.world())  # a resume starts on these
            (self.out_dir / "config.json").write_text(json.dumps(dict(dataclasses.asdict(args), **config), indent=1))
        elif resume_from is not None:
            saved = load_checkpoint_state(resume_from)
            if (resume_from / "policy" / ADAPTERS).exists():  # LoRA: the base model loaded, its adapters load here
                try:
                    load_adapters(policy, resume_from / "policy" / ADAPTERS)
                except ValueError as e:
                    fail("--resume", str(e))
            for name, obj in self.state.items():
                obj.load_state_dict(saved[name])
            set_rng_state(saved["rng"], *self.generators)
            self.start_step, self.history = saved["step"] + 1, saved["history"]
            self.warned, self.skipped_in_a_row = set(saved["warned"]), saved["skipped_in_a_row"]
            self.empty_in_a_row = saved.get("empty_in_a_row", 0)
            self.time_before = float(saved.get("time_s", 0.0))
            for name in LOGS if dist.is_main() else ():  # the steps after the checkpoint will be run again
                truncate_jsonl(self.out_dir / name, saved["step"])
            write_line(f"resumed from {resume_from} at step {saved['step']}")
        self.metrics, self.rollouts, self.groups, self.collapse = (Metrics(self.out_dir / name) for name in LOGS)
        self.stop = GracefulStop()
        self.t_start = time.time()
        self.timings: dict[str, float] = {}
        self._running: list[str] = []
        self.memory: dict[str, float] = {}  # each phase's peak resident memory this step (GB)
        self.peak_gb = 0.0  # the process's, so far
        self.last_val = float("nan")
        self.bar = None

    @property
    def fresh(self) -> bool:
        return self.resume_from is None

    def time_s(self) -> float:
        """Seconds of this run so far, earlier segments (before a resume) included."""
        return self.time_before + time.time() - self.t_start

    def timer(self, name: str):
        """`with run.timer("update"):` adds the block's seconds to timing_s/update. Time inside `eval` counts only
        there (evaluation generates too, and that is not training-rollout generation)."""
        run = self

        class _Timer:
            def __enter__(self):
                run._fold_memory()
                self.t = time.time()
                run._running.append(name)

            def __exit__(self, *exc):
                run._fold_memory()
                run._running.pop()
                if not run._running:  # a phase's freed memory goes back to the system before the next phase
                    release_memory()
                if "eval" not in run._running:
                    run.timings[name] = run.timings.get(name, 0.0) + time.time() - self.t

        return _Timer()

    def _fold_memory(self) -> None:
        """memory_gb/<phase>: the peak resident memory since the last timer boundary counts for every phase running
        (Linux: /proc's high-water mark, reset at each boundary; elsewhere nothing is measured). Inside `eval`, only
        eval and the phases around it count (as with the timings). The resets hide the run's peak from tools that
        read the high-water mark at exit (`/usr/bin/time -f %M`): read memory_gb/peak instead."""
        gb = peak_rss_gb(reset=True)
        if gb is not None:
            self.peak_gb = max(self.peak_gb, gb)
            running = self._running
            for name in running[: running.index("eval") + 1] if "eval" in running else running:
                self.memory[name] = max(self.memory.get(name, 0.0), gb)

    def eval_due(self, step: int) -> bool:
        return step == self.args.steps or bool(self.args.eval_every and step % self.args.eval_every == 0)

    def write_rollouts(self, records) -> None:
        for r in records:
            self.rollouts.write(r)

    def log_groups(self, step: int, values: list, kept: list) -> None:
        """One line of groups.jsonl: what the filter saw (every group's statistic) and kept, with its settings."""
        a = self.args
        self.groups.write(
            dict(
                step=step,
                stat=self.settings["filter_stat"],
                strategy=a.filter,
                value=a.keep_ratio,
                values=values,
                kept=kept,
            )
        )

    def log_collapse(self, step: int, row: dict) -> None:
        """One line of collapse.jsonl: the log-prob matrix behind the MI estimate (matrix, cols, prompts)."""
        self.collapse.write({"step": step, **row})

    def steps(self, desc: str):
        """The training steps still to run, under a progress bar; phase timers start afresh each step."""
        steps, kw = (
            range(self.start_step, self.args.steps + 1),
            dict(initial=self.start_step - 1, total=self.args.steps),
        )
        self.bar = tqdm_bar(steps, desc=desc, disable=not dist.is_main(), **kw)
        for step in self.bar:
            self.timings, self.memory, self.t_step = {}, {}, time.time()
            yield step
            if self.stopped_at:
                return

    def log_eval(self, step: int, val: dict, records) -> None:
        """Step 0's evaluation (before any update): its own metrics line, rollouts and a first report."""
        self.write_rollouts(records)
        self._fold_memory()
        release_memory()
        memory = {"memory_gb/peak": self.peak_gb} if self.peak_gb else {}
        self.metrics.write({"step": step, **val, **memory, "time_s": self.time_s(), "timestamp": time.time()})
        self._print_eval(step, val)
        if dist.is_main():
            build_report(self.out_dir)

    def _print_eval(self, step: int, record: dict) -> None:
        self.last_val = record["val/success"]
        shown = "  ".join(f"{k} {record[k]:.3f}" for k in ("val/success", "val/reward") if k in record)
        write_line(f"step {step}  {shown}")

    def end_step(self, step: int, record: dict, skipped: int) -> None:
        """Everything after the update: timers, warnings, metrics line, report, bar, guards, checkpoint, stop."""
        args = self.args
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.empty_in_a_row = self.empty_in_a_row + 1 if record.get("rollout/empty_after_filter") else 0
        record["rollout/consecutive_empty_after_filter_steps"] = self.empty_in_a_row
        timings = dict(self.timings)
        if "rollout" in timings:  # the rollout's time that was not generation: the environment and tokenising
            timings["env"] = timings.pop("rollout") - timings.get("gen", 0.0)
        record.update({f"timing_s/{k}": v for k, v in timings.items()})
        self._fold_memory()
        record.update({f"memory_gb/{k}": v for k, v in self.memory.items()})
        if self.peak_gb:
            record["memory_gb/peak"] = self.peak_gb
        self.history.append({k: v for k, v in record.items() if k in self.history_keys})
        if skipped:
            write_line(
                f"[step {step}] skipped {skipped} update(s): non-finite loss or gradient "
                f"({self.skipped_in_a_row} step(s) in a row)"
            )
        for kind, msg in collapse_warnings(self.history, self.warned):
            write_line(f"warning: {kind.replace('_', ' ')}: {msg} (step {step})")
            record[f"warn/{kind}"] = 1  # the report marks this step on the charts this kind concerns
        record["timing_s/step"] = time.time() - self.t_step
        if cpu.follower is not None and cpu.follower.step_end():  # the load changed: so do the threads
            write_line(
                f"[step {step}] threads: {torch.get_num_threads()} (other processes busy on {cpu.follower.busy:.1f})"
            )
        record["time_s"], record["timestamp"] = self.time_s(), time.time()
        self.metrics.write(record)
        if "val/success" in record:
            self._print_eval(step, record)
            if dist.is_main():
                build_report(self.out_dir)
        self.bar.set_postfix(
            {
                "succ": f"{record['train/success']:.2f}",
                "val": f"{self.last_val:.2f}",
                "std": f"{record['rollout/in_group_std']:.3f}",
                "ent": f"{record.get('actor/entropy', 0):.2f}",
            }
        )
        if dist.any_rank(bool(self.stop.requested)) and not self.stop.requested:  # torchrun: one signalled, all stop
            self.stop.requested = "SIGTERM"
        if self.skipped_in_a_row >= self.settings["max_skipped"]:
            fail(
                "stopped",
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient (SETTINGS['max_skipped']); "
                f"nothing saved. Last good checkpoint: {latest_checkpoint(self.out_dir) or 'none'}",
            )
        empty_stop = self.settings["empty_stop_steps"]
        if empty_stop and self.empty_in_a_row >= empty_stop:  # RAGEN-2's early stop
            self.stopped_at = step
            write_line(
                f"stopped after step {step}: the filter kept no group for {self.empty_in_a_row} steps in a row "
                f"(every group's rewards agreed: nothing left to learn from; SETTINGS['empty_stop_steps']); "
                f"checkpoint {self.checkpoint(step)}"
            )
        elif step == args.steps or (args.save_every and step % args.save_every == 0) or self.stop.requested:
            path = self.checkpoint(step)
            if self.stop.requested and step < args.steps:
                write_line(
                    f"stopped by {self.stop.requested} after step {step}; checkpoint {path}. Continue with: "
                    f"python {self.script} --resume --output-dir {self.out_dir}"
                )
                raise SystemExit(130 if self.stop.requested == "SIGINT" else 143)

    def checkpoint(self, step: int) -> Path:
        state = dict(
            step=step,
            rng=rng_state(*self.generators),
            history=self.history,
            warned=sorted(self.warned),
            skipped_in_a_row=self.skipped_in_a_row,
            empty_in_a_row=self.empty_in_a_row,
            time_s=self.time_s(),
        )
        state.update({name: obj.state_dict() for name, obj in self.state.items()})
        path = save_checkpoint(self.out_dir, step, self.policy, self.tok, state) if dist.is_main() else None
        dist.barrier()  # torchrun: the others wait for rank 0's checkpoint
        return path

    def finish(self, extra: str = "") -> None:
        """Close the files and print the final line: steps, time, last val/success, where the policy and report are."""
        for f in (self.metrics, self.rollouts, self.groups, self.collapse):
            f.close()
        if not dist.is_main():
            return dist.finish()
        evals = [r for r in read_jsonl(self.out_dir / "metrics.jsonl") if "val/success" in r]
        last = latest_checkpoint(self.out_dir)  # none when --steps 0
        write_line(
            f"done: {self.stopped_at or self.args.steps} steps in {self.time_s():.0f}s, final val/success "
            f"{evals[-1]['val/success']:.3f}{extra}; policy: {last / 'policy' if last else 'none saved'}; "
            f"report: {build_report(self.out_dir)}"
        )
        dist.finish()


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, looked up once; None elsewhere (macOS, musl, Windows)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Hand the memory freed so far back to the system (glibc's malloc_trim; elsewhere nothing). Without it a
    process keeps the heap its biggest phase grew (an evaluation's KV caches) resident for the rest of the run, and
    the next phase's allocations come on top of it."""
    if _malloc_trim() is not None:
        _malloc_trim()(0)


def peak_rss_gb(reset: bool = False) -> float | None:
    """This process's peak resident memory in GB (Linux's VmHWM), since it started or the last reset; reset: start
    counting afresh from the memory in use now. None where /proc has no such count (macOS, Windows)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
    except (OSError, StopIteration, ValueError):
        return None
    return kb / 2**20


def tqdm_bar(iterable, **kw):
    from tqdm import tqdm

    return tqdm(iterable, dynamic_ncols=True, **kw)


def parameter_line(policy, critic) -> str:
    """The start-up line that says what trains: the policy's (and critic's) trained and total parameters."""
    count = lambda net: (
        sum(p.numel() for p in net.parameters() if p.requires_grad),
        sum(map(torch.numel, net.parameters())),
    )
    line = "parameters: policy {:,} trained of {:,}".format(*count(policy))
    line += ", critic {:,} of {:,}".format(*count(critic)) if critic is not None else ""
    return line + (" (LoRA adapters)" if adapter_state(policy) else " (full fine-tuning)")


def write_line(text: str) -> None:
    """Print above the progress bar (tqdm.write), so the bar stays on the last line."""
    from tqdm import tqdm

    if dist.is_main():  # torchrun: one process speaks
        tqdm.write(text)


def collapse_warnings(history: list[dict], warned: set) -> list[tuple[str, str]]:
    """RAGEN's collapse markers, as (kind, message) pairs: end_step prints each ("warning: echo trap: ...") and sets
    warn/<kind> to 1 on that step, and the report marks the step on the charts of that kind only. history: one dict
    per step with HISTORY_KEYS (a key is absent on a step that did not log it); warned: the once-per-run kinds that
    already fired (updated here). Three kinds:

    * echo_trap: the in-group reward std collapses (RAGEN: it falls first, then the entropy). From step 20, when the
      mean in-group std over the last 10 steps falls below a quarter of its best mean over 10 earlier steps (a
      window that ends before the last 10 begin); once per run. Ten steps, because one step's std is the mean of a
      few groups: on Sokoban two batches in a row where every group happened to agree are common, and a 3-step
      window fired on them in 7 of 9 healthy runs (docs/RESULTS.md, 2026-12-06 (warnings)). It also fires on
      convergence (every reply the same and right): check val/success, which an echo trap makes fall.
    * gradient_spike: the gradient norm exceeds 5x the median of the previous 10 non-zero norms (from 6 on), RAGEN's
      point of no return; every time. A norm of 0 is a step with nothing to learn (every group agreed: no update),
      so it neither counts nor sets the median. One spike alone is often harmless: see whether val/success holds.
    * template_collapse: the reasoning stops depending on the prompt. Over the steps that carry
      collapse/mi_zscore_ema, once at least 4 measurements exist, when the mean of the last 2 is below 30% of the
      best earlier value (before those 2) and that best value exceeds 0.5; once per run.
    * reward_hacking: a judge component the rubric rewards keeps rising while the judge's agreement with the truth or
      val/success falls: the policy pleases the judge instead of doing the task. From 20 steps of its curve, when its
      mean over the last 10 steps exceeds its mean over the 10 before by more than 0.05 and either judge/agreement's
      mean fell by more than 0.05 between the same windows or the last val/success is more than 0.05 under the best
      earlier one; once per run. (history carries rubric/<name> only for the rewarded judge components.)
    """
    out = []
    stds, W = [v for h in history if math.isfinite(v := h.get("rollout/in_group_std", math.nan))], 10
    if len(stds) >= 2 * W and "echo_trap" not in warned:
        best = max(statistics.mean(stds[i : i + W]) for i in range(len(stds) - 2 * W + 1))
        recent = statistics.mean(stds[-W:])
        if best > 0 and recent < 0.25 * best:
            warned.add("echo_trap")
            why = f"in-group reward std collapsed (mean over 10 steps {best:.3f} -> {recent:.3f}), or the policy converged"
            out.append(("echo_trap", why + "; check val/success"))
    norms = [v for h in history if math.isfinite(v := h.get("actor/grad_norm", math.nan)) and v > 0]
    now = history[-1].get("actor/grad_norm", math.nan) if history else math.nan  # absent on a skipped step
    if len(norms) >= 6 and math.isfinite(now) and now > 0:
        med = statistics.median(norms[-11:-1])
        if med > 0 and norms[-1] > 5 * med:
            why = f"gradient norm {norms[-1]:.3g} is over 5x the median of the last 10 non-zero ones ({med:.3g})"
            out.append(("gradient_spike", why + "; see whether val/success holds"))
    mi = [h for h in history if math.isfinite(h.get("collapse/mi_zscore_ema", math.nan))]
    if len(mi) >= 4 and "template_collapse" not in warned:
        best = max(mi[:-2], key=lambda h: h["collapse/mi_zscore_ema"])
        top, recent = best["collapse/mi_zscore_ema"], statistics.mean(h["collapse/mi_zscore_ema"] for h in mi[-2:])
        if top > 0.5 and recent < 0.3 * top:
            warned.add("template_collapse")
            acc, chance = (mi[-1].get(f"collapse/retrieval_{k}", math.nan) for k in ("accuracy", "chance_level"))
            fell = f"MI z-score (EMA) fell from {top:.2f} (step {best.get('step', '?')}) to {recent:.2f}"
            why = f"the reasoning stops depending on the prompt (retrieval {acc:.2f} vs chance {chance:.2f})"
            out.append(("template_collapse", f"{fell}; {why}"))
    for key in sorted({k for h in history for k in h if k.startswith("rubric/")}):
        if "reward_hacking" in warned:
            break
        window = [h for h in history if math.isfinite(h.get(key, math.nan))][-2 * W :]
        if len(window) < 2 * W:
            continue
        rose = (statistics.mean(h[key] for h in window[:W]), statistics.mean(h[key] for h in window[W:]))
        agreed = [[h.get("judge/agreement", math.nan) for h in part] for part in (window[:W], window[W:])]
        agreed = [statistics.mean(a) if all(map(math.isfinite, a)) else math.nan for a in agreed]
        vals = [v for h in history if math.isfinite(v := h.get("val/success", math.nan))]
        fell_agree = agreed[0] - agreed[1] > 0.05
        fell_val = len(vals) >= 2 and max(vals[:-1]) - vals[-1] > 0.05
        if rose[1] - rose[0] > 0.05 and (fell_agree or fell_val):
            warned.add("reward_hacking")
            why = [f"agreement with the truth {agreed[0]:.2f} -> {agreed[1]:.2f}"] if fell_agree else []
            why += [f"val/success {max(vals[:-1]):.2f} -> {vals[-1]:.2f}"] if fell_val else []
            name = key.removeprefix("rubric/")
            msg = f"the judged {name} rose {rose[0]:.2f} -> {rose[1]:.2f} while {' and '.join(why)} fell"
            out.append(("reward_hacking", msg + ": the policy may be pleasing the judge, not doing the task"))
    return out
