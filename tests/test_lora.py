"""LoRA (--lora-rank): the adapter starts as the base model, only adapters and the value head train, the KL reference
is the base, the merge equals the adapted forward, checkpoints hold the adapters and resume exactly, and
tools/merge_lora.py exports a model of its own. (The engine's log-probs after a push: tests/test_vllm_cpu.py.)"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import starpo_bandit as sb
import plumbing.dist
import plumbing.run
from plumbing import lora
from conftest import ROOT, tiny_qwen
from plumbing.report import read_jsonl

SMALL = ["--n-groups", "2", "--group-size", "4", "--val-size", "8", "--sample-every", "0", "--max-tokens", "24"]
TIMING = plumbing.dist.MEASURED


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 33, 2, 17, 40, 8]])


def test_the_adapted_model_starts_as_the_base_and_adapts_every_decoder_linear_layer():
    base = tiny_qwen()
    adapted = lora.add_adapters(tiny_qwen(), rank=4, alpha=64)
    assert torch.equal(logits(adapted, IDS), logits(base, IDS))  # B = 0: exactly the base
    layers = {n for n, m in adapted.named_modules() if isinstance(m, lora.LoRALinear)}
    assert len(layers) == 2 * 7 and all(n.split(".")[-1].endswith("_proj") for n in layers)  # q k v o gate up down
    assert type(adapted.lm_head) is torch.nn.Linear  # the output head is not adapted (peft's "all-linear")
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.lora_{x}" for n in layers for x in "AB"}
    assert set(lora.merged_state_dict(adapted)) == set(base.state_dict())  # transformers' names, nothing more


@pytest.mark.parametrize("rank", [0, 4])
def test_a_push_hands_vllm_one_cast_tensor_at_a_time(monkeypatch, rank):
    """The paper-sized rehearsal (bench/rehearsal.py) ran out of memory at its second push when the push built every
    cast tensor first: at 0.5B a second model in bf16, beside the engine's own. The loader gets them one by one."""
    import gc
    import types
    import weakref

    model = lora.add_adapters(tiny_qwen(), rank=rank, alpha=16) if rank else tiny_qwen()
    most = []

    class Engine:  # what vllm_push_weights touches of vllm.LLM
        llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))

        def collective_rpc(self, method, kwargs):
            assert method == "reload_weights"
            held = []
            for _, tensor in kwargs["weights_iterator"]:
                held.append(weakref.ref(tensor))
                del tensor
                gc.collect()
                most.append(sum(r() is not None for r in held))  # cast tensors still alive, this one included
            assert len(held) == len([k for k in model.state_dict() if ".lora_" not in k])  # every weight, no adapter

        def reset_prefix_cache(self):
            pass

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    sb.vllm_push_weights(Engine(), model)
    assert max(most) == 0  # each cast tensor freed before the next is made (a list held all of them)


def test_adding_adapters_leaves_the_sampling_stream_alone():
    """A's random init draws from a forked generator: a LoRA run samples its first episodes as full fine-tuning does."""
    model = tiny_qwen()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    lora.add_adapters(model, rank=4, alpha=64)
    assert torch.equal(torch.rand(3), expected)


def test_merged_weights_equal_the_adapted_forward_and_adapters_off_is_the_base():
    base, adapted = tiny_qwen(), lora.add_adapters(tiny_qwen(), rank=4, alpha=16)
    for m in adapted.modules():
        if isinstance(m, lora.LoRALinear):
            torch.nn.init.normal_(m.lora_B, std=0.05)
    out = logits(adapted, IDS)
    assert (out - logits(base, IDS)).abs().max() > 1e-2  # the adapters do change the model
    merged = tiny_qwen()
    merged.load_state_dict(lora.merged_state_dict(adapted))
    assert torch.allclose(logits(merged, IDS), out, atol=1e-5, rtol=0)
    with lora.adapters_off(adapted):
        assert torch.equal(logits(adapted, IDS), logits(base, IDS))  # the KL reference: the base, no second copy
    assert torch.equal(logits(adapted, IDS), out)  # and back on


def test_a_zero_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):  # a zero rank is --lora-rank 0: no adapters, never a layer of rank 0
        lora.add_adapters(tiny_qwen(), rank=0, alpha=64)


def capture_models(monkeypatch):
    """Patch the bandit's Run so a test can look at the policy and critic after main() returns."""
    seen = {}
    real = sb.Run

    def run(args, task, resume_from, policy, tok, state, config):
        seen.update(policy=policy, critic=state["critic"], opt=state["opt"])
        return real(args, task, resume_from, policy, tok, state, config)

    monkeypatch.setattr(sb, "Run", run)
    return seen


