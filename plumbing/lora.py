"""LoRA (--lora-rank r, Hu et al. 2021): the model frozen, and on every linear layer of the decoder a trainable
low-rank update, y = x W^T + b + (alpha / r) x A^T B^T, with A (r, in) random and B (out, r) zero at the start, so the
adapted model starts as the base. What a LoRA run touches, in one place: adding the adapters (the policy's and the
critic's body), switching them off (StarPO's KL reference is the base model: no second copy in memory), the merged
weights W + (alpha / r) B A (each vLLM push, tools/merge_lora.py), and a checkpoint's adapters (plumbing/run.py).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.nn as nn

ADAPTERS = "adapters.pt"  # a LoRA checkpoint's policy/: its adapters' tensors under the model's parameter names


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trainable low-rank update: y = x W^T + b + (alpha / r) x A^T B^T. The base layer's
    own tensors keep their names (weight, bias), so the state_dict keeps transformers' names; lora_A and lora_B are
    new."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the base layer's own tensors, not copies
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(rank, self.in_features, **kw), a=math.sqrt(5)))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))  # (out, r); lora_A: (r, in), peft's init
        self.scale, self.enabled = alpha / rank, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        if not self.enabled:  # adapters_off: the base model
            return y
        return y + self.scale * nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B)

    def merged_weight(self) -> torch.Tensor:  # W + (alpha / r) B A in float32, out of place: W itself never changes
        return (self.weight.float() + self.scale * self.lora_B.float() @ self.lora_A.float()).to(self.weight.dtype)


def add_adapters(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Freeze the model and adapt every nn.Linear but the output head (peft's "all-linear"), in place."""
    if rank < 1:
        raise ValueError(f"a LoRA rank is >= 1, got {rank}")
    model.requires_grad_(False)
    head = model.get_output_embeddings()
    with torch.random.fork_rng(devices=[]):  # A's random init leaves the sampling stream as full fine-tuning has it
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and child is not head:
                    setattr(module, name, LoRALinear(child, rank, alpha))
    return model


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model without its adapters: the base model (a no-op for a model without any)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


def merged_weights(model: nn.Module):
    """(name, weight) under transformers' names, each adapter folded in when its weight is reached: what vLLM gets at
    each push, one tensor at a time (a model without adapters: its state_dict's items)."""
    adapted = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for k, v in model.state_dict().items():
        if ".lora_" not in k:
            yield k, adapted[k].merged_weight() if k in adapted else v


def merged_state_dict(model: nn.Module) -> dict:
    """merged_weights as a dict (tools/merge_lora.py): the whole merged model at once."""
    return dict(merged_weights(model))


def adapter_state(model) -> dict:
    """A model's adapters (lora_A / lora_B) by parameter name; {} without LoRA."""
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def load_adapters(model, path: Path) -> None:
    """Load a checkpoint's adapters into a model that has adapters of the same shapes (add_adapters). Raises
    ValueError naming the mismatch (the caller turns it into its one-line error)."""
    adapters = torch.load(path, map_location="cpu", weights_only=True)  # weights_only: a checkpoint cannot run code
    own = {k: v.shape for k, v in adapter_state(model).items()}
    if own != {k: v.shape for k, v in adapters.items()}:
        raise ValueError(f"{path} holds other adapters than this model's (the run's --lora-rank is in its config.json)")
    model.load_state_dict(adapters, strict=False)
