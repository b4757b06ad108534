"""An out-of-memory error in one step fails that step's requests only: the engine frees their blocks and goes on."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.sampling_params import SamplingParams
from tests.parallel.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def test_out_of_memory_in_a_step_fails_its_requests_and_the_engine_goes_on(tiny_llama):
    core = EngineCore(EngineConfig(model=tiny_llama, device="cpu", dtype="float32", max_model_len=128,
                                   max_num_seqs=2, num_kv_blocks=32))
    free = core.scheduler.num_free_blocks()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rid in ("a", "b", "c", "d"):  # two fit a step (max_num_seqs=2): c and d wait
        core.add_request(rid, [5, 6, 7, 8, 9], params)
    original, launches = core.runner.enqueue, []

    def enqueue(prepared, drafts=None):  # the second step's activations do not fit
        launches.append(sorted(s.request.request_id for s in prepared.sched.scheduled))
        if len(launches) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(prepared, drafts)

    core.runner.enqueue = enqueue
    tokens: dict[str, int] = {}
    errors: dict[str, str] = {}
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = out.error
    assert not core.has_unfinished_requests()
    assert launches[1] == ["a", "b"]
    assert set(errors) == {"a", "b"} and all("OutOfMemoryError" in e for e in errors.values())
    assert tokens["c"] == tokens["d"] == 8  # the requests outside the failed step ran to their end
    assert core.scheduler.num_free_blocks() == free, "KV blocks leaked"
    core.add_request("e", [5, 6, 7], params)  # and the engine takes new work
    while core.has_unfinished_requests():
        core.step()
