"""Mixture-of-experts models in 4 and 8 bits (quantization int4 / int8): tiny Mixtral and Qwen3-MoE checkpoints give
in tandem (fp32, CPU) the logits and greedy tokens transformers gives with every quantized weight, experts included,
replaced by its dequantized values; the router stays in the model dtype; dummy shapes and the roofline's bytes."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.kernels.int_weight import untile_words
from tandem.layers.int_quant import quantize_rtn, rtn_group_size
from tandem.layers.moe import FusedMoE
from tandem.models.loader import load_model_and_tokenizer
from tests.models.test_hf_parity import run_and_compare
from tests.models.test_moe_parity import tiny_moe_config

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


def rtn(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """What quantization int4 / int8 makes of a [out, in] weight, dequantized."""
    return quantize_rtn(weight, bits, rtn_group_size(weight.shape[1])).dequantize()


def dequantize_like_tandem(hf: torch.nn.Module, bits: int) -> None:
    """Every linear but the lm_head and the routers, and each expert of the stacked expert tensors, replaced by
    its round-to-nearest values (rows quantize on their own, so fused projections and stacks change nothing)."""
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head" and not name.endswith("mlp.gate"):
                module.weight.copy_(rtn(module.weight, bits))
            if name.endswith("mlp.experts"):
                for stacked in (module.gate_up_proj, module.down_proj):
                    for e in range(stacked.shape[0]):
                        stacked[e].copy_(rtn(stacked[e], bits))


@pytest.mark.parametrize("family,bits", [("mixtral", 4), ("qwen3_moe", 4), ("qwen3_moe", 8)])
def test_int_experts_match_dequantized_transformers(family, bits, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)).float().eval()
    hf.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", quantization=f"int{bits}")
    model, model_config, _ = load_model_and_tokenizer(config, CPU, torch.float32)
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(b.int_bits == bits and not hasattr(b, "w13") for b in blocks)
    block = blocks[0]
    assert block.w13_words.dtype == torch.int32 and block.gate.weight.dtype == torch.float32
    # Groups of 64 over the hidden size, 32 over the experts' intermediate size (96 for Mixtral, 32 Qwen3-MoE).
    assert block.int_group_sizes == (64, 32)
    dequantize_like_tandem(hf, bits)
    run_and_compare(f"{family}-int{bits}", hf, model, model_config, "cpu", atol=1e-4)


def test_dummy_int4_moe_and_its_roofline_bytes():
    from tandem.bench.roofline import model_cost

    overrides = dict(num_hidden_layers=1, hidden_size=128, intermediate_size=128, vocab_size=256,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)

    def load(quantization):
        config = EngineConfig(model="mixtral-8x7b", load_format="dummy", device="cpu", dtype="float32",
                              quantization=quantization, hf_overrides=overrides)
        return load_model_and_tokenizer(config, CPU, torch.float32)[:2]

    model, mc = load("int4")
    block = model.model.layers[0].mlp
    assert block.int_bits == 4 and block.gate.int_bits == 0 and block.gate.weight.dtype == torch.float32
    assert not any(p.is_meta for p in model.parameters())
    full, _ = load(None)
    before, after = model_cost(full, mc), model_cost(model, mc)
    assert after.expert_params == before.expert_params  # the same multiplications
    # 4 experts x (256 x 128 gate/up + 128 x 128 down) weights: half a byte each, an fp32 scale and min per 128.
    weights = 4 * (256 * 128 + 128 * 128)
    assert after.expert_bytes == weights * (0.5 + 8 / 128) and before.expert_bytes == weights * 4


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_shards_quantize_whole_groups(expert_parallel, tmp_path):
    """At TP=2 each rank quantizes its shard once it is cut: whole experts (EP), or every expert's half of the
    intermediate dimension (TP), whose 128 columns of w2 are one group as in the unsharded model. The rank's
    stacks are then the unsharded model's, sliced (words compared row after row: each rank holds its own shard's
    in tiles)."""
    from tandem.config import ParallelConfig
    from tests.models.test_moe_parity import COMMON

    torch.manual_seed(0)
    hf_config = transformers.Qwen3MoeConfig(**{**COMMON, "intermediate_size": 256}, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=256, head_dim=32)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", quantization="int4")
    full = load_model_and_tokenizer(config, CPU, torch.float32)[0].model.layers[0].mlp
    assert full.int_group_sizes == (64, 128) and full.int_tiled[1]  # w2 in tiles: a shard is no slice of its words
    for rank in range(2):
        tp = ParallelConfig(rank, 2, expert_parallel)
        block = load_model_and_tokenizer(config, CPU, torch.float32, tp)[0].model.layers[0].mlp
        assert block.int_group_sizes == (64, 128)
        for part in ("words", "scales", "mins"):
            w13, w2 = row_major_stacks(full, part)
            if expert_parallel:
                expected13, expected2 = w13[rank::2], w2[rank::2]
            else:  # rows: this rank's gate half, then its up half; w2's columns (words, groups): its half
                gate, up = w13.chunk(2, dim=1)
                expected13 = torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1)
                expected2 = w2.chunk(2, dim=2)[rank]
            got13, got2 = row_major_stacks(block, part)
            assert torch.equal(got13, expected13)
            assert torch.equal(got2, expected2)


def row_major_stacks(mlp: torch.nn.Module, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block's (w13, w2) integer stacks' words, scales or mins; words row after row (untile_words) where the
    block holds them in tiles, so that a shard compares with a slice of the unsharded stacks."""
    stacks = (getattr(mlp, f"w13_{part}"), getattr(mlp, f"w2_{part}"))
    return tuple(untile_words(t) if part == "words" and tiled else t  # type: ignore[return-value]
                 for t, tiled in zip(stacks, mlp.int_tiled))


