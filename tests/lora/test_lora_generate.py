"""LoRA adapters end to end on the CPU in fp32: one batch mixing three adapters and the base model gives, per
request, the greedy tokens of transformers + peft with its adapter (overlap on and off; rsLoRA and attention-only
adapters; adapters paging through fewer slots than adapters); bad adapters are refused naming them."""

from __future__ import annotations

import json
import os

import pytest

from tandem import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import peft_greedy, save_adapter, save_base

pytest.importorskip("peft")

MAX_TOKENS = 6
PROMPTS = [[5, 9, 17, 33, 2, 71], [40, 41, 42], [8, 100, 3, 60, 12, 13, 14, 15, 90], [7, 7, 7, 21],
           [99, 1, 64, 30, 2]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = save_base(request.param, str(root / "base"))
    adapters = {
        "all": save_adapter(base, str(root / "all"), ALL, r=8, alpha=16, seed=1),
        "attn-rslora": save_adapter(base, str(root / "attn"), ["q_proj", "k_proj", "v_proj", "o_proj"], r=4,
                                    alpha=8, use_rslora=True, seed=2, scale=0.5),
        "mlp": save_adapter(base, str(root / "mlp"), ["gate_proj", "down_proj", "up_proj"], r=16, alpha=8, seed=3),
    }
    lora = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    # Request i runs with adapter `order[i]` (None: the base model).
    order = ["all", None, "attn-rslora", "mlp", "all"]
    expected = [peft_greedy(base, None if a is None else adapters[a], p, MAX_TOKENS) for a, p in zip(order, PROMPTS)]
    base_tokens = [peft_greedy(base, None, p, MAX_TOKENS) for p in PROMPTS]
    # The adapters must change the answer, or the test could not fail.
    assert sum(e != b for e, b in zip(expected, base_tokens)) >= 3
    return base, lora, [None if a is None else lora[a] for a in order], expected


def _llm(base: str, **kwargs) -> LLM:
    kwargs.setdefault("max_lora_rank", 16)
    return LLM(base, device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=64, max_model_len=64, **kwargs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_mixed_batch_matches_peft(setup, overlap):
    base, _, loras, expected = setup
    llm = _llm(base, max_loras=3, overlap=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_speculation_with_adapters_matches_peft(setup, overlap):
    """Drafts verified under each request's adapter (the base model as its own draft model, so every step past
    the prompts verifies drafts; verify steps whose rows are each sequence's own row and then its drafts take
    each row's adapter from its sequence) give peft's greedy tokens, drafts accepted and rejected."""
    base, _, loras, expected = setup
    spec = {"method": "draft_model", "model": base, "num_speculative_tokens": 3}
    llm = _llm(base, max_loras=3, overlap=overlap, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = llm.engine
    assert engine.spec_draft_tokens > engine.spec_accepted_tokens > 0


def test_adapters_page_through_fewer_slots(setup):
    """Three adapters, one device slot and one host copy: requests wait for the slot and adapters are read again;
    the prefix cache never serves one adapter's KV to another (the same prompt under every adapter)."""
    base, lora, loras, expected = setup
    llm = _llm(base, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected
    prompt = PROMPTS[2] * 4  # two full blocks of 16: cacheable
    runs = [None, lora["all"], lora["mlp"], None, lora["all"]]
    outs = llm.generate([prompt] * len(runs), params, use_tqdm=False, lora_request=runs)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == got[3] and got[1] == got[4] and len({tuple(g) for g in got[:3]}) == 3
    base_folder = base
    assert got[1] == peft_greedy(base_folder, lora["all"].lora_path, prompt, MAX_TOKENS)


def test_bad_adapters_are_refused_by_name(setup, tmp_path):
    base, lora, _, _ = setup
    llm = _llm(base, max_loras=1, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    cases = {
        "missing": (LoRARequest("missing", 10, str(tmp_path / "nowhere")), "not a folder"),
        "too-big": (LoRARequest("too-big", 11, lora["mlp"].lora_path), "rank 16 exceeds max_lora_rank 8"),
    }
    saves = tmp_path / "saves"
    save_adapter(base, str(saves), ["q_proj"], r=4)
    with open(saves / "adapter_config.json") as f:
        config = json.load(f)
    config["modules_to_save"] = ["lm_head"]
    with open(saves / "adapter_config.json", "w") as f:
        json.dump(config, f)
    cases["saves"] = (LoRARequest("saves", 12, str(saves)), "modules_to_save")
    for name, (req, reason) in cases.items():
        with pytest.raises(ValueError, match=reason) as err:
            llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=req)
        assert repr(name) in str(err.value)
    # The engine goes on serving after a refusal.
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=lora["all"])[0].outputs[0].token_ids)
    with pytest.raises(ValueError, match="list of 2"):
        llm.generate([[1, 2], [3, 4]], params, use_tqdm=False, lora_request=[lora["all"]])
    with pytest.raises(ValueError, match="without enable_lora"):
        LLM(base, device="cpu", dtype="float32", num_kv_blocks=16).generate(
            [[1, 2]], params, use_tqdm=False, lora_request=lora["all"])


def test_shape_mismatch_and_foreign_modules_are_refused(setup, tmp_path):
    base, _, _, _ = setup
    llm = _llm(base, max_loras=1)
    # The shapes an adapter must have are the base model's own modules' (in, out), as transformers builds them.
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    want = {name: (m.in_features, m.out_features) for name, m in hf.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ALL}
    assert llm.engine.runner.lora.module_shapes() == want
    other = save_base("mistral", str(tmp_path / "other"))  # head_dim 32: q_proj maps 64 -> 128
    bad = save_adapter(other, str(tmp_path / "bad"), ["q_proj"], r=4)
    with pytest.raises(ValueError, match="'bad'.*q_proj has A"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("bad", 5, bad))
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(bad, "adapter_model.safetensors"))
    renamed = {k.replace("layers.0.", "layers.7."): v for k, v in tensors.items() if "layers.0." in k}
    save_file(renamed, os.path.join(bad, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="'bad2'.*not a projection this model has"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("bad2", 6, bad))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, bad)


def test_moe_attention_adapter_matches_peft(tmp_path):
    """The attention of a mixture of experts (Qwen2-MoE: shared expert, one dense layer) under an adapter."""
    import torch
    import transformers

    from tests.models.test_moe_parity import tiny_moe_config

    torch.manual_seed(0)
    base = str(tmp_path / "base")
    transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen2_moe")).float().eval().save_pretrained(base)
    path = save_adapter(base, str(tmp_path / "attn"), ["q_proj", "k_proj", "v_proj", "o_proj"], r=8, seed=4,
                        scale=0.5)
    loras = [LoRARequest("attn", 1, path), None]
    prompts = PROMPTS[:2]
    expected = [peft_greedy(base, path, prompts[0], MAX_TOKENS), peft_greedy(base, None, prompts[1], MAX_TOKENS)]
    assert expected[0] != peft_greedy(base, None, prompts[0], MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _llm(base, max_loras=1).generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("bits", [4, 8])
def test_integer_base_weights_with_adapters_match_peft_on_the_dequantized_base(bits, tmp_path):
    """quantization int4 / int8 (round to nearest at load) under adapters: each request's tokens are those of
    transformers + peft on the same base weights dequantized to fp32 (the adapters' deltas stay in fp32 beside the
    integer product)."""
    import torch
    import transformers

    from tandem.layers.int_quant import quantize_rtn, rtn_group_size

    base = save_base("llama", str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                group = rtn_group_size(module.in_features)
                module.weight.copy_(quantize_rtn(module.weight, bits, group).dequantize())
    dequantized = str(tmp_path / "dequantized")
    hf.save_pretrained(dequantized)
    paths = [save_adapter(base, str(tmp_path / "all"), ALL, r=8, seed=1),
             save_adapter(base, str(tmp_path / "mlp"), ["gate_proj", "up_proj", "down_proj"], r=4, seed=2)]
    loras = [LoRARequest("all", 1, paths[0]), None, LoRARequest("mlp", 2, paths[1])]
    prompts = PROMPTS[:3]
    expected = [peft_greedy(dequantized, None if r is None else r.lora_path, p, MAX_TOKENS)
                for r, p in zip(loras, prompts)]
    assert expected[0] != peft_greedy(dequantized, None, prompts[0], MAX_TOKENS)
    llm = _llm(base, max_loras=2, quantization=f"int{bits}")
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.int_bits == bits
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_gpt2_conv1d_adapters_match_peft(tmp_path):
    """GPT-2's Conv1D projections (PEFT stores them fan_in_fan_out; A and B apply as for a Linear): an adapter on
    the fused c_attn, both c_proj and c_fc, and an attention-only one, in one batch with the base model."""
    base = save_base("gpt2", str(tmp_path / "base"))
    paths = [save_adapter(base, str(tmp_path / "all"), ["c_attn", "c_proj", "c_fc"], r=8, seed=1),
             save_adapter(base, str(tmp_path / "attn"), ["c_attn"], r=4, use_rslora=True, seed=2, scale=0.5)]
    with open(os.path.join(paths[0], "adapter_config.json")) as f:
        assert json.load(f)["fan_in_fan_out"] is True
    loras = [LoRARequest("all", 1, paths[0]), None, LoRARequest("attn", 2, paths[1])]
    prompts = PROMPTS[:3]
    expected = [peft_greedy(base, None if r is None else r.lora_path, p, MAX_TOKENS) for r, p in zip(loras, prompts)]
    assert all(expected[i] != peft_greedy(base, None, prompts[i], MAX_TOKENS) for i in (0, 2))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _llm(base, max_loras=2).generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_stats_count_requests_per_adapter_and_page_ins(setup):
    """EngineCore.stats(): running and waiting requests per adapter name (one slot: the second adapter's request
    waits for it), the page-ins and host copies so far; /metrics shows them per adapter, 0 once none is left."""
    from tandem.engine.messages import merge_stats, stats_to_wire
    from tandem.server.metrics import ServerMetrics

    base, lora, _, _ = setup
    engine = _llm(base, max_loras=1, max_cpu_loras=2).engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params, lora["all"])
    engine.add_request("b", PROMPTS[1], params, lora["mlp"])
    engine.add_request("c", PROMPTS[2], params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(engine.stats())
    # Whichever host copy is made first runs first; the other waits for the one slot, then runs alone.
    both = [s for s in seen if len(s.lora_running) == 1 and s.lora_waiting]
    assert both and all(set(s.lora_running.values()) == set(s.lora_waiting.values()) == {1} for s in both)
    first, second = next(iter(both[0].lora_running)), next(iter(both[0].lora_waiting))
    assert {first, second} == {"all", "mlp"}
    assert any(s.lora_running == {second: 1} and not s.lora_waiting for s in seen)
    assert (seen[-1].lora_running, seen[-1].lora_page_ins, seen[-1].lora_host_copies) == ({}, 2, 2)
    wire = merge_stats([stats_to_wire(both[0]), stats_to_wire(both[0])])  # two replicas' views add up
    assert (wire.lora_running, wire.lora_waiting) == ({first: 2}, {second: 2})
    metrics = ServerMetrics()
    text = metrics.render(stats_to_wire(both[0]), 0).decode()
    assert f'tandem_lora_requests_running{{adapter="{first}"}} 1.0' in text
    assert f'tandem_lora_requests_waiting{{adapter="{second}"}} 1.0' in text
    text = metrics.render(stats_to_wire(seen[-1]), 0).decode()
    assert f'tandem_lora_requests_running{{adapter="{first}"}} 0.0' in text and "tandem_lora_page_ins 2.0" in text


def test_cli_generate_under_an_adapter(tmp_path, capsys):
    """`tandem generate --lora PATH`: every prompt under the adapter (LoRA switched on for it), the text the
    adapter gives offline; a rank above --max-lora-rank is an error naming the adapter (exit 2)."""
    from tandem.cli import main
    from tests.parallel.tiny_models import save_tiny_tokenizer

    base = save_tiny_tokenizer(save_base("llama", str(tmp_path / "base")))
    path = save_adapter(base, str(tmp_path / "sql"), ALL, r=8, seed=1)
    argv = ["generate", "--model", base, "--device", "cpu", "--dtype", "float32", "--max-tokens", "6",
            "--ignore-eos", "--prompt", "Hello there", "--num-kv-blocks", "32"]
    assert main(argv + ["--lora", path]) == 0
    adapted = capsys.readouterr().out
    assert main(argv) == 0
    plain = capsys.readouterr().out
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = llm.generate(["Hello there"], params, use_tqdm=False, lora_request=LoRARequest("sql", 1, path))[0]
    assert repr(text.outputs[0].text) in adapted and adapted.split("[")[0] != plain.split("[")[0]
    assert main(argv + ["--lora", path, "--max-lora-rank", "4"]) == 2
    assert "'sql'" in capsys.readouterr().err


def test_prompt_logprobs_under_adapters_match_peft(setup):
    """Scoring under adapters (max_tokens 0, prompt_logprobs): each prompt's log-probs are those of transformers +
    peft with its adapter, the base model's for a request without one, in one batch."""
    import torch
    import transformers
    from peft import PeftModel

    base, lora, _, _ = setup
    order = [lora["all"], None, lora["attn-rslora"]]
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[0]]
    outs = _llm(base, max_loras=2).generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0),
                                            use_tqdm=False, lora_request=order)
    for out, request, ids in zip(outs, order, prompts):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        if request is not None:
            model = PeftModel.from_pretrained(model, request.lora_path).eval()
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        got = [entry[ids[j + 1]] for j, entry in enumerate(out.prompt_logprobs[1:])]
        want = [float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)]
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4, (request, got, want)
    assert outs[0].prompt_logprobs != outs[1].prompt_logprobs  # the adapter moves them


def test_an_adapter_id_removed_then_added_again_reads_its_folder_anew(setup, tmp_path):
    """Offline: remove_lora, new weights in the same folder, the same LoRARequest again: the new weights answer,
    also for a prompt whose blocks the prefix cache kept from before the removal."""
    base, _, _, _ = setup
    folder = save_adapter(base, str(tmp_path / "rl"), ALL, r=8, seed=21)
    request = LoRARequest("rl", 7, folder)
    prompt = PROMPTS[2] * 4  # 36 tokens: two full KV blocks the prefix cache keeps
    llm = _llm(base, max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False, lora_request=request)[0].outputs[0].token_ids
    assert before == peft_greedy(base, folder, prompt, MAX_TOKENS)
    llm.engine.remove_lora(request.lora_int_id)
    save_adapter(base, folder, ALL, r=8, seed=22)
    after = llm.generate([prompt], params, use_tqdm=False, lora_request=request)[0]
    assert after.outputs[0].token_ids == peft_greedy(base, folder, prompt, MAX_TOKENS) != before
