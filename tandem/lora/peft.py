"""Reads a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into per-projection A / B pairs."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from tandem.lora_request import LoRARequest
from tandem.models.loader import hub_snapshot, is_hub_id

# The projections an adapter may target, by their Hugging Face names -> (tandem's linear that holds it, its part in
# that linear's fused output rows; None: the whole linear, as GPT-2's fused c_attn is one projection to Hugging Face
# and to an adapter). GPT-2's are Conv1D layers, whose A [r, in] and B [out, r] PEFT applies as a Linear's:
# fan_in_fan_out only changes how it would merge them.
PROJECTIONS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "o_proj": ("o_proj", 0),
    "down_proj": ("down_proj", 0), "c_attn": ("c_attn", None), "c_fc": ("c_fc", None), "c_proj": ("c_proj", None)}
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter as read from disk: per HF module name (`model.layers.3.self_attn.q_proj`), A [r, in] and
    B [out, r] in fp32, and the scale PEFT applies to B @ A (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name


def _fail(request: LoRARequest, reason: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {reason}")


# Hub ids already resolved to their cached snapshot folders (an online lookup costs a request to the Hub).
_HUB_FOLDERS: dict[str, str] = {}


def adapter_folder(request: LoRARequest) -> str:
    """The adapter's local folder: lora_path itself, or where lora_path is a Hugging Face Hub id (`org/name`) and no
    local folder, its snapshot in the Hugging Face cache (downloaded once; offline, HF_HUB_OFFLINE=1, the cached
    one). ValueError naming the adapter when neither exists."""
    path = os.path.expanduser(request.lora_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or not is_hub_id(request.lora_path):
        raise _fail(request, "the path is not a folder")
    folder = _HUB_FOLDERS.get(request.lora_path)
    if folder is None:
        try:
            folder = hub_snapshot(request.lora_path, require_config=False, what="LoRA adapter")
        except ValueError as exc:
            raise _fail(request, str(exc)) from None
        _HUB_FOLDERS[request.lora_path] = folder
    return folder


def read_config(request: LoRARequest, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json; ValueError naming the adapter for anything tandem cannot serve."""
    path = os.path.join(adapter_folder(request), "adapter_config.json")
    if not os.path.isfile(path):
        raise _fail(request, "adapter_config.json is missing")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise _fail(request, f"adapter_config.json cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(request, "adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(request, f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("modules_to_save"):
        raise _fail(request, f"modules_to_save ({config['modules_to_save']}) is not supported: the adapter "
                             "replaces whole modules, which a shared base model cannot serve per request")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("layers_to_transform", "layers_to_transform")):
        if config.get(key):
            raise _fail(request, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(request, f"bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(request, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(request, f"rank {rank} exceeds max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(request, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def check_modules(adapter: LoRAAdapter, modules: dict[str, list[int]]) -> None:
    """ValueError naming the adapter unless each of its modules is one of `modules` (Hugging Face name ->
    [in, out] features of the base projection) with A [r, in] and B [out, r]."""
    for module, (a, b) in adapter.weights.items():
        dims = modules.get(module)
        if dims is None:
            raise _fail(adapter.request, f"target module {module!r} is not a projection this model has")
        if a.shape[1] != dims[0] or b.shape[0] != dims[1]:
            raise _fail(adapter.request, f"{module} has A {tuple(a.shape)} / B {tuple(b.shape)}, but the base "
                                         f"projection maps {dims[0]} -> {dims[1]} features")


@dataclass(slots=True)
class AdapterHeader:
    """What an adapter folder says without reading its weights (adapter_config.json and the safetensors header):
    per HF module name the keys of its A and B tensors and their shapes, A [r, in] and B [out, r]."""

    request: LoRARequest
    rank: int
    scaling: float
    keys: dict[str, tuple[str, str]]
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def read_header(request: LoRARequest, max_rank: int) -> AdapterHeader:
    """Reads and checks the folder's config and tensor names and shapes (milliseconds: no weight is read): every
    tensor a lora_A / lora_B weight of one of PROJECTIONS, each module with both, A [r, in] and B [out, r].
    Shapes against the model are checked when it is packed (pack.py)."""
    from safetensors import safe_open  # the loader's dependency; imported where adapters are read

    rank, scaling = read_config(request, max_rank)
    path = os.path.join(adapter_folder(request), "adapter_model.safetensors")
    if not os.path.isfile(path):
        raise _fail(request, "adapter_model.safetensors is missing (only safetensors adapters load)")
    halves: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
                match = _TENSOR.match(name)
                if match is None:
                    raise _fail(request, f"tensor {key!r} is not a LoRA A/B weight of a linear projection")
                module = match["module"]
                if module.rsplit(".", 1)[-1] not in PROJECTIONS:
                    raise _fail(request, f"target module {module!r} is not one of {', '.join(PROJECTIONS)}")
                halves.setdefault(module, {})[match["which"]] = (key, tuple(f.get_slice(key).get_shape()))
    except ValueError:
        raise
    except Exception as exc:  # a corrupt file: safetensors raises its own error types
        raise _fail(request, f"adapter_model.safetensors cannot be read: {exc}") from None
    if not halves:
        raise _fail(request, "adapter_model.safetensors holds no LoRA weights")
    keys: dict[str, tuple[str, str]] = {}
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        (key_a, a), (key_b, b) = pair["A"], pair["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise _fail(request, f"{module}: lora_A {a} / lora_B {b} do not have rank {rank} (A [r, in], B [out, r])")
        keys[module], shapes[module] = (key_a, key_b), (a, b)
    return AdapterHeader(request, rank, scaling, keys, shapes)


def load_adapter(request: LoRARequest, max_rank: int, header: AdapterHeader | None = None) -> LoRAAdapter:
    """Reads the folder's weights (checked as read_header does; `header`: already read) into fp32 A / B pairs."""
    from safetensors import safe_open

    if header is None:
        header = read_header(request, max_rank)
    path = os.path.join(adapter_folder(request), "adapter_model.safetensors")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for module, (key_a, key_b) in header.keys.items():
                a, b = f.get_tensor(key_a).to(torch.float32), f.get_tensor(key_b).to(torch.float32)
                if (tuple(a.shape), tuple(b.shape)) != header.shapes[module]:
                    raise _fail(request, f"{module} changed on disk while it was read")
                weights[module] = (a, b)
    except ValueError:
        raise
    except Exception as exc:  # gone or corrupt since the header was read
        raise _fail(request, f"adapter_model.safetensors cannot be read: {exc}") from None
    return LoRAAdapter(request, header.rank, header.scaling, weights)