def save_quantized_moe(case, family: str, folder, **overrides) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """A tiny MoE checkpoint in `case`'s format as quantizers write one: every linear but the lm_head and the
    routers (and Qwen2-MoE's shared-expert gate) quantized, each expert's gate / up / down as its own layer
    (Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2, Qwen's mlp.experts.{e}.gate_proj / up_proj / down_proj).
    With act order each expert has its own input-column order, one for its gate and up (which read the same
    input) and one for its down. Returns the transformers model holding the dequantized weights (fp32, eval)."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(0)
    hf_config = tiny_moe_config(family)
    for key, value in overrides.items():  # e.g. a wider intermediate size, for shards of whole groups
        setattr(hf_config, key, value)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    block, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    quantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head" and not name.endswith(
                    ("mlp.gate", "shared_expert_gate")):
                packed, w = case.pack(module.weight, 1)
                quantized.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
                module.weight.copy_(w)
            if name.endswith("mlp.experts"):
                layer = name.removesuffix(".mlp.experts")
                inter = module.down_proj.shape[2]
                for e in range(module.gate_up_proj.shape[0]):
                    for proj, weight, order in ((projs[0], module.gate_up_proj[e, :inter], 10 + e),
                                                (projs[1], module.gate_up_proj[e, inter:], 10 + e),
                                                (projs[2], module.down_proj[e], 100 + e)):
                        packed, w = case.pack(weight, order)
                        quantized.update({f"{layer}.{block}.experts.{e}.{proj}.{k}": v.contiguous()
                                          for k, v in packed.items()})
                        weight.copy_(w)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()
               if not name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
               and name.removesuffix(".weight") not in {n.rsplit(".", 1)[0] for n in quantized}}
    hf.config.save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = case.quantization_config()
    path.write_text(json.dumps(config))
    save_file({**tensors, **quantized}, str(folder / "model.safetensors"))
    return hf


# (family, format): GPTQ asymmetric 4-bit, AWQ, and compressed-tensors 8-bit per channel, at groups the tiny
# experts' 64 hidden and 32 / 96 intermediate columns hold.
QUANTIZED_EXPERTS = [("qwen3_moe", ("gptq", 4, 32, False)), ("mixtral", ("awq", 4, 32, False)),
                     ("qwen2_moe", ("compressed-tensors", 8, -1, True)),
                     # act order: each expert's columns sorted by its own groups, read through its permutation
                     ("qwen3_moe", ("gptq", 4, 32, False, True, False)),
                     ("mixtral", ("compressed-tensors", 4, 32, True, True))]


@pytest.mark.parametrize("family,case", QUANTIZED_EXPERTS, ids=[f"{f}-{c[0]}" for f, c in QUANTIZED_EXPERTS])
def test_checkpoint_experts_quantized_already_match_dequantized_transformers(family, case, tmp_path):
    """A GPTQ / AWQ / compressed-tensors checkpoint whose experts are quantized loads them into the integer stacks
    (no full-precision copy: the model is built on the meta device) and gives in tandem (fp32, CPU) the logits
    and greedy tokens transformers gives on the dequantized weights."""
    from tests.models.quantized_llama import Case

    case = Case(*case)
    hf = save_quantized_moe(case, family, tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32")
    model, model_config, _ = load_model_and_tokenizer(config, CPU, torch.float32)
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(b.int_bits == case.bits and not hasattr(b, "w13") for b in blocks)
    assert all(b.act_order == case.act_order for b in blocks)
    if case.act_order:  # the experts' own orders (gate and up: one), not the identity
        perms = blocks[0].w13_perm
        assert len({tuple(p.tolist()) for p in perms}) == perms.shape[0]
        assert not torch.equal(perms[0], torch.arange(perms.shape[1]))
    inter = blocks[0].w2_words.shape[2] * 32 // case.bits
    assert blocks[0].int_group_sizes == ((64, inter) if case.group == -1 else (case.group, case.group))
    assert blocks[0].gate.int_bits == 0
    run_and_compare(f"{family}-{case.id}", hf, model, model_config, "cpu", atol=1e-4)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_quantized_checkpoint_experts_shard_like_their_stacks(expert_parallel, tmp_path):
    """At TP=2 a rank holds its experts (EP) or every expert's half of the intermediate dimension (TP): the
    unsharded model's integer stacks, sliced, whole groups of w2's columns on each rank."""
    from tandem.config import ParallelConfig
    from tests.models.quantized_llama import Case

    save_quantized_moe(Case("gptq", 4, 32, False), "qwen3_moe", tmp_path, moe_intermediate_size=64,
                       intermediate_size=128)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32")
    full = load_model_and_tokenizer(config, CPU, torch.float32)[0].model.layers[1].mlp
    for rank in range(2):
        block = load_model_and_tokenizer(config, CPU, torch.float32, ParallelConfig(rank, 2, expert_parallel))[0]
        block = block.model.layers[1].mlp
        for part in ("words", "scales", "mins"):
            w13, w2 = row_major_stacks(full, part)
            if expert_parallel:
                expected13, expected2 = w13[rank::2], w2[rank::2]
            else:
                gate, up = w13.chunk(2, dim=1)
                expected13 = torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1)
                expected2 = w2.chunk(2, dim=2)[rank]
            got13, got2 = row_major_stacks(block, part)
            assert torch.equal(got13, expected13), (rank, part)
            assert torch.equal(got2, expected2), (rank, part)


def test_quantized_experts_in_part_or_in_act_order_shard_or_are_refused(tmp_path):
    """A block whose experts are quantized in part is refused before any tensor is read, naming the layer. Experts
    in act order shard: whole experts with their orders (expert parallel), or (tensor parallel) every expert's
    gate / up rows with its full input order and half of down's group-sorted columns with their slice of its
    order; an expert whose gate and up disagree on their input's order is refused."""
    from safetensors.torch import load_file, save_file

    from tests.models.quantized_llama import Case

    save_quantized_moe(Case("gptq", 4, 32, False), "qwen3_moe", tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    prefix = "model.layers.1.mlp.experts.5.up_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(f"{prefix}.{suffix}", None)
    tensors[f"{prefix}.weight"] = torch.zeros(32, 64)
    save_file(tensors, path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp: the checkpoint quantizes 23 of its 24"):
        load_model_and_tokenizer(config, CPU, torch.float32)
    from tandem.config import ParallelConfig

    act = tmp_path / "act"
    act.mkdir()
    save_quantized_moe(Case("gptq", 4, 32, False, act_order=True), "qwen3_moe", act, moe_intermediate_size=64,
                       intermediate_size=128)
    config = EngineConfig(model=str(act), device="cpu", dtype="float32")
    full = load_model_and_tokenizer(config, CPU, torch.float32)[0].model.layers[1].mlp
    for rank in range(2):
        block = load_model_and_tokenizer(config, CPU, torch.float32, ParallelConfig(rank, 2, True))[0]
        block = block.model.layers[1].mlp  # expert parallel: a rank's experts whole, with their orders
        for part in ("perm", "words", "scales"):
            assert torch.equal(getattr(block, f"w13_{part}"), getattr(full, f"w13_{part}")[rank::2])
            assert torch.equal(getattr(block, f"w2_{part}"), getattr(full, f"w2_{part}")[rank::2])
        block = load_model_and_tokenizer(config, CPU, torch.float32, ParallelConfig(rank, 2, False))[0]
        block = block.model.layers[1].mlp  # tensor parallel: down's sorted columns [32 rank, 32 rank + 32)
        assert torch.equal(block.w13_perm, full.w13_perm)
        assert torch.equal(block.w2_perm, full.w2_perm[:, 32 * rank:32 * rank + 32])
        assert torch.equal(block.w2_scales, full.w2_scales[:, :, rank:rank + 1])
    path = str(act / "model.safetensors")
    tensors = load_file(path)
    up = "model.layers.1.mlp.experts.3.up_proj.g_idx"
    tensors[up] = tensors["model.layers.1.mlp.experts.4.up_proj.g_idx"].clone()  # another expert's order
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"experts\.3\.(gate|up)_proj.*act-order g_idx of gate and up must agree"):
        load_model_and_tokenizer(config, CPU, torch.float32)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "llama"])
