"""GGUF tensors -> Hugging Face names and layouts: dequantized with `gguf` or, for the linears kept in their blocks,
in the tandem int-N layout; llama.cpp's q/k rotary permutation undone."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Iterator

import numpy as np
import torch

from tandem.config import ModelConfig
from tandem.models.gguf_blocks import unpack_gguf_tensor, widen
from tandem.models.int_loading import module_name

# llama.cpp architectures whose converter permutes q/k rows for its interleaved rotary layout.
_PERMUTED_ARCHS = ("llama",)
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, every expert stacked [experts, out, in], Qwen2-MoE's shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; ValueError for unknown names."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_LEVEL:
        return f"{_TOP_LEVEL[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PER_BLOCK:
        return f"model.layers.{parts[1]}.{_PER_BLOCK[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
        # Older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight.
        proj = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}[parts[2]]
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{proj}.{parts[4]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: within each head, rows (pair i, element j) go back to (half j, row i)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return _checked_architecture(None if field is None else str(field.contents()), supported_only=False)


def _checked_architecture(arch: object, supported_only: bool = True) -> str:
    """The file's general.architecture; ValueError where it has none or (supported_only) tandem does not run it."""
    if arch is None:
        raise ValueError("GGUF file has no general.architecture")
    if supported_only and arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_GGUF_ARCHS}")
    return str(arch)


def gguf_moe_config(path: str) -> dict[str, object]:
    """Config fields a GGUF's metadata adds for a mixture of experts transformers' GGUF reader leaves out: llama.cpp
    stores Mixtral as architecture llama with llama.expert_count (-> model_type mixtral); {} otherwise."""
    meta = gguf_metadata(path, ("general.architecture", "llama.expert_count", "llama.expert_used_count"))
    arch = _checked_architecture(meta.get("general.architecture"), supported_only=False)
    count = meta.get("llama.expert_count")
    if arch != "llama" or not count:
        return {}
    return {"model_type": "mixtral", "num_local_experts": int(count),
            "num_experts_per_tok": int(meta.get("llama.expert_used_count", 2))}


def gguf_has_tokenizer(path: str) -> bool:
    """Whether the file carries tokenizer metadata (a benchmark's random weights-only file does not); ValueError
    for an architecture tandem does not run."""
    meta = gguf_metadata(path, ("general.architecture", "tokenizer.ggml.model"))
    _checked_architecture(meta.get("general.architecture"))
    return "tokenizer.ggml.model" in meta


# GGUF metadata value types (the format's numbering): struct codes of the fixed-size ones; 8 string, 9 array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: str, keys: Collection[str]) -> dict[str, object]:
    """{key: value} of those `keys` that the file's metadata holds as a number or a string (arrays are skipped),
    read from the header alone: gguf.GGUFReader also maps every tensor and every array element, seconds for a
    tokenizer's vocabulary on a CPU core."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # a big-endian file's version reads as 0
        version, _, kv_count = struct.unpack_from(order + "IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} of {path} is not supported")
        wanted, found, pos = set(keys), {}, 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from(order + "Q", buf, at)
            return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n

        def skip(kind: int, at: int) -> int:  # the offset past one value of type `kind`
            if kind in _GGUF_SCALARS:
                return at + struct.calcsize(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                return at + 8 + struct.unpack_from(order + "Q", buf, at)[0]
            if kind != _GGUF_ARRAY:
                raise ValueError(f"GGUF metadata of {path}: unknown value type {kind}")
            inner, count = struct.unpack_from(order + "IQ", buf, at)
            at += 12
            if inner in _GGUF_SCALARS:
                return at + count * struct.calcsize(_GGUF_SCALARS[inner])
            for _ in range(count):
                at = skip(inner, at)
            return at

        for _ in range(kv_count):
            key, pos = string(pos)
            (kind,) = struct.unpack_from(order + "I", buf, pos)
            pos += 4
            if key in wanted and kind in _GGUF_SCALARS:
                found[key] = struct.unpack_from(order + _GGUF_SCALARS[kind], buf, pos)[0]
            elif key in wanted and kind == _GGUF_STRING:
                found[key] = string(pos)[0]
            pos = skip(kind, pos)
    return found


def open_gguf(path: str):  # -> gguf.GGUFReader
    """The file's reader; ValueError for an architecture tandem does not run."""
    import gguf

    reader = gguf.GGUFReader(path)
    _checked_architecture(gguf_architecture(reader))
    return reader


def iter_gguf_weights(path: str, config: ModelConfig, layouts: dict[str, tuple[int, int]] | None = None,
                      reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, tensor in Hugging Face layout) for every tensor of the file: a float tensor, or
    for each linear named in `layouts` (module -> (bits, group size): gguf_int.plan_gguf_int) its blocks as
    `.qweight`, `.scales`, `.zeros` (fp32) in the tandem int-N layout."""
    import gguf

    reader = reader if reader is not None else open_gguf(path)
    arch = gguf_architecture(reader)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        layout = (layouts or {}).get(module_name(name.removesuffix(".weight"))[0])
        if layout is not None:
            yield from _int_tensors(tensor, name, layout, config, arch in _PERMUTED_ARCHS)
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy, Hugging Face [out, in] order
        if not array.flags.writeable:  # unquantized tensors are views of the read-only mmap
            array = np.array(array, copy=True)
        weight = torch.from_numpy(array)
        if name.endswith("mlp.shared_expert_gate.weight") and weight.dim() == 1:
            weight = weight[None]  # [hidden] -> Hugging Face's [1, hidden]
        if arch in _PERMUTED_ARCHS:
            if name.endswith("self_attn.q_proj.weight"):
                weight = unpermute_rotary(weight, config.num_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                weight = unpermute_rotary(weight, config.num_kv_heads)
        yield name, weight


def _int_tensors(tensor, name: str, layout: tuple[int, int], config: ModelConfig,
                 permuted: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """One GGUF tensor kept in its blocks: `<layer>.qweight`, `.scales`, `.zeros` in its module's int-N layout
    (`layout`: (bits, group size), widened from the block type's own where a fused part needs it), rows in
    Hugging Face order (llama.cpp's q / k rotary permutation undone on each)."""
    data = torch.from_numpy(np.array(tensor.data, copy=True))  # uint8 [out, blocks * block bytes]
    packed = widen(unpack_gguf_tensor(tensor.tensor_type.name, data, int(tensor.shape[0]), tensor.name), *layout)
    prefix = name.removesuffix(".weight")
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(prefix.rsplit(".", 1)[-1])
    for suffix, t in (("qweight", packed.qweight), ("scales", packed.scales), ("zeros", packed.zeros)):
        yield f"{prefix}.{suffix}", unpermute_rotary(t, heads) if permuted and heads else t
