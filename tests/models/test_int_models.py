"""Whole models in 4 and 8 bits: a tiny Llama quantized in the test into GPTQ, AWQ and compressed-tensors (and
round to nearest at load, int4 / int8) gives in tandem (fp32, CPU) the logits and greedy tokens transformers gives
on the same weights dequantized to fp32; shards, fused projections and bad checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem.config import EngineConfig, ParallelConfig
from tandem.layers.int_quant import quantize_rtn
from tandem.layers.linear import Linear
from tandem.models.loader import load_model_and_tokenizer
from tests.models.quantized_llama import CONFIG, Case, save_quantized_llama
from tests.models.test_hf_parity import run_and_compare

transformers = pytest.importorskip("transformers")

CASES = [
    Case("gptq", 4, 128, sym=True),
    Case("gptq", 4, 64, sym=False, act_order=True, gptq_v1=False),
    Case("gptq", 8, 32, sym=False, act_order=True),
    Case("gptq", 4, -1, sym=True, gptq_v1=False),
    Case("awq", 4, 128, sym=False),
    Case("compressed-tensors", 4, 128, sym=True),
    Case("compressed-tensors", 4, -1, sym=False),
    Case("compressed-tensors", 8, 64, sym=True, act_order=True),
    Case("compressed-tensors", 8, 32, sym=False),
]
CPU = torch.device("cpu")


def load(folder, tp: ParallelConfig | None = None, **kwargs):
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", **kwargs)
    model, model_config, _ = load_model_and_tokenizer(config, CPU, torch.float32, tp)
    return model, model_config


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_quantized_checkpoint_matches_dequantized_transformers(case, tmp_path):
    hf = save_quantized_llama(case, tmp_path)
    model, model_config = load(tmp_path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.int_bits == case.bits and qkv.qweight.dtype == torch.uint8
    assert (getattr(qkv, "perm", None) is not None) == case.act_order
    assert model.lm_head.weight.dtype == torch.float32  # the lm_head and embeddings stay in the model dtype
    run_and_compare(case.id, hf, model, model_config, "cpu", atol=1e-4)


@pytest.mark.parametrize("case", [Case("gptq", 4, 64, sym=False, act_order=True), Case("awq", 4, 128, sym=False)],
                         ids=lambda c: c.id)
def test_checkpoint_with_a_quantized_lm_head(case, tmp_path):
    """A checkpoint whose lm_head is quantized too (GPTQModel's `lm_head: true`; act order: its own input order)
    loads it as an integer layer and gives transformers' logits and tokens on the dequantized weights; a tied
    model, whose logits read the embedding table, refuses one by name."""
    hf = save_quantized_llama(case, tmp_path, lm_head=True)
    model, model_config = load(tmp_path)
    assert model.lm_head.int_bits == 4 and not hasattr(model.lm_head, "weight")
    assert (getattr(model.lm_head, "perm", None) is not None) == case.act_order
    run_and_compare(f"{case.id}-lm-head", hf, model, model_config, "cpu", atol=1e-4)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({**config, "tie_word_embeddings": True}, f)
    with pytest.raises(ValueError, match="'lm_head': a quantized lm_head needs a model with its own"):
        load(tmp_path)


def test_quantized_qwen2_with_full_precision_biases(tmp_path):
    hf = save_quantized_llama(Case("gptq", 4, 64, sym=False, act_order=True), tmp_path, family="qwen2")
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    model, model_config = load(tmp_path)
    assert model_config.architecture == "qwen2" and model.model.layers[0].self_attn.qkv_proj.int_bits == 4
    run_and_compare("qwen2", hf, model, model_config, "cpu", atol=1e-4)


@pytest.mark.parametrize("quantization,bits", [("int4", 4), ("int8", 8)])
def test_round_to_nearest_at_load_matches_dequantized_transformers(quantization, bits, tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float().eval()
    hf.save_pretrained(tmp_path)
    model, model_config = load(tmp_path, quantization=quantization)
    down = model.model.layers[1].mlp.down_proj
    assert down.int_bits == bits and down.group_size == 128 and down.scales.shape == (128, 2)
    # Rows are quantized on their own, so q, k and v apart give the fused projection's values.
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize_rtn(module.weight, bits, 128).dequantize())
    run_and_compare(quantization, hf, model, model_config, "cpu", atol=1e-4)


def test_round_to_nearest_at_load_holds_one_layer_in_full_precision(tmp_path, monkeypatch):
    """quantization int4 of a full-precision checkpoint split over two files, its layers out of file order: the
    model is built without storage for its linears, each layer gets it as its tensors come (in layer order) and
    is quantized before the next one gets it, so at most one decoder layer is ever in full precision; the model is
    the one quantized after a whole load."""
    from safetensors.torch import save_file

    import tandem.models.int_loading as int_loading

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 3})).float().eval()
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    files = {"a.safetensors": lambda k: ".layers.2." in k or "embed" in k, "b.safetensors": lambda k: True}
    weight_map: dict[str, str] = {}
    for file, takes in files.items():
        part = {k: v for k, v in state.items() if k not in weight_map and takes(k)}
        weight_map.update({k: file for k in part})
        save_file(part, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    held = []
    materialize = int_loading.materialize_meta

    def counting(layer, device):  # a decoder layer about to get its storage: the layers' full-precision linears
        held.append(sum(1 for m in loaded.model.layers.modules() if isinstance(m, Linear) and not m.int_bits
                        and not m.weight.is_meta))
        return materialize(layer, device)

    loaded = None
    build = int_loading.quantize_as_loaded

    def remembering(model, weights, bits, device):
        nonlocal loaded
        loaded = model
        return build(model, weights, bits, device)

    monkeypatch.setattr(int_loading, "materialize_meta", counting)
    monkeypatch.setattr("tandem.models.loader.quantize_as_loaded", remembering)
    model, model_config = load(tmp_path, quantization="int4")
    assert held == [0, 0, 0]  # three layers, each materialized with no other layer in full precision
    monkeypatch.undo()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize_rtn(module.weight, 4, 128).dequantize())
    run_and_compare("int4-streamed", hf, model, model_config, "cpu", atol=1e-4)


def test_tensor_parallel_shards_hold_the_full_weight(tmp_path):
    """At TP=2 each rank's integer shards (row-parallel: whole groups of input columns; column-parallel:
    output rows of each fused part) put together give the unsharded layer."""
    save_quantized_llama(Case("gptq", 4, 64, sym=False), tmp_path)
    full, _ = load(tmp_path)
    ranks = [load(tmp_path, ParallelConfig(rank=r, size=2))[0] for r in range(2)]
    for name in ("self_attn.o_proj", "mlp.down_proj", "mlp.gate_up_proj", "self_attn.qkv_proj"):
        whole = full.get_submodule(f"model.layers.1.{name}").packed_weight().dequantize()
        shards = [m.get_submodule(f"model.layers.1.{name}").packed_weight().dequantize() for m in ranks]
        if name.endswith(("o_proj", "down_proj")):
            torch.testing.assert_close(torch.cat(shards, dim=1), whole, atol=0, rtol=0)
            continue
        sizes = [256, 256] if "gate_up" in name else [128, 64, 64]  # each part's full rows
        parts = whole.split(sizes)
        for r, shard in enumerate(shards):
            expected = torch.cat([p[r * p.shape[0] // 2:(r + 1) * p.shape[0] // 2] for p in parts])
            torch.testing.assert_close(shard, expected, atol=0, rtol=0)


def test_autogptq_quantize_config_json(tmp_path):
    """Older AutoGPTQ folders describe their quantization in quantize_config.json, not in config.json."""
    hf = save_quantized_llama(Case("gptq", 4, 64, sym=False, act_order=True), tmp_path)
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    with open(path, "w") as f:
        json.dump(config, f)
    with open(os.path.join(tmp_path, "quantize_config.json"), "w") as f:
        json.dump({k: v for k, v in qc.items() if k not in ("quant_method", "checkpoint_format")}, f)
    model, model_config = load(tmp_path)
    assert model.model.layers[0].mlp.down_proj.int_bits == 4
    run_and_compare("quantize_config.json", hf, model, model_config, "cpu", atol=1e-4)


def test_shards_that_split_a_group_are_refused(tmp_path):
    save_quantized_llama(Case("gptq", 4, 128, sym=True), tmp_path)
    with pytest.raises(ValueError, match="self_attn.o_proj: group size 128 does not divide its 64 input columns"):
        load(tmp_path, ParallelConfig(rank=0, size=2))


def test_act_order_row_parallel_shards_hold_sorted_columns(tmp_path):
    """A row-parallel act-order layer over two ranks: rank r holds the r-th half of the group-sorted columns (whole
    groups) and the half of the permutation that names them in the whole input, so the ranks' products of the
    gathered input add up to the whole layer's."""
    from tandem.kernels.reference import dequantize_int_weight

    save_quantized_llama(Case("gptq", 4, 32, sym=True, act_order=True), tmp_path)
    full, _ = load(tmp_path)
    ranks = [load(tmp_path, ParallelConfig(rank=r, size=2))[0] for r in range(2)]
    for name, width in (("self_attn.o_proj", 128), ("mlp.down_proj", 256)):
        whole = full.get_submodule(f"model.layers.1.{name}")
        shards = [m.get_submodule(f"model.layers.1.{name}").packed_weight() for m in ranks]
        assert not torch.equal(whole.perm, torch.arange(width))
        torch.testing.assert_close(torch.cat([s.perm for s in shards]), whole.perm, atol=0, rtol=0)
        x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
        sorted_product = [x[:, s.perm] @ dequantize_int_weight(s.qweight, s.scales, s.zeros, 4, 32).T
                          for s in shards]
        torch.testing.assert_close(sum(sorted_product), x @ whole.packed_weight().dequantize().T)


