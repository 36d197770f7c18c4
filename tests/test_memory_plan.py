"""bench/memory_plan.py: the saved-tensor measurement and the plan it computes (the README's "What fits" table)."""

import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import memory_plan as mp  # noqa: E402


def test_parameter_counts_are_qwen25s():
    assert mp.parameters("0.5B")["total"] == 494_032_768  # Qwen2.5-0.5B-Instruct's model card: 0.49B, tied
    assert mp.parameters("7B")["total"] == 7_615_616_512  # 7.61B, untied
    assert mp.parameters("0.5B")["lora_r64"] == 64 * 22_912 * 24  # 35.2M: the spec's (in + out) per layer, 24 layers


@pytest.fixture(scope="module")
def small():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return Qwen2ForCausalLM(config)


def test_activations_grow_linearly_and_checkpointing_keeps_less(small):
    plain = [mp.measure(small, t, "fp32", False) for t in (32, 64, 128)]
    body, head = mp.per_token(plain[0], plain[1])
    body2, head2 = mp.per_token(plain[1], plain[2])
    assert body == pytest.approx(body2, rel=0.02) and head == pytest.approx(head2, rel=0.02)  # linear in tokens
    V = small.config.vocab_size
    assert 2.5 * 4 * V < head < 4 * 4 * V  # float32 logits, their log-softmax, the entropy's softmax (+ a little)
    ckpt = mp.per_token(*[mp.measure(small, t, "fp32", True) for t in (32, 64)])
    assert ckpt[0] < body / 2 and ckpt[1] == pytest.approx(head, rel=0.02)  # the head is not checkpointed
    assert ckpt[0] >= small.config.num_hidden_layers * small.config.hidden_size * 4  # each layer's input, float32


def test_the_plan_takes_the_first_option_that_fits_one_row():
    measured = {"bf16": (1.6e6, 1.8e6), "bf16_checkpointed": (1.8e5, 1.8e6)}
    rows = {(r["model"], r["lora_r64"], r["critic"]): r for r in mp.plan(measured, 80)}
    default = rows[("0.5B", False, True)]
    n = mp.parameters("0.5B")
    models = n["total"] + n["body"]
    table = 3 * 151_936 * 896 * 4  # the tied table's two transient gradients and their sum, float32
    assert default["fixed_gib"] == round(((4 + 12 + 2) * models + table) / 2**30, 1)  # weights, grads + AdamW, bf16
    lora = rows[("0.5B", True, True)]
    assert lora["fixed_gib"] == round((6 * models + 12 * 2 * n["lora_r64"]) / 2**30, 1)  # a frozen table: no transient
    assert default["rows_per_micro_batch"]["as is"] >= 1 and default["command"].endswith(
        f"--micro-batch-size {default['rows_per_micro_batch']['as is']}"
    )
    assert rows[("0.5B", True, True)]["trained_params"] == 2 * n["lora_r64"]  # policy and critic adapters
    small_card = {(r["model"], r["lora_r64"], r["critic"]): r for r in mp.plan(measured, 24)}
    assert small_card[("7B", False, True)]["command"] is None  # nothing fits
    fits = small_card[("0.5B", False, True)]["rows_per_micro_batch"]
    assert fits["as is"] <= fits["--gradient-checkpointing"] <= fits["--gradient-checkpointing --vllm-sleep"]