def test_a_lora_run_trains_only_adapters_and_the_value_head(tmp_path, monkeypatch, capsys):
    seen = capture_models(monkeypatch)
    sb.main([*SMALL, "--steps", "2", "--eval-every", "0", "--algo", "starpo", "--lora-rank", "4",
             "--output-dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r"parameters: policy [\d,]+ trained of [\d,]+, critic [\d,]+ of [\d,]+ \(LoRA adapters\)", out)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["lora_rank"] == 4 and config["settings"]["lora_alpha"] == 64.0
    base = transformers.AutoModelForCausalLM.from_pretrained(config["model_path"]).state_dict()
    policy, critic = seen["policy"].state_dict(), seen["critic"].state_dict()
    moved = lambda sd, prefix="": {
        k for k, v in sd.items() if ".lora_" not in k and not torch.equal(v, base[prefix + k])
    }
    assert moved(policy) == set()  # the base weights never move (nor go into the optimizer: weight decay)
    assert moved({k[len("body.") :]: v for k, v in critic.items() if k.startswith("body.")}, "model.") == set()
    assert any(v.abs().sum() > 0 for k, v in policy.items() if k.endswith("lora_B"))  # the adapters trained
    assert critic["head.weight"].abs().sum() > 0  # the value head trains whole
    assert sum(len(g["params"]) for g in seen["opt"].param_groups) == len([k for k in policy if ".lora_" in k])
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert "actor/kl_loss" in rows[1] and rows[1]["actor/kl_loss"] >= 0  # the reference ran: the adapters off
    saved = tmp_path / "checkpoints" / "step-000002" / "policy"
    assert (saved / "adapters.pt").exists() and not list(saved.glob("*.safetensors"))  # the adapters alone
    assert plumbing.run.latest_checkpoint(tmp_path).name == "step-000002"


def metrics(run_dir):
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def run(*flags):
    r = subprocess.run([sys.executable, str(ROOT / "starpo_bandit.py"), *flags], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_a_lora_run_resumes_exactly_and_exports_a_merged_model(tmp_path):
    flags = [*SMALL, "--eval-every", "2", "--lora-rank", "4", "--save-every", "2"]
    run(*flags, "--steps", "4", "--output-dir", str(tmp_path / "whole"))
    run(*flags, "--steps", "2", "--output-dir", str(tmp_path / "halves"))
    r = run("--resume", "--steps", "4", "--output-dir", str(tmp_path / "halves"))  # the config gives --lora-rank
    assert "resumed from" in r.stdout + r.stderr
    assert metrics(tmp_path / "halves") == metrics(tmp_path / "whole")
    assert [row["step"] for row in metrics(tmp_path / "whole")] == [0, 1, 2, 3, 4]

    ckpt, out = tmp_path / "whole" / "checkpoints" / "step-000004", tmp_path / "merged"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "merge_lora.py"), str(ckpt), str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    adapted = lora.add_adapters(transformers.AutoModelForCausalLM.from_pretrained(config["model_path"]), 4, 64.0)
    lora.load_adapters(adapted, ckpt / "policy" / "adapters.pt")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out)  # a model of its own
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(out)("Which arm? <think>")["input_ids"]])
    assert torch.allclose(logits(merged, ids), logits(adapted.eval(), ids), atol=1e-4, rtol=0)
    assert not torch.allclose(logits(merged, ids), logits(lora.adapters_off(adapted).__enter__(), ids), atol=1e-4)


def test_a_lora_checkpoint_needs_the_same_rank(tmp_path):
    run(*SMALL, "--steps", "1", "--eval-every", "0", "--lora-rank", "4", "--output-dir", str(tmp_path))
    r = subprocess.run([sys.executable, str(ROOT / "starpo_bandit.py"), "--resume", "--steps", "2", "--lora-rank",
                        "2", "--output-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 2 and "other adapters than this model's" in r.stderr.strip().splitlines()[-1]


def test_a_bad_lora_flag_fails_in_one_line_before_any_model_loads(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "starpo_bandit.py"), "--lora-rank", "-1", "--output-dir",
                        str(tmp_path / "x")], capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip() == "error: --lora-rank: must be >= 0 (0 = full fine-tuning), got -1"
    assert not (tmp_path / "x").exists()
