"""CPU settings every script makes at start: threads, glibc's malloc, seeding, precision (docs/CPU.md says why)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from plumbing.flags import fail


def cpu_sample() -> tuple[float, float, float] | None:
    """(seconds the machine's CPUs have been busy, from /proc/stat; this process's CPU seconds; wall time), or None
    where /proc is missing (macOS, Windows). Two samples give how busy other processes were in between."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    return busy, time.process_time(), time.time()


def busy_between(before: tuple, after: tuple) -> float:
    """Cores other processes kept busy between two cpu_sample()s: the machine's busy time minus this process's."""
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / (after[2] - before[2]))


def busy_cores_elsewhere(seconds: float = 0.5) -> float | None:
    """How many cores other processes kept busy over the next `seconds`. None where /proc is missing."""
    before = cpu_sample()
    if before is None:
        return None
    time.sleep(seconds)
    return busy_between(before, cpu_sample())


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def reproducible_across_threads(environ=os.environ) -> bool:
    """Whether the numbers do not depend on the thread count: torch's BLAS is MKL, in its strict mode (MKL_CBWR, set
    by plumbing/__init__.py). Tested: 3 steps of each script on 1 and on 2 threads give the same metrics."""
    return torch.backends.mkl.is_available() and "STRICT" in environ.get("MKL_CBWR", "").upper()


def fixed_by_you(environ=os.environ) -> bool:
    """Whether you set the threads (STARPO_THREADS, or OMP_NUM_THREADS): then no policy here changes them."""
    return bool(environ.get("STARPO_THREADS") or environ.get("OMP_NUM_THREADS"))


def thread_policy(environ=os.environ, busy_elsewhere=busy_cores_elsewhere, started_with: int | None = None) -> str:
    """Choose torch's CPU threads at start and say what was chosen (the start-up line prints it).

    torch's default, one thread per core with OpenMP's spin-waiting, is fastest on an idle machine but collapses
    beside other jobs: threads that spin while waiting for a descheduled sibling make a step 3-4x slower than one
    thread (bench/results/threads_cpu.json). So: measure for half a second how many cores other processes keep
    busy, and use the cores this process may run on minus those (at least one). OMP_NUM_THREADS or
    STARPO_THREADS=N (a number, or 'off' to leave torch alone) override it. A resumed run starts on the count its
    run started with (started_with, from config.json); where the numbers do not depend on the count
    (reproducible_across_threads), the count then follows the load between steps (LoadFollower).
    """
    cores = usable_cores()
    forced = environ.get("STARPO_THREADS", "")
    if forced == "off" or (fixed_by_you(environ) and not forced):
        return f"{torch.get_num_threads()} (as set by the environment)"
    if forced:
        try:
            n = max(1, int(forced))
        except ValueError:
            fail("STARPO_THREADS", f"must be a number of threads or 'off', got {forced!r}")
        torch.set_num_threads(n)
        return f"{n} (STARPO_THREADS)"
    if started_with:
        n = max(1, min(cores, int(started_with)))
        torch.set_num_threads(n)
        return f"{n} of {cores} cores (as the run started)"
    busy = busy_elsewhere() if cores > 1 else None
    n = cores if busy is None else max(1, min(cores, round(cores - busy)))
    torch.set_num_threads(n)
    seen = "" if busy is None else f", other processes busy on {busy:.1f}"
    return f"{n} of {cores} cores{seen}"


class LoadFollower:
    """Re-choose the thread count at each step's end from what other processes used during the step: the machine's
    busy time (/proc/stat) minus this process's, as thread_policy measures it at start, but over the whole step and
    without a pause. A new count needs two step ends in a row that ask for it. Made by setup() only where the count
    was chosen automatically and the numbers do not depend on it (reproducible_across_threads)."""

    def __init__(self, cores: int):
        self.cores, self.wanted, self.busy, self.last = cores, None, 0.0, self.sample()

    sample = staticmethod(cpu_sample)

    def step_end(self) -> bool:
        """Set the thread count for the next step; True if it changed."""
        now, before = self.sample(), self.last
        self.last = now
        if now is None or before is None or now[2] - before[2] <= 0:
            return False
        self.busy = busy_between(before, now)
        want = max(1, min(self.cores, round(self.cores - self.busy)))
        changed = want != torch.get_num_threads() and want == self.wanted
        if changed:
            torch.set_num_threads(want)
        self.wanted = want
        return changed


