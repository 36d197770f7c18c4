"""What fits a GPU: the update's activation memory, measured on the CPU for Qwen2.5-0.5B's architecture (random
weights built from its config, no download), and from it a plan for Qwen2.5 0.5B / 1.5B / 3B / 7B on 24 GB and 80 GB.

    python bench/memory_plan.py                      # measure, then the plan: bench/results/memory_plan.json
    python bench/memory_plan.py --tokens 128 256     # other row lengths for the measurement (default 64 128)

Measured (one row of T tokens, the last half of them trained, as a reply is; --precision bf16 as on a GPU):
  * body: the bytes autograd keeps for the backward pass of the decoder (saved-tensor hooks, each storage once), per
    token; with --gradient-checkpointing the bytes left plus each layer's input, which checkpointing keeps;
  * head: per trained token, what the LM head and the loss keep (the scripts give logits to trained tokens only:
    float32 logits, their log-softmax and the entropy's softmax, over a 151,936-word vocabulary).
Both are linear in the tokens (two lengths are measured and the slope is reported; attention keeps O(T) with the
fused kernels). The plan adds what does not depend on the batch: float32 master weights (4 bytes a parameter),
gradients and AdamW's two moments for what trains (12 bytes), the backward pass's transient gradients of a trained
vocabulary table (table_transient), a critic for GAE (its own copy), the vLLM engine's
share of the card (--vllm-gpu-memory-utilization, 0.4), and prices one micro-batch of rows at the longest a row can
be (--max-model-len 3600, 2,000 of them trained: 5 turns of 400): the worst case, which is what runs out of memory.
Computed, not measured on a GPU: bench/gpu_smoke.py measures the first rows when a GPU is lent.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import common  # noqa: E402
from harness import machine, write_result  # noqa: E402

# Qwen2.5 instruct models' architectures (their config.json files): hidden, MLP, layers, heads, KV heads, vocab, tied
QWEN = {
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
}
ROW_TOKENS, ROW_TRAINED = 3600, 2000  # the longest row (--max-model-len) and its trained tokens (5 turns x 400)
GIB = 2**30


def qwen_config(name: str):
    from transformers import Qwen2Config

    h, mlp, layers, heads, kv, vocab, tied = QWEN[name]
    return Qwen2Config(
        hidden_size=h, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
    )  # fmt: skip


def parameters(name: str) -> dict:
    """Parameter counts from the architecture, built on the meta device (no memory): the whole model, and what a
    critic's body and rank-64 LoRA adapters on every decoder linear layer add."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen_config(name))
    total = sum(p.numel() for p in model.parameters())
    body = sum(p.numel() for p in model.base_model.parameters())
    linear = [m for n, m in model.base_model.named_modules() if isinstance(m, torch.nn.Linear)]
    lora64 = sum(64 * (m.in_features + m.out_features) for m in linear)
    return {"total": total, "body": body, "lora_r64": lora64}


