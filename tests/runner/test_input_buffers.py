"""write_step (the slot writer of every step) against a plain per-request reference, over scheduler simulations.

write_step batches its numpy stores and keeps block-table rows between a slot's steps, so the danger is a row
left stale after a request moves, finishes, is preempted or takes a prefix hit. Each simulated step is written
into two alternating slots (as the runner does) and compared, field by field, with a fresh reference write.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from tandem.runner.input_buffers import StepBuffers, write_step
from tandem.scheduler import SchedulerConfig, SchedulerOutput
from tests.scheduler.sim import FakeGPU, random_workload, run_workload

BLOCKS_PER_SEQ = 64
MAX_SEQS = 8
MAX_TOKENS = 64


def reference_write(buf: StepBuffers, out: SchedulerOutput, prev_rows: dict[str, int], bs: int,
                    pad_to: int | None, pad_tokens_to: int | None = None) -> None:
    """The obvious writer: every field of every row, one request at a time."""
    ints, longs, floats = buf.ints.np, buf.longs.np, buf.floats.np
    t = 0
    ints["query_start_loc"][0] = 0
    for i, s in enumerate(out.scheduled):
        start, n = s.num_computed_tokens, s.num_scheduled_tokens
        for j in range(n):
            p = start + j
            ints["input_ids"][t + j] = s.token_ids[j]
            ints["positions"][t + j] = p
            longs["slot_mapping"][t + j] = s.block_ids[p // bs] * bs + p % bs
            longs["carry_src"][t + j] = -1
        if s.carry:
            longs["carry_src"][t + n - 1] = prev_rows[s.request.request_id]
        t += n
        ints["query_start_loc"][i + 1] = t
        ints["seq_lens"][i] = start + n
        ints["logits_indices"][i] = t - 1
        used = -(-(start + n) // bs)
        ints["block_tables"][i, :used] = s.block_ids[:used]
        sp = s.request.sampling_params
        floats["temperature"][i], floats["top_p"][i], ints["top_k"][i] = sp.temperature, sp.top_p, sp.top_k
        longs["seeds"][i], longs["sample_pos"][i] = s.request.sampling_seed, start + n
    num_seqs = len(out.scheduled)
    for j in range(t, pad_tokens_to or 0):  # a piecewise graph's padding tokens
        ints["input_ids"][j], ints["positions"][j] = 0, 0
        longs["slot_mapping"][j], longs["carry_src"][j] = -1, -1
    if pad_to is not None:
        for i in range(num_seqs, pad_to):
            ints["input_ids"][t + i - num_seqs] = 0
            ints["positions"][t + i - num_seqs] = 0
            longs["slot_mapping"][t + i - num_seqs] = -1
            longs["carry_src"][t + i - num_seqs] = -1
            ints["query_start_loc"][i + 1] = t + i - num_seqs + 1
            ints["seq_lens"][i] = 0
            floats["temperature"][i], floats["top_p"][i], ints["top_k"][i] = 0.0, 1.0, 0
            longs["seeds"][i], longs["sample_pos"][i] = 0, 0


def assert_same_step(got: StepBuffers, want: StepBuffers, out: SchedulerOutput, pad_to: int | None, bs: int,
                     pad_tokens_to: int | None = None) -> None:
    num_seqs = len(out.scheduled)
    rows = max(num_seqs, pad_to or 0)
    num_tokens = max(out.num_scheduled_tokens + rows - num_seqs, pad_tokens_to or 0)
    for name in ("input_ids", "positions"):
        np.testing.assert_array_equal(got.ints.np[name][:num_tokens], want.ints.np[name][:num_tokens], name)
    for name in ("slot_mapping", "carry_src"):
        np.testing.assert_array_equal(got.longs.np[name][:num_tokens], want.longs.np[name][:num_tokens], name)
    np.testing.assert_array_equal(got.ints.np["query_start_loc"][: rows + 1], want.ints.np["query_start_loc"][: rows + 1])
    for name in ("seq_lens", "top_k"):
        np.testing.assert_array_equal(got.ints.np[name][:rows], want.ints.np[name][:rows], name)
    np.testing.assert_array_equal(got.ints.np["logits_indices"][:num_seqs], want.ints.np["logits_indices"][:num_seqs])
    for name in ("seeds", "sample_pos"):
        np.testing.assert_array_equal(got.longs.np[name][:rows], want.longs.np[name][:rows], name)
    for name in ("temperature", "top_p"):
        np.testing.assert_array_equal(got.floats.np[name][:rows], want.floats.np[name][:rows], name)
    for i, s in enumerate(out.scheduled):  # the block-table entries the kernels read
        used = -(-(s.num_computed_tokens + s.num_scheduled_tokens) // bs)
        np.testing.assert_array_equal(got.ints.np["block_tables"][i, :used], s.block_ids[:used], f"table row {i}")


class CheckingGPU(FakeGPU):
    """FakeGPU that also writes every step into the runner's two slots and checks them against the reference."""

    def __init__(self, num_blocks: int, block_size: int, truth: dict[str, list[int]] | None = None) -> None:
        super().__init__(num_blocks, block_size, truth)
        cpu = torch.device("cpu")
        self.slots = [StepBuffers(MAX_TOKENS, MAX_SEQS, BLOCKS_PER_SEQ, 1, cpu) for _ in range(2)]
        self.want = StepBuffers(MAX_TOKENS, MAX_SEQS, BLOCKS_PER_SEQ, 1, cpu)
        self.prev_rows: dict[str, int] = {}
        self.num_written = 0
        self.mixed_with_decodes = 0  # mixed steps with leading one-token rows seen
        self.pad_rng = random.Random(0)

    def execute(self, out: SchedulerOutput) -> list[int]:
        if out.scheduled:
            num_seqs = len(out.scheduled)
            decode_only = out.num_scheduled_tokens == num_seqs
            pad_to = self.pad_rng.randrange(num_seqs, MAX_SEQS + 1) if decode_only else None
            # Mixed steps: half of them padded to a piecewise token bucket.
            pad_tokens = None
            if not decode_only and self.pad_rng.random() < 0.5:
                pad_tokens = self.pad_rng.randrange(out.num_scheduled_tokens, MAX_TOKENS + 1)
            rows: dict[str, int] = {}
            got = self.slots[self.num_written % 2]
            shape = write_step(got, out, self.prev_rows, self.block_size, pad_to, rows, pad_tokens)
            reference_write(self.want, out, self.prev_rows, self.block_size, pad_to, pad_tokens)
            assert_same_step(got, self.want, out, pad_to, self.block_size, pad_tokens)
            ends = [s.num_computed_tokens + s.num_scheduled_tokens for s in out.scheduled]
            assert shape.max_seq_len == max(ends) and shape.num_context_tokens == sum(ends)
            assert shape.max_query_len == max(s.num_scheduled_tokens for s in out.scheduled)
            lens = [s.num_scheduled_tokens for s in out.scheduled]
            assert shape.num_decodes == next((i for i, n in enumerate(lens) if n != 1), num_seqs)
            self.mixed_with_decodes += 0 < shape.num_decodes < num_seqs
            # The decode kernel's program order: its rows (padding included), longest context first.
            rows_run = max(num_seqs, pad_to or 0) if decode_only else shape.num_decodes
            order = got.ints.np["decode_order"][:rows_run].tolist()
            lens = got.ints.np["seq_lens"][:rows_run].tolist()
            assert sorted(order) == list(range(rows_run))
            assert [lens[i] for i in order] == sorted(lens, reverse=True)
            assert rows == {s.request.request_id: i for i, s in enumerate(out.scheduled)}
            params = [s.request.sampling_params for s in out.scheduled]  # write_step caches these per slot
            assert shape.all_greedy == all(sp.temperature == 0.0 for sp in params)
            assert shape.any_top_k_top_p == any(sp.temperature != 0.0 and (sp.top_k > 0 or sp.top_p < 1.0)
                                                for sp in params)
            assert shape.num_logprobs == max((sp.logprobs for sp in params if sp.logprobs is not None), default=-1)
            self.prev_rows = rows
            self.num_written += 1
        return super().execute(out)


