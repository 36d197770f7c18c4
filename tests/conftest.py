"""Test setup: no network, a shared cache for the embedded tiny model, the repository root on sys.path."""

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["HF_HUB_OFFLINE"] = "1"  # the tests never touch the network
os.environ.setdefault("STARPO_CACHE", str(ROOT / ".cache" / "tiny"))  # built once, reused by every test and subprocess


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a learning run (minutes); still part of the CI suite")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped elsewhere")


# The keys of one turn in a multi-turn rollouts.jsonl record (rollout_record; the README's schema).
TURN_RECORD_KEYS = {"state", "view", "text", "think", "world", "answer", "actions", "env_reward", "score", "rubric"}


def run_script_file(script: str, *flags, timeout: float = 900, env_extra: dict | None = None):
    """Run one of the training scripts as a user would (a subprocess in the repository root); output captured."""
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, str(ROOT / script), *flags], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def tiny_qwen():
    """A random two-layer Qwen2 built from its config (no download): hidden 32, vocabulary 64, tied embeddings; the
    same weights on every call."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).eval()


# ---- a scripted "model": fixed replies, and a tokenizer that is one token per character ---------------------------


class FakeTok:
    """Just enough of a tokenizer for rollout(): one token per character, <|im_end|> = 1."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + "<|im_start|>assistant\n"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) + 10 for ch in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<|im_end|>" if i == 1 else chr(i - 10) for i in ids)

    def convert_tokens_to_ids(self, token):
        return 1 if token == "<|im_end|>" else None

    def get_vocab(self):
        return {"<|im_end|>": 1}

    eos_token_id = 1


def scripted(answers_per_turn):
    """A generate() whose reply at turn j is answers_per_turn[j] for every episode (closed with <|im_end|>)."""
    tok, calls = FakeTok(), []

    def generate(prompts, temperature, turn_cache=None, seeds=None):
        j = len(calls)
        calls.append(prompts)
        text = f"<think> t </think> <answer> {answers_per_turn[j]} </answer>"
        return [(tok(text)["input_ids"] + [1], [-0.5] * (len(text) + 1)) for _ in prompts]

    return generate, tok, calls
