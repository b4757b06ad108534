"""Data parallelism on the CPU with a tiny model: validation, replica environments, DP x TP, a replica killed
mid-generate, and the offline bench's DP run beside its dp1 peer."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tests.parallel.tiny_models import VOCAB, save_tiny

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=64)
PROMPTS = [[(5 * i + j) % (VOCAB - 4) + 4 for j in range(3 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_data_parallel_size_is_validated(value):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineConfig(data_parallel_size=value)


def test_bad_data_parallel_settings_fail_before_any_process_starts(tiny_llama):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM(tiny_llama, data_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="use device 'cuda' or 'auto'"):
        LLM(tiny_llama, data_parallel_size=2, **{**ENGINE, "device": "cuda:1"})
    with pytest.raises(ValueError, match="not found"):
        LLM("/no/such/model", data_parallel_size=2, **ENGINE)
    if not _cuda_count() >= 2:
        with pytest.raises(ValueError, match="needs 2 GPUs"):
            LLM(tiny_llama, data_parallel_size=2, **{**ENGINE, "device": "cuda"})
    assert psutil.Process().children(recursive=True) == before

    from tandem.cli import main

    assert main(["generate", "--model", tiny_llama, "--device", "cpu", "--data-parallel-size", "0"]) == 2
    assert main(["bench", "--workload", "cpu", "--no-peers", "--data-parallel-size", "0"]) == 2


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_replica_env(monkeypatch):
    from tandem.engine import launch as launcher

    for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(key, raising=False)
    cpu = EngineConfig(device="cpu")
    assert launcher.replica_env(cpu, 0, 1) == {}
    assert launcher.replica_env(cpu, 1, 2) == {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    monkeypatch.setattr(launcher, "_cuda_device_count", lambda: 4)
    gpu = EngineConfig(device="cuda", tensor_parallel_size=2)
    env = launcher.replica_env(gpu, 1, 2)
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}
    with pytest.raises(ValueError, match="needs 6 GPUs; 4 are visible"):
        launcher.replica_env(gpu, 0, 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # set by the user: kept
    env = launcher.replica_env(EngineConfig(device="cuda"), 2, 3)
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and "NCCL_NVLS_ENABLE" not in env


def test_dp2_times_tp2_gives_one_engines_tokens(tiny_llama):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, **ENGINE).generate(PROMPTS, greedy, use_tqdm=False)]
    with LLM(tiny_llama, data_parallel_size=2, tensor_parallel_size=2, **ENGINE) as llm:
        pids = llm.engine.replica_pids
        # Each replica is rank 0 of its own tensor-parallel pair.
        workers = [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
        assert len(workers) >= 2
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == expected
    assert not _alive(pids + workers), "a replica or its tensor-parallel worker outlived shutdown"


MAX_TOKENS = 192  # prompts of 3-8 tokens: within max_model_len 256


def test_killed_replica_fails_only_its_requests_and_the_others_finish(tiny_llama):
    import multiprocessing

    from tandem.llm import GenerationError

    llm = LLM(tiny_llama, data_parallel_size=2, **ENGINE)
    engine = llm.engine
    pids = engine.replica_pids
    step = engine.step
    killed_at: list[float] = []
    on_replica: dict[str, int] = {}

    def step_then_kill():  # kills replica 1 once the first tokens are back: generate() is mid-run
        on_replica.update({rid: r for rid, r in engine._replica_of.items()})
        outputs = step()
        if outputs and not killed_at:
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
        return outputs

    engine.step = step_then_kill
    # Long enough that replica 1 cannot finish before the kill lands, even on a loaded machine.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with pytest.raises(GenerationError, match=rf"3 of 6 requests failed .* replica 1 \(pid {pids[1]}\) died") as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert killed_at
    outputs = info.value.outputs
    assert [o.prompt_token_ids for o in outputs] == PROMPTS  # every result, in prompt order
    for out in outputs:
        c = out.outputs[0]
        if on_replica[out.request_id] == 1:
            assert c.finish_reason == "error" and "replica 1" in c.error and len(c.token_ids) < MAX_TOKENS
        else:  # replica 0's requests ran to their end
            assert c.finish_reason == "length" and c.error is None and len(c.token_ids) == MAX_TOKENS
    assert _alive([pids[0]]) and not _alive([pids[1]])
    assert engine.live_replicas == [0]
    engine.step = step
    # The engine goes on with the replica left: every new request goes there.
    again = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in again)
    # The last replica dying ends the engine: RuntimeError at once, every process reaped.
    engine.step = step_then_kill
    killed_at.clear()
    pids[1] = pids[0]
    with pytest.raises(RuntimeError, match="every data-parallel replica has died"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 5
    assert not _alive(engine.replica_pids), "a replica outlived the failure"
    assert not [p for p in multiprocessing.active_children() if p.pid in engine.replica_pids]
    with pytest.raises(RuntimeError, match="replica 0"):  # the engine stays failed, it does not hang
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    llm.shutdown()  # idempotent


def test_bench_runs_dp2_beside_its_dp1_peer(tiny_llama, capsys):
    from tandem.bench.offline import _print_table, bench_workload
    from tandem.bench.workloads import Workload

    w = Workload("tiny", tiny_llama, 8, (8, 16), (8, 16), dtype="float32", device="cpu")
    r = bench_workload(w, ["dp1", "sync"], 1.0, None, data_parallel_size=2)
    assert r["data_parallel_size"] == 2 and r["tokens_per_s"] > 0
    assert r["generated_tokens"] == r["peer_details"]["tandem DP=1"]["generated_tokens"]
    assert r["peer_details"]["tandem DP=1"]["same_tokens_as_main"]
    assert r["ratios"]["tandem DP=1"] == pytest.approx(r["tokens_per_s"] / r["peers"]["tandem DP=1"])
    assert r["dp_efficiency"] == pytest.approx(r["ratios"]["tandem DP=1"] / 2)
    routed = r["routed_tokens_per_replica"]  # prompt + max_tokens of the 8 measured requests, split by tokens
    assert len(routed) == 2 and min(routed) > 0 and abs(routed[0] - routed[1]) <= 32
    assert r["roofline_fraction"] is None and r["gpu_busy_pct"] is None
    assert r["peers_not_run"] == {"sync": "needs data_parallel_size=1"}
    _print_table([r])
    printed = capsys.readouterr().out
    assert "tandem DP=1" in printed and "DP efficiency" in printed


def test_dp2_with_adapters_gives_one_engines_tokens(tiny_llama, tmp_path):
    """Requests over two adapters and the base model spread over two replicas: each replica pages in the adapters
    its requests name and the tokens are one engine's; a bad adapter is a ValueError at add time, naming it; an
    adapter removed from every replica is read again when named."""
    pytest.importorskip("peft")
    from tandem import LoRARequest
    from tests.lora.adapters import save_adapter

    loras = [LoRARequest(f"a{i}", i + 1, save_adapter(tiny_llama, str(tmp_path / f"a{i}"), ["q_proj", "down_proj"],
                                                      r=4, seed=i)) for i in range(2)]
    order = [loras[i % 3] if i % 3 < 2 else None for i in range(len(PROMPTS))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    with LLM(tiny_llama, **lora, **ENGINE) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy, use_tqdm=False, lora_request=order)]
    with LLM(tiny_llama, data_parallel_size=2, **lora, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=order)]
        assert got == expected
        assert all(t > 0 for t in llm.engine.routed_tokens)  # both replicas served adapters
        wide = LoRARequest("wide", 9, save_adapter(tiny_llama, str(tmp_path / "wide"), ["q_proj"], r=16, seed=5))
        with pytest.raises(ValueError, match="'wide'.*rank"):
            llm.generate(PROMPTS[:1], greedy, use_tqdm=False, lora_request=wide)
        assert sorted(r.lora_name for r in llm.engine.list_loras()) == ["a0", "a1"]
        llm.engine.remove_lora(loras[0].lora_int_id)
        assert [r.lora_name for r in llm.engine.list_loras()] == ["a1"]
        llm.engine.add_lora(loras[0])  # vLLM's llm_engine.add_lora: checked here, read by a replica when named
        with pytest.raises(ValueError, match="'wide'.*rank"):
            llm.engine.add_lora(wide)
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=order)]
        assert again == expected