def _edit(folder, edit_config=None, edit_tensors=None) -> None:
    from safetensors.torch import load_file, save_file

    if edit_config is not None:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config["quantization_config"])
        with open(path, "w") as f:
            json.dump(config, f)
    if edit_tensors is not None:
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)


def test_bad_checkpoints_are_refused_before_anything_runs(tmp_path):
    save_quantized_llama(Case("gptq", 4, 64, sym=True, act_order=True), tmp_path)

    def bits8(qc):
        qc["bits"] = 8

    _edit(tmp_path, edit_config=bits8)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.*scales .* disagree with qweight"):
        load(tmp_path)
    _edit(tmp_path, edit_config=lambda qc: qc.update(bits=4))

    def other_k_order(tensors):  # k_proj reads the shared input in another order than q_proj and v_proj
        tensors["model.layers.0.self_attn.k_proj.g_idx"] = tensors["model.layers.0.self_attn.o_proj.g_idx"].clone()

    _edit(tmp_path, edit_tensors=other_k_order)
    with pytest.raises(ValueError, match="input-column order differs.*qkv_proj"):
        load(tmp_path)

    def drop_scales(tensors):
        del tensors["model.layers.1.mlp.up_proj.scales"]

    save_quantized_llama(Case("gptq", 4, 64, sym=True, act_order=True), tmp_path)
    _edit(tmp_path, edit_tensors=drop_scales)
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj' is incomplete"):
        load(tmp_path)
    with pytest.raises(ValueError, match="already"):
        load(tmp_path, quantization="int4")


