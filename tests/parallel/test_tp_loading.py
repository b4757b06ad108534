"""Each rank's shard, loaded alone (safetensors slices, GGUF), equals the matching slice of the unsharded model."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig, ParallelConfig
from tandem.layers.parallel import kv_head_start, local_kv_heads
from tandem.models.loader import load_model_and_tokenizer
from tests.parallel.tiny_models import save_tiny

pytest.importorskip("transformers")


def _load(path: str, tp: ParallelConfig):  # type: ignore[no-untyped-def]
    config = EngineConfig(model=path, device="cpu", dtype="float32")
    model, mc, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32, tp, load_tokenizer=False)
    return model, mc


def _expected_llama_shard(full: dict[str, torch.Tensor], mc, tp: ParallelConfig) -> dict[str, torch.Tensor]:
    """The rank's parameters, cut from the unsharded ones by the Megatron rules written out by hand."""
    n, r, hd = tp.size, tp.rank, mc.head_dim
    q_full, kv_full = mc.num_heads * hd, mc.num_kv_heads * hd
    ql, kl, ks = q_full // n, local_kv_heads(mc, tp) * hd, kv_head_start(mc, tp) * hd
    inter = mc.intermediate_size
    il = inter // n
    vl = -(-mc.vocab_size // n)
    out = {}
    for name, w in full.items():
        if name.endswith("qkv_proj.weight"):
            out[name] = torch.cat([w[r * ql : (r + 1) * ql], w[q_full + ks : q_full + ks + kl],
                                   w[q_full + kv_full + ks : q_full + kv_full + ks + kl]])
        elif name.endswith("o_proj.weight"):
            out[name] = w[:, r * ql : (r + 1) * ql]
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat([w[r * il : (r + 1) * il], w[inter + r * il : inter + (r + 1) * il]])
        elif name.endswith("down_proj.weight"):
            out[name] = w[:, r * il : (r + 1) * il]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = w[r * vl : (r + 1) * vl]
            out[name] = torch.cat([rows, rows.new_zeros(vl - rows.shape[0], rows.shape[1])])
        elif "proj" in name:
            raise AssertionError(f"no rule for {name}")
        else:
            out[name] = w  # norms: replicated
    return out


def _check(path: str, size: int, ranks: list[int]) -> None:
    full_model, mc = _load(path, ParallelConfig())
    full = {k: v.detach() for k, v in full_model.named_parameters()}
    for rank in ranks:
        tp = ParallelConfig(rank, size)
        shard, _ = _load(path, tp)
        expected = _expected_llama_shard(full, mc, tp)
        got = dict(shard.named_parameters())
        assert got.keys() == expected.keys()
        for name, want in expected.items():
            torch.testing.assert_close(got[name].detach(), want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # KV heads split (2 over 2) and replicated (1 over 2)
def test_safetensors_shards_match_the_full_model(tmp_path, family):
    _check(save_tiny(family, tmp_path), 2, [0, 1])


def test_gguf_shard_matches_the_full_model():
    # SmolLM2-135M: 9 heads, 3 KV heads, intermediate 1536, vocab 49152 -> three ranks; rank 1 checked.
    from tandem.models.loader import default_model_path

    _check(default_model_path(), 3, [1])