follower: LoadFollower | None = None  # setup() makes it; Run calls follower.step_end() after every step


def keep_freed_memory(environ=os.environ, libc=None) -> bool:
    """Tell glibc's malloc to keep freed memory in the process instead of handing it back to the system.

    glibc serves a large block (the KV caches, the update's activations) with a fresh mmap and unmaps it when freed,
    so the next step's tensors land on new pages, each faulted in and zeroed by the kernel; on a virtual machine
    that returns freed pages to its host (this project's), the first touch costs more still. With mmap off
    (M_MMAP_MAX 0) and no trimming below 2 GiB free (M_TRIM_THRESHOLD), the process reuses its own heap: with the
    NaN fill off too (seed_everything), default steps 6% (FrozenLake), 7% (Sokoban) and 4% (bandit) faster, the same
    episodes bit for bit, peak memory up to 9% higher (bench/results/cpu_memory.json). A malloc setting of your own
    (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_) wins; without glibc
    (macOS, musl, Windows) nothing changes. Returns whether the setting was made.
    """
    if any(
        environ.get(k)
        for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
    ):
        return False
    if libc is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return False
    mallopt = getattr(libc, "mallopt", None)  # glibc only
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def seed_everything(seed: int, device: str | None = None) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device == "cpu":  # bit-for-bit reproducible CPU runs (resume == uninterrupted, tested): without this the
        torch.use_deterministic_algorithms(True)  # backward of an index with repeats sums in thread order
        # ... but not its debugging aid, which writes NaN into every new tensor before use (each KV-cache buffer,
        # every activation): 2.5% of a FrozenLake step (bench/results/cpu_memory.json). Nothing reads memory it did
        # not write, so the results are the same bits (the resume tests; the benchmark's runs play the same episodes).
        torch.utils.deterministic.fill_uninitialized_memory = False


def resolve_precision(precision: str, device: str) -> str:
    """--precision auto -> "bf16" on a CUDA device that supports it, else "fp32"; "bf16" and "fp32" pass through.

    A CPU stays in float32 unless you ask: on this project's 2-core Xeon (AMX-BF16) bf16 made the tiny model's update
    2.2x and a turn's generation 1.8x faster in isolation, yet 20 real FrozenLake training steps took 10.6 s each in
    bf16 against 10.4 s in float32, and the bandit's 0.79 s against 0.86 s (bench/results/cpu_bf16.json,
    frozenlake_20steps_*.json, bandit_cpu*.json). CPUs without AMX-BF16 or AVX512-BF16 emulate bf16, slower still.
    """
    if precision != "auto":
        return precision
    return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def setup(device: str, precision: str, resume_from=None) -> tuple[str, str]:
    """What a script does first, before any model work: on a CPU, glibc keeps freed memory (keep_freed_memory) and
    torch's threads are chosen (thread_policy: a resumed run's from its config.json); --precision auto is resolved;
    transformers' progress bars go quiet (the run's own bar is the one that counts). Returns (threads, precision)
    for the start-up line."""
    import json

    import transformers

    global follower
    threads, follower = "torch's default", None
    if device == "cpu":
        keep_freed_memory()  # glibc reuses freed memory: no fresh pages to fault in every step
        config = Path(resume_from).parent.parent / "config.json" if resume_from else None
        started_with = json.loads(config.read_text()).get("threads") if config and config.exists() else None
        threads = thread_policy(started_with=started_with)
        if not fixed_by_you() and reproducible_across_threads():  # chosen here, and the numbers do not change
            follower = LoadFollower(usable_cores())
    precision = resolve_precision(precision, device)
    transformers.utils.logging.disable_progress_bar()
    return threads, precision