class SavedBytes:
    """Bytes autograd saves for the backward pass while active, each storage counted once."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def measure(model, tokens: int, precision: str, checkpointing: bool) -> dict:
    """One row of `tokens` tokens, its second half trained: saved bytes in the decoder and in the head + loss."""
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    trained = torch.zeros(1, tokens - 1, dtype=torch.bool)
    trained[:, tokens // 2 :] = True
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    model.zero_grad(set_to_none=True)
    t0 = time.time()
    with autocast, SavedBytes() as body:
        h = model.base_model(input_ids=ids).last_hidden_state  # (1, T, H)
    with autocast, SavedBytes() as head:  # as the multi-turn scripts' policy_forward
        logits = model.get_output_embeddings()(h[:, :-1][trained]).float()  # (M, V)
        logp = common.token_logprobs(logits[None], ids[:, 1:][trained][None], 1.0)[0]
        entropy = common.entropy_from_logits(logits)
        loss = -(logp.mean() + 0.001 * entropy.mean())
    loss.backward()
    kept = body.total
    if checkpointing:  # each checkpointed layer keeps its input (the residual stream, float32), outside the hooks
        kept += cfg.num_hidden_layers * tokens * cfg.hidden_size * h.element_size()
    return {
        "tokens": tokens,
        "trained_tokens": int(trained.sum()),
        "body_bytes": kept,
        "head_bytes": head.total,
        "seconds": round(time.time() - t0, 1),
    }


def per_token(a: dict, b: dict) -> tuple[float, float]:
    """Slopes between two lengths: body bytes per token, head bytes per trained token."""
    body = (b["body_bytes"] - a["body_bytes"]) / (b["tokens"] - a["tokens"])
    head = (b["head_bytes"] - a["head_bytes"]) / (b["trained_tokens"] - a["trained_tokens"])
    return body, head


OPTIONS = (  # tried in this order: the first that fits one row sets the command
    ("", False, False),
    (" --gradient-checkpointing", True, False),
    (" --vllm-sleep", False, True),
    (" --gradient-checkpointing --vllm-sleep", True, True),
)


def table_transient(vocab: int, hidden: int, trained: bool) -> int:
    """Bytes a backward pass holds for a trained vocabulary table beyond its gradient: the LM head's and the
    embedding's float32 gradients of the tied table and their sum, while the accumulated gradient exists (3 tables;
    bench/rehearsal.py measured the update 18% over the plan without them, RESULTS 2026-12-07 (rehearsal)). LoRA
    freezes the table: none."""
    return 3 * vocab * hidden * 4 if trained else 0


def plan(measured: dict, card_gib: float, utilization: float = 0.4) -> list[dict]:
    """For each model, full or LoRA (rank 64), GAE (a critic) or GRPO: the fixed memory, one worst-case row's
    activations, and the most such rows per micro-batch beside the vLLM engine: awake (0.4 of the card) or asleep
    during the update (--vllm-sleep: its weights in CPU memory, its KV cache freed), with or without
    --gradient-checkpointing (which keeps each layer's input and, while one layer is recomputed, that layer's)."""
    out = []
    layers0 = QWEN["0.5B"][2]
    for name in QWEN:
        n = parameters(name)
        h, _, layers, _, _, vocab, _ = QWEN[name]
        scale = (h * layers) / (QWEN["0.5B"][0] * layers0)  # activations grow with hidden size x layers
        for lora in (False, True):
            for critic in (True, False):
                models = n["total"] + (n["body"] if critic else 0)
                trains = n["lora_r64"] * (2 if critic else 1) if lora else models
                fixed = 4 * models + 12 * trains + 2 * models  # fp32 weights; grads + AdamW; autocast's bf16 copies
                fixed += table_transient(vocab, h, not lora)  # the update's, whatever the batch
                plain, head = measured["bf16"]
                ckpt = measured["bf16_checkpointed"][0] + plain / layers0  # + the layer being recomputed
                per_row = {
                    False: plain * scale * (2 if critic else 1) * ROW_TOKENS + head * ROW_TRAINED,
                    True: ckpt * scale * (2 if critic else 1) * ROW_TOKENS + head * ROW_TRAINED,
                }
                fits = {}
                for flags, checkpointing, asleep in OPTIONS:
                    free = card_gib * GIB * (1 if asleep else 1 - utilization) - fixed
                    fits[flags.strip() or "as is"] = max(0, int(free // per_row[checkpointing]))
                chosen = next(((f, k) for f, k in zip(OPTIONS, fits.values()) if k >= 1), None)
                command = None
                if chosen:
                    (flags, _, _), k = chosen
                    command = (
                        f"python starpo_sokoban.py --model Qwen/Qwen2.5-{name}-Instruct"
                        + (" --lora-rank 64" if lora else "") + ("" if critic else " --estimator grpo")
                        + f" --micro-batch-size {min(k, 32)}" + flags
                    )  # fmt: skip
                out.append({
                    "model": name, "card_gib": card_gib, "lora_r64": lora, "critic": critic,
                    "params": n["total"], "trained_params": trains, "fixed_gib": round(fixed / GIB, 1),
                    "vllm_awake_gib": round(card_gib * utilization, 1),
                    "row_gib": {"plain": round(per_row[False] / GIB, 2), "checkpointed": round(per_row[True] / GIB, 2)},
                    "rows_per_micro_batch": fits,
                    "command": command,
                })  # fmt: skip
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs=2, default=[64, 128], help="two row lengths to measure")
    ap.add_argument("--model", default="0.5B", choices=list(QWEN), help="the architecture to measure")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory_plan.json"))
    a = ap.parse_args(argv)
    from transformers import Qwen2ForCausalLM

    load = os.getloadavg()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen_config(a.model))  # random weights, float32 master copy as the scripts keep
    runs, measured = {}, {}
    for precision in ("fp32", "bf16"):
        for ckpt in (False, True):
            key = precision + ("_checkpointed" if ckpt else "")
            runs[key] = [measure(model, t, precision, ckpt) for t in a.tokens]
            measured[key] = per_token(*runs[key])
            print(f"{key}: {measured[key][0] / 1024:.1f} KiB per token (body), "
                  f"{measured[key][1] / 1024:.1f} KiB per trained token (head)", flush=True)  # fmt: skip
    result = {
        "command": "python bench/memory_plan.py" + (f" --tokens {a.tokens[0]} {a.tokens[1]}" if a.tokens != [64, 128] else ""),
        "measured_on": f"Qwen2.5-{a.model} architecture, random weights, CPU (torch {torch.__version__})",
        "runs": runs,
        "bytes_per_token": {k: {"body": round(v[0]), "head_per_trained": round(v[1])} for k, v in measured.items()},
        "workload": f"one row of {ROW_TOKENS} tokens, {ROW_TRAINED} trained; vLLM at 0.4 of the card",
        "plan_24gb": plan(measured, 24),
        "plan_80gb": plan(measured, 80),
        "machine": machine(load),
    }  # fmt: skip
    write_result(a.out, result)
    for card in ("plan_24gb", "plan_80gb"):
        for r in result[card]:
            print(card, r["model"], "lora" if r["lora_r64"] else "full", "gae" if r["critic"] else "grpo",
                  r["fixed_gib"], r["row_gib"], r["rows_per_micro_batch"], r["command"])  # fmt: skip


if __name__ == "__main__":
    main()
