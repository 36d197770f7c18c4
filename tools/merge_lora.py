"""Fold a LoRA run's adapters into its base model: a model of its own, loadable with from_pretrained (or by vLLM).

A LoRA checkpoint's policy/ holds the adapters alone (adapters.pt) and the tokenizer; the run's config.json names the
base model (model_path), --lora-rank and the script's SETTINGS["lora_alpha"]. The merge is the one each vLLM push makes: W + (alpha / r) B A
per adapted layer, in float32.

    python tools/merge_lora.py runs/<run>/checkpoints/step-000040 merged/
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('merged')"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a LoRA run's checkpoints/step-NNNNNN")
    ap.add_argument("out", type=Path, help="where the merged model and its tokenizer go")
    a = ap.parse_args(argv)
    from plumbing.flags import fail
    from plumbing.lora import ADAPTERS, add_adapters, load_adapters, merged_state_dict

    adapters, config_path = a.checkpoint / "policy" / ADAPTERS, a.checkpoint.parent.parent / "config.json"
    if not adapters.exists() or not config_path.exists():
        ap.error(f"{a.checkpoint} is not a LoRA checkpoint of a run (no policy/{ADAPTERS} or no ../../config.json)")
    config = json.loads(config_path.read_text())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = lambda: AutoModelForCausalLM.from_pretrained(config["model_path"], dtype=torch.float32)
    adapted = add_adapters(load(), config["lora_rank"], config.get("settings", config)["lora_alpha"])
    try:
        load_adapters(adapted, adapters)
    except ValueError as e:
        fail("checkpoint", str(e))
    merged = load()
    merged.load_state_dict(merged_state_dict(adapted))
    merged.save_pretrained(a.out)
    AutoTokenizer.from_pretrained(a.checkpoint / "policy").save_pretrained(a.out)
    print(f"merged {a.checkpoint} (LoRA rank {config['lora_rank']}) into {config['model_path']}: {a.out}")


if __name__ == "__main__":
    main()
