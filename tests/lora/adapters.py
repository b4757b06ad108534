"""Tiny base checkpoints and PEFT adapters made in the test (B random and nonzero: PEFT starts it at zero)."""

from __future__ import annotations

import os

import torch

from tests.parallel.tiny_models import save_tiny


def save_base(family: str, folder: str) -> str:
    return save_tiny(family, folder)


def save_adapter(base_folder: str, folder: str, targets: list[str], r: int = 8, alpha: int = 16,
                 use_rslora: bool = False, seed: int = 0, scale: float = 0.3) -> str:
    """A PEFT LoRA adapter of the checkpoint at base_folder, with random A and B (B's init of zeros replaced)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(folder)
    return os.fspath(folder)


def peft_greedy(base_folder: str, adapter_folder: str | None, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers (+ peft with the adapter) greedy continuation of a prompt, fp32."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
