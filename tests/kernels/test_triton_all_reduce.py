"""The fused all-reduce + residual add + RMSNorm kernel in the Triton interpreter, its ranks as forked processes
over shared CPU memory (the same addresses in every process, as symmetric memory gives each GPU): the barrier's
flags really cross processes. On GPUs the kernel is tested with two ranks in tests/gpu/test_tp_gpu.py."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.triton_all_reduce import all_reduce_add_rms_norm_triton

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: ranks as CPU processes")

ROWS, DIM, EPS = 3, 100, 1e-6


def _shared(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).share_memory_()


def _run_ranks(world: int, ranks: list[int], calls: list[tuple[float, bool]], spin_limit: int = 1 << 16):
    """Runs `calls` ((scale of x, with a residual)) on each rank of `ranks` in its own process; returns the last
    call's (out, new residual) per rank, the error flags and every rank's flags after."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(ROWS, DIM, generator=gen) for _ in range(world)]
    residual, weight = torch.randn(ROWS, DIM, generator=gen), torch.randn(DIM, generator=gen)
    plane = ROWS * DIM + 7  # a plane larger than the message, as on the GPU
    inboxes = [_shared(2 * world * plane) for _ in range(world)]
    flags = [_shared(ROWS * world, dtype=torch.int64) for _ in range(world)]
    epochs = [_shared(ROWS, dtype=torch.int64) for _ in range(world)]
    errs = [_shared(1, dtype=torch.int32) for _ in range(world)]
    results = [_shared(2, ROWS, DIM) for _ in range(world)]
    inbox_ptrs = torch.tensor([b.data_ptr() for b in inboxes], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)

    def rank_main(rank: int) -> None:
        for scale, with_residual in calls:
            out, new_res = all_reduce_add_rms_norm_triton(
                xs[rank] * scale, residual if with_residual else None, weight, EPS, inbox_ptrs, plane, flag_ptrs,
                epochs[rank], errs[rank], rank, world, spin_limit=spin_limit)
        results[rank][0].copy_(out)
        results[rank][1].copy_(new_res)

    ctx = mp.get_context("fork")  # the children see the parent's tensors at the same addresses
    procs = [ctx.Process(target=rank_main, args=(r,)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    assert not alive, f"ranks {alive} did not finish"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    scale, with_residual = calls[-1]
    summed = sum(xs) * scale + (residual if with_residual else 0)
    return results, errs, (flags, epochs), summed, F.rms_norm(summed, (DIM,), eps=EPS) * weight


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_norm_of_the_sum(world):
    """Three calls in a row (both parities of the inboxes, one reused), the last with and without a residual:
    every flag ends at the call count, which every rank kept per row."""
    for calls in ([(1.0, True), (2.0, True), (3.0, True)], [(1.0, True), (2.0, True), (0.5, False)]):
        results, errs, (flags, epochs), summed, ref = _run_ranks(world, list(range(world)), calls)
        for rank in range(world):
            assert errs[rank].item() == 0
            torch.testing.assert_close(results[rank][1], summed, rtol=0, atol=1e-5)
            torch.testing.assert_close(results[rank][0], ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(results[rank], results[0]), "ranks disagree"  # one sum order on every rank
            assert epochs[rank].tolist() == [len(calls)] * ROWS
            peers = [[r != rank for r in range(world)]] * ROWS  # a rank flags every peer, never itself
            assert flags[rank].view(ROWS, world).tolist() == [[len(calls) * p for p in row] for row in peers]


def test_a_missing_peer_sets_the_timeout_flag_instead_of_hanging():
    results, errs, _, _, _ = _run_ranks(2, [0], [(1.0, True)], spin_limit=200)
    assert errs[0].item() == 1