def test_make_int_checkpoint_writes_shapes_that_load(kind, tmp_path, monkeypatch):
    """scripts/make_int_checkpoint.py on a tiny shape in act order (what `--shape qwen3-30b-a3b --format
    gptq-desc-act` writes at full size): a MoE shape's every expert matrix quantized, its router in bf16; tandem
    loads it (each expert its own orders, gate and up one) and generates. A Llama shape as before."""
    import sys
    from pathlib import Path

    from tandem import LLM, SamplingParams
    from tandem.models.loader import NAMED_SHAPES

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import make_int_checkpoint

    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    shape = (dict(base, model_type="qwen3_moe", intermediate_size=128, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[]) if kind == "qwen3_moe" else
             dict(base, model_type="mixtral", intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=None) if kind == "mixtral" else dict(base, model_type="llama", intermediate_size=128))
    monkeypatch.setitem(NAMED_SHAPES, "tiny-moe", shape)
    monkeypatch.setattr(sys, "argv", ["make_int_checkpoint.py", "--shape", "tiny-moe", "--format", "gptq-desc-act",
                                      "--group-size", "32", "--out", str(tmp_path)])
    make_int_checkpoint.main()
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32,
              skip_tokenizer_init=True)
    try:
        block = llm.engine.runner.model.model.layers[1].mlp  # Mixtral's block_sparse_moe too
        if kind == "llama":
            assert block.gate_up_proj.int_bits == 4 and block.gate_up_proj.perm is not None
        else:
            assert block.act_order and block.int_bits == 4
            assert len({tuple(p.tolist()) for p in block.w13_perm}) == 4  # each expert its own order
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
