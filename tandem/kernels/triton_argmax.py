"""Greedy token choice: the argmax of each row of the logits (first index on ties, the first NaN if a row has
one, as torch.argmax), spread over the GPU.

torch.argmax reduces a row in one thread block, so a [1, 128256] row takes ~35 us on an H200 whatever the batch
up to a few dozen rows; here each row is cut into chunks of ARGMAX_BLOCK values, one program a chunk, and a
second kernel picks each row's winner among its chunks' (value, index) pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.triton_launch import pdl_wait, use_pdl

ARGMAX_BLOCK = 4096  # logits per first-stage program
MAX_CHUNKS = 1024  # chunks a row may have (second stage: one program holds them all)


@triton.jit
def _first_best(val, idx, valid, vocab):
    # (best value, first index holding it) over the valid lanes, NaN counting as the largest and the first
    # NaN winning (torch.argmax's order): NaNs rank ahead of an equal +inf by an offset of vocab.
    nan = val != val
    key = tl.where(nan, float("inf"), val)
    best = tl.max(tl.where(valid, key, float("-inf")), axis=0)
    rank = tl.where(valid & (key == best), tl.where(nan, idx, idx + vocab), 2 * vocab + 1)
    first = tl.min(rank, axis=0)
    is_nan = first < vocab
    return tl.where(is_nan, float("nan"), best), tl.where(is_nan, first, first - vocab)


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, vocab, stride_x, chunks,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Program = one chunk of one row: its best value and first index (_first_best), written to [row, chunk].
    pdl_wait(USE_PDL)
    row = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    best, idx = _first_best(x, offs, mask, vocab)
    tl.store(val_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, idx)


@triton.jit
def _row_argmax_kernel(val_ptr, idx_ptr, out_ptr, chunks, vocab, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    # Program = one row: the chunk winners compared as the first stage compares values (their indices
    # carry the order, so the first chunk at the best value holds the row's first best index).
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < chunks
    val = tl.load(val_ptr + row * chunks + offs, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * chunks + offs, mask=mask, other=0)
    tl.store(out_ptr + row, _first_best(val, idx, mask, vocab)[1].to(tl.int64))


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] (unit inner stride) -> [B] int64, equal to logits.argmax(dim=-1) (CUDA graph safe: no sync)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows_triton takes [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    chunks = triton.cdiv(vocab, ARGMAX_BLOCK)
    if chunks > MAX_CHUNKS:
        return logits.argmax(dim=-1)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    pdl = use_pdl(logits.device)
    _chunk_argmax_kernel[(chunks, rows)](logits, val, idx, vocab, logits.stride(0), chunks, BLOCK=ARGMAX_BLOCK,
                                         USE_PDL=pdl, num_warps=8, launch_pdl=bool(pdl))
    _row_argmax_kernel[(rows,)](val, idx, out, chunks, vocab, BLOCK_C=max(triton.next_power_of_2(chunks), 2),
                                USE_PDL=pdl, num_warps=1, launch_pdl=bool(pdl))
    return out
