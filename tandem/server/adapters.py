"""The LoRA adapters one API process serves by name: `--lora-modules` and /v1/load_lora_adapter add them, a request's
`model` picks one, /v1/unload_lora_adapter removes it."""

from __future__ import annotations

import hashlib

from tandem.lora.peft import check_modules, load_adapter
from tandem.lora_request import LoRARequest
from tandem.server.protocol import ApiError


def adapter_id(name: str, path: str) -> int:
    """A positive id from the adapter's name and folder: every API process of a server gives the same adapter the
    same id (the engine keys its copies and the prefix cache by it)."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2 | 1


class ServedAdapters:
    """Adapter name -> LoRARequest. Each is read and checked against the base model's projections
    (`modules`: Hugging Face module name -> [in, out]) before a request may name it."""

    def __init__(self, enabled: bool, base_names: list[str], modules: dict[str, list[int]], max_rank: int) -> None:
        self.enabled = enabled
        self.base_names = base_names
        self.modules = modules
        self.max_rank = max_rank
        self.by_name: dict[str, LoRARequest] = {}

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name this server does not serve."""
        if model is None or model in self.base_names:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.base_names[0]!r}"
                                + (f" and the adapters {sorted(self.by_name)}" if self.by_name else ""),
                           type="not_found_error", param="model", code="model_not_found")
        return lora

    def load(self, name: str, path: str) -> LoRARequest:
        """Reads and checks an adapter and serves it as `name`; ValueError with the reason when it cannot serve."""
        if not self.enabled:
            raise ValueError("LoRA adapters are off: start the server with --enable-lora")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("lora_name and lora_path must be non-empty strings")
        if name in self.base_names:
            raise ValueError(f"{name!r} is the base model's name")
        if name in self.by_name:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        request = LoRARequest(name, adapter_id(name, path), path)
        check_modules(load_adapter(request, self.max_rank), self.modules)
        self.by_name[name] = request
        return request

    def unload(self, name: str) -> LoRARequest:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise ApiError(404, f"no adapter named {name!r} is loaded", type="not_found_error", param="lora_name",
                           code="model_not_found")
        return lora