def test_partly_quantized_fused_projection_is_refused(tmp_path):
    save_quantized_llama(Case("awq", 4, 128, sym=False), tmp_path)

    def plain_v(tensors):
        for suffix in ("qweight", "qzeros", "scales"):
            del tensors[f"model.layers.0.self_attn.v_proj.{suffix}"]
        tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(64, 128)

    _edit(tmp_path, edit_tensors=plain_v)
    with pytest.raises(ValueError, match="qkv_proj: the checkpoint quantizes"):
        load(tmp_path)


def test_round_to_nearest_group_sizes(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "intermediate_size": 96})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model, _ = load(tmp_path, quantization="int4")
    mlp = model.model.layers[0].mlp
    assert (mlp.gate_up_proj.group_size, mlp.down_proj.group_size) == (128, 32)  # 128 where it divides
    config = transformers.LlamaConfig(**{**CONFIG, "intermediate_size": 100})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"mlp.down_proj: no group size of \(128, 64, 32\) divides its 100"):
        load(tmp_path, quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=str(tmp_path), quantization="int3")


def test_roofline_counts_packed_bytes(tmp_path):
    from tandem.bench.roofline import model_cost

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    full, mc = load(tmp_path)
    int4, _ = load(tmp_path, quantization="int4")
    before, after = model_cost(full, mc), model_cost(int4, mc)
    assert after.body_params == before.body_params  # the same multiplications
    # Per layer 4 linears of 128 inputs (qkv 256 rows, o 128, gate_up 512) and down (256 inputs, 128 rows):
    # half a byte a weight plus an fp32 scale and zero per 128 weights.
    weights = CONFIG["num_hidden_layers"] * (128 * (256 + 128 + 512) + 256 * 128)
    assert before.weight_bytes - after.weight_bytes == weights * 4 - weights * (0.5 + 8 / 128)


