"""Benchmark: one decode step's attention on this CPU, torch's kernel against common.decode_attention. (#16)

A decode step attends from one new token per row over the row's KV cache. Shapes are the FrozenLake default's
(64 rows, the tiny model's 4 query heads sharing 2 key/value heads of 64 dims); the keys and values are views into a
buffer with spare room, as append_in_place_cache keeps them, and a padding mask hides a few columns. For each dtype
and cache length: milliseconds per call of torch.nn.functional.scaled_dot_product_attention (what "sdpa_gqa" calls
for float32) and of common.decode_attention (what it calls for a bf16 decode step), and the largest difference of
each from a float32 reference. The scripts send only bf16 (and fp16) decode steps to decode_attention. For scale,
the machine's memory read rate (x.sum() over 512 MB of float32) and each call's rate over the bytes of its keys and
values: a decode step reads every cached key and value once, so that rate is its ceiling.

    python bench/decode_attention.py                           # -> bench/results/decode_attention.json
    python bench/decode_attention.py --reps 5 --out /tmp/d.json
"""

import argparse
import os
import sys
import time
from pathlib import Path

import harness

sys.path.insert(0, str(harness.ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="rows of the batch (episodes decoding together)")
    ap.add_argument("--lengths", default="300,700", help="cached tokens per row, comma-separated")
    ap.add_argument("--reps", type=int, default=100, help="timed calls of each variant (after 3 warm-up calls)")
    ap.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "decode_attention.json"))
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    load_start = os.getloadavg()

    import torch
    import torch.nn.functional as F

    import common

    threads = common.thread_policy()
    heads, kv_heads, d = 4, 2, 64  # the tiny models' attention
    variants = {
        "torch_sdpa": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        "decode_attention": common.decode_attention,
    }
    big = torch.ones(2**27)  # 512 MB of float32
    big.sum()
    t = time.perf_counter()
    for _ in range(5):
        big.sum()
    read_gb_s = round(5 * big.numel() * 4 / (time.perf_counter() - t) / 1e9, 1)
    del big
    print(f"memory read: {read_gb_s} GB/s", flush=True)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for length in lengths:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(a.rows, heads, 1, d, generator=gen).to(dtype)
            k, v = (
                torch.randn(a.rows, kv_heads, 2 * length, d, generator=gen).to(dtype)[:, :, :length] for _ in "kv"
            )  # views into a buffer twice as long
            mask = torch.ones(a.rows, 1, 1, length, dtype=torch.bool)
            mask[:, ..., :8] = False
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
            for name, fn in variants.items():
                for _ in range(3):
                    out = fn(q, k, v, mask)
                t = time.perf_counter()
                for _ in range(a.reps):
                    out = fn(q, k, v, mask)
                ms = (time.perf_counter() - t) / a.reps * 1e3
                kv_bytes = 2 * k.numel() * k.element_size()  # the keys and values a call must read
                row = {"dtype": str(dtype).replace("torch.", ""), "cached_tokens": length, "variant": name,
                       "ms_per_call": round(ms, 3), "kv_gb_s": round(kv_bytes / ms / 1e6, 1),
                       "max_abs_diff": float((out.float() - ref).abs().max())}  # fmt: skip
                rows.append(row)
                print(row, flush=True)

    flags = (
        Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0] if Path("/proc/cpuinfo").exists() else ""
    )
    result = {
        "benchmark": "decode_attention",
        "command": " ".join(["python bench/decode_attention.py", *(argv or sys.argv[1:])]),
        "setup": {
            "rows": a.rows,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": d,
            "reps": a.reps,
            "threads": threads,
            "torch": torch.__version__,
        },  # fmt: skip
        "memory_read_gb_s": read_gb_s,
        "results": rows,
        "cpu_bf16_flags": sorted(f for f in flags.split() if "bf16" in f or f.startswith("amx")),
        "machine": harness.machine(load_start),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
