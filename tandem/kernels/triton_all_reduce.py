"""One kernel for a tensor-parallel decoder's "all-reduce, add the residual, RMSNorm" over peer-to-peer buffers.

Every rank owns an inbox that all its peers can address (torch symmetric memory: device pointers to each rank's
inbox and flags; no NVLink multicast): [2 parities][world][plane] elements (a plane holds one message's rows),
and [rows][world] int64 flags.
Program r (one row of the message) on each rank, at call e of that row (a counter of its own, kept on the device):

  1. stores its partial row into every peer's inbox, at parity e % 2 and its own rank's place (NVLink writes);
  2. after a CTA barrier, writes e into each peer's flag for (row, its rank) with a system-scope release, so the
     row lands before the flag;
  3. waits until its own flag for (row, peer) holds e for every peer (an acquire), then sums the rows in rank
     order from its own inbox (local reads; its own row from registers): the same fp32 sum on every rank,
     rounded to the activation dtype as an all-reduce's output would be;
  4. adds the residual and normalizes: the outputs of `fused_add_rms_norm` on the reduced rows.

The partial row may also come as a split-K GEMM's fp32 partial sums (PartialSums): the program adds them up in
split order, applies the channel scale and bias and rounds to the activation dtype, exactly as the split-K
reduce kernel would have written the row, so that kernel does not run.

No second barrier guards the inbox: a rank writes parity e % 2 of a peer's inbox only after that peer's flag e - 1
reached it, which the peer sends only once its call e - 2 (the last reader of that parity) has finished. Flags
only grow (int64), so a flag that already moved past e also counts. The kernel needs no host-side state and
captures into CUDA graphs; a wait is bounded: a peer that never arrives sets `err` instead of hanging the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.triton_fused import partial_channels, sum_partials
from tandem.kernels.triton_launch import pdl_wait, use_pdl

SPIN_LIMIT = 1 << 26  # iterations of one flag wait before it gives up (seconds on a GPU)


@triton.jit
def _wait_flag(flag_ptr, epoch, err_ptr, SPIN: tl.constexpr):
    # Spin (one thread: a scalar atomic, its value broadcast to the CTA) until the flag reaches epoch.
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    n = 0
    while (seen < epoch) & (n < SPIN):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        n += 1
    if seen < epoch:
        tl.atomic_xchg(err_ptr, 1)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, inbox_ptrs, flag_ptrs, epoch_ptr, err_ptr,
    dim, plane, eps, split_stride, ps_ptr, pb_ptr,
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
    SPIN: tl.constexpr, USE_PDL: tl.constexpr,
    SPLITS: tl.constexpr, HAS_PSCALE: tl.constexpr, HAS_PBIAS: tl.constexpr,
):
    # SPLITS > 0: x_ptr holds SPLITS fp32 partial sums of the row, split_stride elements apart (PartialSums).
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    at = row.to(tl.int64) * dim + offs
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    p_scale, p_bias = partial_channels(ps_ptr, pb_ptr, offs, mask, SPLITS, HAS_PSCALE, HAS_PBIAS)  # weights too
    pdl_wait(USE_PDL)
    # This row's call count, the same on every rank; read after the wait (a previous call may still be running).
    epoch = tl.load(epoch_ptr + row) + 1
    if SPLITS > 0:  # the split-K reduce's arithmetic, in its order
        acc = sum_partials(x_ptr + at, split_stride, mask, p_scale, p_bias, SPLITS, HAS_PSCALE, HAS_PBIAS)
        x = acc.to(new_res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + at, mask=mask, other=0.0)
    dtype = x.dtype
    # Inbox layout: [parity][sender][plane] elements, rows at row * dim within a plane.
    parity = epoch % 2
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            inbox = tl.load(inbox_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(inbox + (parity * WORLD + RANK) * plane + at, x, mask=mask)
    tl.debug_barrier()  # every thread's row stores before the flags
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait_flag(mine + row * WORLD + peer, epoch, err_ptr, SPIN)
    tl.debug_barrier()  # every thread's inbox loads after the waits
    inbox = tl.load(inbox_ptrs + RANK).to(tl.pointer_type(dtype))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            acc += x.to(tl.float32)
        else:
            acc += tl.load(inbox + (parity * WORLD + peer) * plane + at, mask=mask, other=0.0).to(tl.float32)
    s = acc.to(dtype).to(tl.float32)  # the reduced row, rounded as the all-reduce's output would be
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)
        summed = (s + r).to(dtype)  # x + residual rounded before the norm, as in eager mode
        tl.store(new_res_ptr + at, summed, mask=mask)
        s = summed.to(tl.float32)
    else:
        tl.store(new_res_ptr + at, s.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / dim + eps)
    normed = (s * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + at, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epoch_ptr + row, epoch)


def all_reduce_add_rms_norm_triton(
    x: torch.Tensor | PartialSums,  # [rows, dim] this rank's part, contiguous (or a split-K GEMM's partial sums)
    residual: torch.Tensor | None,  # [rows, dim] or None
    weight: torch.Tensor,  # [dim]
    eps: float,
    inbox_ptrs: torch.Tensor,  # [world] int64: each rank's inbox, 2 * world * plane elements of x's dtype
    plane: int,  # elements of one (parity, sender) region of an inbox: at least rows * dim
    flag_ptrs: torch.Tensor,  # [world] int64: each rank's int64 flags, [len(epochs)][world], zero at the start
    epochs: torch.Tensor,  # [max rows] int64 on this rank: calls so far per row (zero at the start)
    err: torch.Tensor,  # [1] int32, set to 1 if a wait timed out
    rank: int,
    world_size: int,
    spin_limit: int = SPIN_LIMIT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual); without a residual the second is the
    reduced x. Collective: every rank of the group calls it with the same shapes, in the same order."""
    parts = x if isinstance(x, PartialSums) else None
    data = parts.ws if parts is not None else x
    rows, dim = x.shape
    dtype = parts.dtype if parts is not None else data.dtype
    assert rows <= epochs.shape[0] and rows * dim <= plane and data.is_contiguous()
    assert residual is None or (residual.is_contiguous() and residual.shape == (rows, dim))
    out = torch.empty(rows, dim, dtype=torch.promote_types(weight.dtype, dtype), device=data.device)
    new_res = torch.empty(rows, dim, dtype=dtype, device=data.device)
    if rows == 0:
        return out, new_res
    block = triton.next_power_of_2(dim)
    pdl = use_pdl(data.device)
    scale = parts.scale if parts is not None else None
    bias = parts.bias if parts is not None else None
    _all_reduce_add_rms_norm_kernel[(rows,)](
        data, residual if residual is not None else new_res, weight, out, new_res, inbox_ptrs, flag_ptrs, epochs,
        err, dim, plane, float(eps), rows * dim, scale if scale is not None else out, bias if bias is not None else out,
        RANK=rank, WORLD=world_size, HAS_RESIDUAL=residual is not None, BLOCK_D=block, SPIN=spin_limit,
        USE_PDL=pdl, SPLITS=data.shape[0] if parts is not None else 0, HAS_PSCALE=scale is not None,
        HAS_PBIAS=bias is not None, num_warps=min(max(block // 256, 1), 16), launch_pdl=bool(pdl),
    )
    return out, new_res