@pytest.mark.parametrize("bits,tied", [(4, False), (8, True)], ids=["int4-untied", "int8-tied"])
def test_quantize_lm_head_in_integer_codes(tmp_path, bits, tied):
    """quantize_lm_head with int4 / int8: the logits projection in round-to-nearest codes too (a tied model gets
    them from its embedding table, whose lookups keep the model dtype); tandem (fp32, CPU) gives the logits and
    greedy tokens of transformers on the same weights with every linear, the head too, dequantized. The roofline
    reads the head's packed bytes and keeps its multiplications apart from the body's."""
    from tandem.bench.roofline import model_cost

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": tied}))
    hf.save_pretrained(tmp_path)
    method = f"int{bits}"
    model, mc = load(tmp_path, quantization=method, quantize_lm_head=True)
    body, _ = load(tmp_path, quantization=method)
    assert model.lm_head.int_bits == bits and model.lm_head.group_size == 128
    assert (body.lm_head is None) == tied and model.model.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(model.model.embed_tokens.weight, hf.model.embed_tokens.weight, atol=0, rtol=0)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize_rtn(module.weight, bits, 128).dequantize())
        head = quantize_rtn(hf.lm_head.weight.detach().clone(), bits, 128).dequantize()
        hf.lm_head.weight = torch.nn.Parameter(head)  # its own tensor: a tied embedding keeps full precision
    run_and_compare(f"{method}-lm-head", hf, model, mc, "cpu", atol=1e-4)
    with_head, without = model_cost(model, mc), model_cost(body, mc)
    vocab, hidden = CONFIG["vocab_size"], CONFIG["hidden_size"]
    head_bytes = vocab * hidden * bits // 8 + 2 * 4 * vocab * (hidden // 128)  # codes, fp32 scale and zero a group
    assert with_head.body_params == without.body_params and with_head.lm_head_params == vocab * hidden
    assert without.weight_bytes - with_head.weight_bytes == vocab * hidden * 4 - head_bytes


def test_quantize_lm_head_needs_a_quantization(tmp_path):
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization fp8, int4 or int8.*None"):
        EngineConfig(model=str(tmp_path), quantize_lm_head=True)
    assert EngineConfig(model=str(tmp_path), quantization="int8", quantize_lm_head=True).quantize_lm_head


def test_integer_models_never_allocate_full_precision_linears():
    from tandem.layers.norm import RMSNorm
    from tandem.models.int_loading import EmptyOnMeta, materialize_meta

    with EmptyOnMeta():
        linear, norm = Linear(8, 4, bias=True), RMSNorm(8)
    assert linear.weight.is_meta and linear.bias.is_meta  # storage the loader would only overwrite
    assert torch.equal(norm.weight, torch.ones(8))  # construction values are kept
    linear.use_int_weight_(4, 8, name="linear")
    assert linear.qweight.is_meta and not hasattr(linear, "weight")
    materialize_meta(linear, CPU)
    assert linear.qweight.device == CPU and linear.qweight.shape == (4, 4) and linear.bias.device == CPU
    # Dummy weights at int4: every linear but the lm_head quantized as it is drawn.
    model, _ = load("llama-3.2-1b", load_format="dummy", quantization="int4",
                    hf_overrides=dict(num_hidden_layers=1, hidden_size=256, intermediate_size=512, vocab_size=512,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("qweight")} == {torch.uint8}
    assert not any(p.is_meta for p in model.parameters()) and model.lm_head is None  # tied: the embedding


def test_bench_runs_a_checkpoint_in_place_of_random_weights(tmp_path):
    from tandem.bench.offline import bench_workload
    from tandem.bench.workloads import Workload

    save_quantized_llama(Case("awq", 4, 128, sym=False), tmp_path)
    tiny = Workload("tiny", None, 2, (8, 8), (4, 4), dtype="float32", device="cpu")
    result = bench_workload(tiny, [], 1.0, None, checkpoint=str(tmp_path))
    assert result["checkpoint"] == str(tmp_path)
    # The folder's packed body and its fp32 embeddings, not the embedded model's.
    assert result["weight_bytes"] < 300_000