CONFIGS = {
    "default": dict(),
    "tight-pool": dict(num_blocks=20, max_model_len=72),  # preemptions: rows get new block lists
    "block-1": dict(block_size=1, max_model_len=64),
    "no-prefix-cache": dict(enable_prefix_caching=False, block_size=3),
    "small-budget": dict(max_num_batched_tokens=7, max_num_seqs=4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("overlap", [False, True])
def test_write_step_matches_reference_writer(name: str, overlap: bool, monkeypatch) -> None:
    values = dict(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS, max_model_len=128, block_size=4,
                  num_blocks=400)
    values.update(CONFIGS[name])
    cfg = SchedulerConfig(**values)
    assert cfg.max_model_len <= BLOCKS_PER_SEQ * cfg.block_size
    gpus: list[CheckingGPU] = []

    def make_gpu(*args, **kwargs) -> CheckingGPU:
        gpus.append(CheckingGPU(*args, **kwargs))
        return gpus[-1]

    monkeypatch.setattr("tests.scheduler.sim.FakeGPU", make_gpu)
    rng = random.Random(7)
    requests = random_workload(rng, 24)
    for i, request in enumerate(requests):  # every row its own sampling parameters and seed
        request.sampling_params = dataclasses.replace(
            request.sampling_params, temperature=rng.choice([0.0, 0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 0, 5]), logprobs=rng.choice([None, None, 0, 3]))
        request.sampling_seed = 1000 + i
    arrivals: dict[int, list[int]] = {}
    for i in range(len(requests)):
        arrivals.setdefault(rng.randrange(20), []).append(i)
    run_workload(cfg, requests, overlap=overlap, arrivals=arrivals)
    assert gpus and gpus[0].num_written > 10
    assert gpus[0].mixed_with_decodes > 0  # prefills admitted behind running decodes
