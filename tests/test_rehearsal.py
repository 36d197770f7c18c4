"""bench/rehearsal.py's sums: what the plan predicts for a run it rehearsed, and the process floor it adds."""

import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import rehearsal  # noqa: E402


def test_the_floor_is_the_fresh_process_not_the_parents_peak():
    """ru_maxrss survives exec, so a child started by a process that held 1.5 GiB read at least that (the first draft's
    floor, 0.75 GiB at --quick, came from the parent's model); VmHWM counts the child alone."""
    held = torch.ones(400_000_000)  # 1.5 GiB resident in this process
    floor = rehearsal.baseline_gib("starpo_bandit.py", "hf")
    del held
    assert 0.1 < floor < 1.0  # torch, transformers and the script imported


@pytest.mark.parametrize("flags, trains_critic", [([], True), (["--lora-rank", "64"], False)])
def test_the_prediction_prices_two_models_and_the_largest_micro_batch(flags, trains_critic):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v (biased), o, MLP, norms
    total = 512 * 64 + 2 * layer + 64  # tied: one table; the final norm
    per_token = {"fp32": (1000.0, 300.0), "fp32_checkpointed": (100.0, 300.0)}
    shapes = [[1, 10, 5], [2, 40, 8], [3, 20, 60]]  # rows, padded columns, trained tokens
    p = rehearsal.predicted_update_gib(config, flags, shapes, per_token, 0.5, "hf")
    assert p["largest_micro_batch"] == [2, 40, 8]
    assert p["activations_gib"] * 2**30 == pytest.approx(2 * 1000 * 80 + 300 * 8)  # two bodies (policy, critic), head
    ckpt = rehearsal.predicted_update_gib(config, ["--gradient-checkpointing"], shapes, per_token, 0.5, "hf")
    assert ckpt["activations_gib"] * 2**30 == pytest.approx(2 * (100 + 1000 / 2) * 80 + 300 * 8)  # + a layer of 2
    models = 2 * total  # the policy and the critic (the same body; its value head is left out), each float32
    assert p["baseline_gib"] == 0.5 and p["engine_gib"] == 0.0
    linears = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    adapters = 2 * 2 * 64 * sum(i + o for i, o in linears)  # the policy's and the critic's, 2 layers, rank 64
    trained = models if trains_critic else adapters  # float32 weights, gradients and AdamW's two moments
    table = 3 * 512 * 64 * 4 if trains_critic else 0  # a trained table's transient gradients (LoRA freezes it)
    assert p["fixed_gib"] * 2**30 == pytest.approx(4 * models + 12 * trained + table)
    assert p["update_gib"] == pytest.approx(p["fixed_gib"] + p["activations_gib"] + 0.5)


def test_without_the_critic_one_body_is_priced():
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    per_token = {"fp32": (1000.0, 300.0)}
    both = rehearsal.predicted_update_gib(config, [], [[2, 40, 8]], per_token, 0.5, "hf")
    grpo = rehearsal.predicted_update_gib(config, ["--estimator", "grpo"], [[2, 40, 8]], per_token, 0.5, "hf")
    assert grpo["activations_gib"] * 2**30 == pytest.approx(1000 * 80 + 300 * 8)
    table = 3 * 512 * 64 * 4
    assert (grpo["fixed_gib"] * 2**30 - table) * 2 == pytest.approx(both["fixed_gib"] * 2**30 - table, rel=0.01)
