"""The machinery behind the StarPO scripts: what makes them run fast, resumably, on a laptop or a GPU.

A learner reads the scripts (task + algorithm) and common.py (the maths); this package is read like a library.
It never imports a script: a script hands in what it owns (its Args, presets, warm-up examples) as arguments.

    flags.py    Args dataclass -> kebab-case flags, grouped --help, the checks every script shares (torch-free)
    engine.py   the CPU generation engine: a KV-cache sampling loop with vllm_generate's call shape
    forward.py  the update's prompt-sharing forward pass and like-length micro-batches
    update.py   the update's loops: micro-batches and their weights, the optimizer step, the on-policy shortcut
    lora.py     LoRA: the adapter layer, adding and switching off adapters, the merged weights, checkpoints' adapters
    dist.py     torchrun: each process's block of groups, the gather, the gradient sum
    run.py      run directory, metrics files, checkpoints and resume, signals, timers, echo-trap warnings
    cpu.py      threads, glibc's malloc, seeding, precision
    tiny.py     the embedded tiny models' build, and the world-model warm-up
    report.py   report.html (`python -m plumbing.report RUN_DIR` rebuilds it)
    judge.py    LM judges in the rubric: the judge component, local and HTTP judges, judge_cache.jsonl
"""

import os

# Same numbers whatever the threads: by default MKL splits a matrix product's long inner dimension among threads, so
# the weight gradients' last bits depend on the thread count (the forward pass does not). MKL's strict mode fixes the
# order on any thread count, on the fastest code path for the CPU (AUTO; measured no slower here). MKL reads it once,
# at its first call: the scripts import plumbing before torch. Your own MKL_CBWR wins. (docs/CPU.md, "Threads")
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
