"""The fused all-reduce + residual add + RMSNorm kernel in the Triton interpreter, its ranks as forked processes
over shared CPU memory (the same addresses in every process, as symmetric memory gives each GPU): the barrier's
flags really cross processes. On GPUs the kernel is tested with two ranks in tests/gpu/test_tp_gpu.py."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.triton_all_reduce import all_reduce_add_rms_norm_triton

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: ranks as CPU processes")

ROWS, DIM, EPS = 3, 100, 1e-6


def _shared(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).share_memory_()


def _run_ranks(world: int, ranks: list[int], calls: list[tuple[float, bool]], spin_limit: int = 1 << 16,
               splits: int = 0, reduced: bool = False):
    """Runs `calls` ((scale of x, with a residual)) on each rank of `ranks` in its own process; returns the last
    call's (out, new residual) per rank, the error flags and every rank's flags after. splits > 0: each rank's
    part comes as a split-K GEMM's partial sums (PartialSums, with a channel scale, and a bias on rank 0), or
    with `reduced` as their reduce's output."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(max(splits, 1), ROWS, DIM, generator=gen) for _ in range(world)]
    channel_scale = torch.rand(DIM, 1, generator=gen) + 0.5
    bias = torch.randn(DIM, generator=gen)

    def part(rank: int, scale: float) -> torch.Tensor | PartialSums:
        if not splits:
            return ws[rank][0] * scale
        parts = PartialSums(ws[rank] * scale, channel_scale, bias if rank == 0 else None, torch.float32)
        return parts.reduce() if reduced else parts

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
                part(rank, scale), residual if with_residual else None, weight, EPS, inbox_ptrs, plane, flag_ptrs,
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
    parts = [part(r, scale) for r in range(world)]
    summed = sum(p.reduce() if isinstance(p, PartialSums) else p for p in parts) + (residual if with_residual else 0)
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


@pytest.mark.parametrize("world", [2, 4])
def test_split_k_partial_sums_give_the_bits_of_their_reduce(world):
    """A rank's part as a split-K GEMM's partial sums (3 splits, a channel scale, a bias on rank 0): every rank
    gets exactly what it gets when the part comes reduced, as the split-K reduce kernel writes it."""
    calls = [(1.0, True), (2.0, True), (0.5, True)]
    got, errs, _, summed, ref = _run_ranks(world, list(range(world)), calls, splits=3)
    want, _, _, _, _ = _run_ranks(world, list(range(world)), calls, splits=3, reduced=True)
    for rank in range(world):
        assert errs[rank].item() == 0
        assert torch.equal(got[rank], want[rank])
        torch.testing.assert_close(got[rank][1], summed, rtol=0, atol=1e-5)
        torch.testing.assert_close(got[rank][0], ref, rtol=1e-5, atol=1e-5)


class _OneRankP2P:
    """The peer-to-peer all-reduce of a one-rank group: the fused kernel with no peers, the plain sum a copy."""

    fused = True

    def __init__(self, rows: int, dim: int) -> None:
        self.plane = rows * dim
        self.inbox = torch.zeros(2 * self.plane)
        self.flags = torch.zeros(rows, dtype=torch.int64)
        self.epochs = torch.zeros(rows, dtype=torch.int64)
        self.err = torch.zeros(1, dtype=torch.int32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def add_rms_norm(self, x, residual, weight, eps):
        return all_reduce_add_rms_norm_triton(
            x, residual, weight, eps, torch.tensor([self.inbox.data_ptr()]), self.plane,
            torch.tensor([self.flags.data_ptr()]), self.epochs, self.err, 0, 1)


def test_row_parallel_split_k_partials_reach_the_fused_norm(monkeypatch):
    """A row-parallel linear whose output goes only into the add + RMSNorm hands its split-K partial sums on
    unreduced; the norm's all-reduce kernel adds them up: the bits of reduce, all-reduce, add + RMSNorm. Where
    the fused kernel is off the linear reduces them as before."""
    from tandem.config import ParallelConfig
    from tandem.distributed.group import TPGroup, Unreduced
    from tandem.layers import parallel
    from tandem.layers.norm import RMSNorm

    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")  # the skinny split-K GEMM on these CPU tensors
    gen = torch.Generator().manual_seed(1)
    rows, dim = 6, 128
    x = torch.randn(rows, 1024, generator=gen)
    residual = torch.randn(rows, dim, generator=gen)
    tp = TPGroup(ParallelConfig(rank=0, size=2))
    lin = parallel.RowParallelLinear(2048, dim, tp, bias=True)
    lin.weight.data = torch.randn(dim, 1024, generator=gen) * 0.05
    lin.bias.data = torch.randn(dim, generator=gen)
    norm = RMSNorm(dim)
    norm.weight.data = torch.rand(dim, generator=gen) + 0.5
    tp.p2p = _OneRankP2P(rows, dim)  # type: ignore[assignment]
    deferred = lin(x, defer_reduce=True)
    assert isinstance(deferred, Unreduced) and isinstance(deferred.partial, PartialSums)
    reduced = lin(x)
    assert isinstance(reduced, torch.Tensor) and torch.equal(deferred.reduce(), reduced)
    got, want = norm(deferred, residual), norm(reduced, residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tp.p2p.fused = False
    assert torch.equal(lin(x, defer_reduce=True), reduced)
