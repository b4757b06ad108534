"""LoRARequest: names the adapter a request runs with (vLLM's three fields), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """lora_name: what callers (and the server's `model` field) call it; lora_int_id: a positive integer that
    identifies the adapter within one engine; lora_path: a PEFT folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"adapter {self.lora_name!r}: lora_int_id must be an integer >= 1, "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"adapter {self.lora_name!r}: lora_path must be a non-empty string")

    def cache_key(self) -> bytes:
        """What the prefix cache mixes into a request's first block hash: KV computed under one adapter is never
        reused under another (nor under the base model)."""
        return f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()
