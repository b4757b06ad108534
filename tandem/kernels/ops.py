"""Kernel entry points the layers call; each dispatches on the tensors' device to an implementation."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import (
    FP8_DTYPE,
    W8A8_MAX_M,
    PartialSums,
    QuantizedRows,
    fp8_quantizes_activations,
    group_block_k,
)
from tandem.kernels.int_weight import IntWeight, dequantize_repacked, repack_int_weight
from tandem.kernels.moe_align import fused_moe_ref, route_topk
from tandem.kernels.reference import dequantize_int_weight, paged_attention_ref, write_kv_ref

if TYPE_CHECKING:
    from tandem.kernels.triton_attention import NewTokens

# Linears of at most this many rows run kernels/triton_gemv.py on CUDA: at one decode row cuBLAS picks
# split-K GEMMs that stream the weight at ~0.67-0.90 of copy bandwidth plus a reduce kernel; the GEMV reads
# each weight element once, from one program (0.85-1.0 on an H100), and fuses silu(gate) * up into the
# gate/up projection. FP8 weights take it at one row only: from two rows on, the FP8 tile GEMMs win.
GEMV_MAX_ROWS = 4
GEMV_MAX_ROWS_FP8 = 1
GEMV_ROWS_LIMIT = 64  # TANDEM_GEMV_MAX_ROWS above this is ignored
# Above the GEMV's rows and up to this many, 16-bit linears run the swap-AB tile GEMM (triton_quant.
# skinny_matmul_triton): on an H200 over the Llama-3-8B projections at 8-32 rows it streamed the weight
# 1.01-1.23x faster than cuBLAS (o_proj most: cuBLAS leaves its 32 N tiles short of the SMs), 0.8-0.96x at 64
# rows (scripts/bench_skinny.py; benchmarks/results/ at bd15627). TANDEM_SKINNY_MAX_ROWS=N overrides (0: off).
SKINNY_MAX_ROWS = 32


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    if use_triton(k):
        from tandem.kernels.triton_kv import write_kv_triton  # lazy: CPU-only runs never import Triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; written in place when given
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if use_triton(q):
        from tandem.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, out)
    result = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def fuses_decode_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, q_norm: torch.nn.Module | None, k_norm: torch.nn.Module | None
) -> bool:
    """Whether a decode step's rotary and KV write run inside the decode attention kernel: Triton kernels on for
    q, rotary over every dim, q/k norms both or neither with one eps, sequences x kv heads programs that all
    fit on the GPU at once (DECODE_PROGRAMS_PER_SM of the larger tiles per SM), and TANDEM_DECODE_ROTARY != 0
    (read per call: a CUDA graph keeps what its capture chose; 1 fuses at any batch). On an H200 it saved the
    rotary kernel's ~2 us a layer at batch 1 (split contexts), and since each program loads its first KV tile
    before the PDL wait, seed-async's batch 32 x 8 kv heads (256 programs on 132 SMs) ran 2.4% faster in bf16
    (2026-11-25; benchmarks/results/ at bd15627); past one wave it was not measured, so it stays off."""
    if not use_triton(q) or os.environ.get("TANDEM_DECODE_ROTARY") == "0":
        return False
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and q_norm.eps != k_norm.eps):  # type: ignore[union-attr]
        return False
    from tandem.kernels.triton_attention import DECODE_PROGRAMS_PER_SM, device_sms

    one_wave = k.shape[0] * k.shape[1] <= DECODE_PROGRAMS_PER_SM[0] * device_sms(q.device)
    return (2 * cos.shape[-1] == q.shape[-1] and k.stride(-1) == 1
            and (one_wave or os.environ.get("TANDEM_DECODE_ROTARY") == "1"))


def decode_attention_rotary(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], raw: before norm / rotary
    k: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], raw
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    fp8_out: bool = False,
) -> torch.Tensor | QuantizedRows:  # [num_seqs, num_heads, head_dim], or [num_seqs, num_heads * head_dim] rows
    """Decode step (one token per sequence) on Triton: (q/k norm,) rotary, the cache write of k and v, and
    attention in one kernel; see fuses_decode_rotary. fp8_out: see decode_attention."""
    from tandem.kernels.triton_attention import NewTokens

    new = NewTokens(k, v, cos, sin, meta.slot_mapping, q_norm_weight, k_norm_weight, eps)
    return decode_attention(q, k_cache, v_cache, meta, scale, new, fp8_out)


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_tokens: NewTokens | None = None,
    fp8_out: bool = False,
) -> torch.Tensor | QuantizedRows:  # [num_seqs, num_heads, head_dim], or [num_seqs, num_heads * head_dim] rows
    """A decode step's attention on Triton (with new_tokens also their rotary and cache write). fp8_out (see
    decode_fp8_groups): the output comes quantized for an FP8 o_proj, one group per (sequence, kv head)."""
    from tandem.kernels.triton_attention import paged_decode_attention

    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    kw = dict(max_seq_len=meta.max_seq_len, order=meta.decode_order, new_tokens=new_tokens)
    if not fp8_out:
        return paged_decode_attention(*args, **kw)
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=FP8_DTYPE, device=q.device)
    out_scale = torch.empty(num_seqs, k_cache.shape[2], dtype=torch.float32, device=q.device)
    paged_decode_attention(*args, out=out, out_scale=out_scale, **kw)
    return QuantizedRows(out.view(num_seqs, num_heads * head_dim), out_scale, q.dtype)


def decode_fp8_groups(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether a decode step's attention writes its output quantized for an FP8 o_proj (QuantizedRows in one
    group per kv head: its query heads' values over their own |max|), so that no quantization kernel runs
    between them: where o_proj would quantize rows for its W8A8 GEMM (2 to W8A8_MAX_M rows, Triton), and a
    group fills whole FP8 K tiles. TANDEM_DECODE_FP8_OUT=0 turns it off (read per call)."""
    rows, num_heads, head_dim = q.shape
    if os.environ.get("TANDEM_DECODE_FP8_OUT") == "0":
        return False
    return (fp8_quantizes_activations(rows) and rows <= W8A8_MAX_M and use_triton(q)
            and group_block_k(num_heads // num_kv_heads * head_dim, 256) > 0)


def use_gemv(x: torch.Tensor, in_features: int, fp8: bool = False) -> bool:
    """Whether a linear on x ([..., in_features]) runs the weight-streaming GEMV: Triton kernels are on for
    x and it holds at most GEMV_MAX_ROWS rows (GEMV_MAX_ROWS_FP8 for FP8 weights); TANDEM_GEMV_MAX_ROWS=N
    sets both (0 turns the kernel off; at most GEMV_ROWS_LIMIT). Read per call, so eager runs follow the variable; a CUDA graph keeps
    whatever its capture chose."""
    numel = x.numel()
    if numel > GEMV_ROWS_LIMIT * in_features:  # prefill-sized (the common eager case): no env lookups
        return False
    override = os.environ.get("TANDEM_GEMV_MAX_ROWS")
    max_rows = int(override) if override is not None else GEMV_MAX_ROWS_FP8 if fp8 else GEMV_MAX_ROWS
    return 0 < numel <= max_rows * in_features and use_triton(x)


def use_skinny(x: torch.Tensor, in_features: int) -> bool:
    """Whether a linear on x ([..., in_features]) runs the small-M tile GEMM: Triton kernels are on for x and
    it holds more rows than the GEMV takes and at most SKINNY_MAX_ROWS (TANDEM_SKINNY_MAX_ROWS). Not for fp32
    on a GPU, where tensor-core dots round to TF32 and cuBLAS does not. Read per call, like use_gemv."""
    numel = x.numel()
    if numel > GEMV_ROWS_LIMIT * in_features:  # prefill-sized: no env lookups
        return False
    override = os.environ.get("TANDEM_SKINNY_MAX_ROWS")
    max_rows = int(override) if override is not None else SKINNY_MAX_ROWS
    if not numel <= max_rows * in_features or (x.is_cuda and x.dtype == torch.float32):
        return False
    return use_triton(x)


def dense_rows(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """x [n, in] @ weight [out, in]^T, no bias, through the kernels a model's linears run at n rows: the
    weight-streaming GEMV up to its rows, the skinny tile GEMM past them, cuBLAS beyond (and on the CPU); gated:
    silu(gate) * up of a merged gate / up weight (gate rows first), [n, out / 2]. For weights held outside a
    Linear (an EAGLE-3 head's), which would otherwise read their few rows' weights through cuBLAS at a fraction of
    the copy bandwidth."""
    in_features = weight.shape[1]
    if use_gemv(x, in_features):
        from tandem.kernels.triton_gemv import gemv_triton  # lazy: CPU runs never import Triton

        return gemv_triton(x, weight, gated=gated)
    if use_skinny(x, in_features):
        from tandem.kernels.triton_quant import skinny_matmul_triton  # lazy: CPU runs never import Triton

        out = skinny_matmul_triton(x, weight, None, gated=gated)
        assert isinstance(out, torch.Tensor)
        return out
    out = F.linear(x, weight)
    return silu_and_mul(out) if gated else out


def reduce_partial_sums(parts: PartialSums) -> torch.Tensor:
    """A split-K GEMM's output from its PartialSums: the reduce kernel where Triton runs, else PyTorch (the same
    sum in split order)."""
    if use_triton(parts.ws):
        from tandem.kernels.triton_quant import reduce_partial_sums_triton  # lazy: no Triton on CPU

        return reduce_partial_sums_triton(parts)
    return parts.reduce()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] holding gate then up; returns silu(gate) * up, [..., d]."""
    if use_triton(x):
        from tandem.kernels.triton_fused import silu_and_mul_triton  # lazy: no Triton on CPU

        return silu_and_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def use_triton(x: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors, unless TANDEM_REFERENCE_KERNELS=1 asks for the PyTorch references
    (to tell a kernel's error from anything else's; run it with CUDA graphs off)."""
    if x.is_cuda:
        return os.environ.get("TANDEM_REFERENCE_KERNELS") != "1"
    return force_triton()


def force_triton() -> bool:
    """TANDEM_FORCE_TRITON=1 sends CPU tensors to the Triton kernels (tests under TRITON_INTERPRET=1)."""
    return os.environ.get("TANDEM_FORCE_TRITON") == "1"


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax then top-k of [num_tokens, num_experts] router logits: (weights fp32, expert ids int32), each
    [num_tokens, top_k]; one Triton launch on CUDA, PyTorch elsewhere."""
    if use_triton(router_logits):
        from tandem.kernels.triton_moe import route_topk_triton  # lazy: CPU runs never import Triton

        return route_topk_triton(router_logits, top_k, renormalize)
    return route_topk(router_logits, top_k, renormalize)


COUNT_KERNEL_MAX_PAIRS = 4096  # beyond: prefill-sized steps, where one program looping over every pair is slower


def count_routed_experts(topk_ids: torch.Tensor, num_experts: int, counter: torch.Tensor) -> None:
    """counter (an int64 scalar on topk_ids' device) += the distinct experts topk_ids route to: one Triton launch on
    CUDA for decode-sized steps (a benchmark's statistics should cost the step it measures little), else three
    device ops."""
    if use_triton(topk_ids) and topk_ids.numel() <= COUNT_KERNEL_MAX_PAIRS:
        from tandem.kernels.triton_moe import count_routed_experts_triton  # lazy: CPU runs never import Triton

        count_routed_experts_triton(topk_ids, num_experts, counter)
        return
    hit = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    counter += hit.index_fill_(0, topk_ids.reshape(-1).long(), 1).sum()


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor | IntWeight,  # [num_local_experts, 2 * inter, hidden] (an IntWeight stack: 4- / 8-bit)
    w2: torch.Tensor | IntWeight,  # [num_local_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32, global expert ids
    expert_map: torch.Tensor | None = None,  # [num_global_experts] int32: local index or -1 (expert parallel)
    w13_scale: torch.Tensor | None = None,  # FP8 weights: [num_local_experts, 2 * inter] fp32
    w2_scale: torch.Tensor | None = None,  # [num_local_experts, hidden] fp32
    into_norm: bool = False,  # the output goes only into a residual add + RMSNorm: PartialSums are fine
    # integer experts in act order: the input column each stored column reads, ([E, hidden], [E, local inter]) int64
    perms: tuple[torch.Tensor, torch.Tensor] | None = None,
    # act order over ranks that split the intermediate size: [rows, local inter] -> [rows, inter], the ranks'
    # activations side by side (a collective: every rank calls it as often), which w2's permutation indexes
    gather_inter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | PartialSums:  # [num_tokens, hidden]: this rank's sum over k of weight_k * expert_k(x)
    """Routed experts: the token sort/align and two grouped GEMMs (Triton) on CUDA, a masked per-expert loop on CPU.
    With into_norm the Triton pair path may leave the sum over k to the norm (TANDEM_MOE_PAIR's "norm").
    Integer experts (IntWeight stacks, both or neither): the kernels of triton_moe_int where Triton runs (not
    for fp32 x on a GPU, whose tensor-core dots would round to TF32), else every expert dequantized
    (dequantize_repacked, act order's columns put back in input order) and the per-expert loop."""
    integer = isinstance(w13, IntWeight)
    if integer != isinstance(w2, IntWeight):
        raise ValueError("w13 and w2 must both be integer (IntWeight) or both tensors")
    if perms is not None and not integer:
        raise ValueError("act-order permutations come with integer experts only")
    if integer and use_triton(x) and not (x.is_cuda and x.dtype == torch.float32):
        from tandem.kernels.triton_moe_int import fused_moe_int_triton  # lazy: CPU runs never import Triton

        return fused_moe_int_triton(x, w13, w2, topk_weights, topk_ids, expert_map, into_norm=into_norm,
                                    perms=perms, gather_inter=gather_inter)
    if integer:
        w13, w2 = dequantize_repacked(w13).to(x.dtype), dequantize_repacked(w2).to(x.dtype)
        if perms is not None:  # stored column j of expert e reads input column perm[e, j]
            w13 = _unsort_columns(w13, perms[0])
            if gather_inter is None:
                w2 = _unsort_columns(w2, perms[1])
            else:  # this rank's down columns name columns of the whole intermediate size: read the gathered act
                p2 = perms[1].long()
                return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, expert_map,
                                     act_columns=lambda e, act: gather_inter(act)[:, p2[e]])
    elif use_triton(x):
        from tandem.kernels.triton_moe import fused_moe_triton  # lazy: CPU runs never import Triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale,
                                into_norm=into_norm)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale)


def _unsort_columns(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """A stack [E, N, K] whose stored column j of expert e reads input column perm[e, j], in input-column order."""
    return w.new_empty(w.shape).scatter_(2, perm[:, None, :].expand(w.shape).long(), w)


def gather_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:  # [..., K]: x[..., perm]
    """x's last dimension read through perm (act order's input columns): a Triton kernel in the PDL chain where
    Triton runs (gather_columns_triton), index_select elsewhere."""
    if use_triton(x) and x.stride(-1) == 1:
        from tandem.kernels.triton_int_weight import gather_columns_triton  # lazy: CPU runs never import Triton

        return gather_columns_triton(x.reshape(-1, x.shape[-1]), perm).view(*x.shape[:-1], perm.shape[0])
    return x.index_select(-1, perm)


def int_weight_linear(
    x: torch.Tensor,  # [..., K] in the activation dtype
    qweight: torch.Tensor | None,  # uint8 [N, K // 2] (4 bits) or [N, K] (8 bits), the tandem int-N layout
    scales: torch.Tensor | None,  # [N, K // group_size] in x's dtype
    zeros: torch.Tensor | None,  # [N, K // group_size] in x's dtype; all three None: `packed` alone holds W
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    packed: IntWeight | None = None,  # the same weight as repack_int_weight made it (once, at load)
    defer_reduce: bool = False,  # 2-D x only: a split-K GEMM may return PartialSums (Linear.forward's contract)
    gated: bool = False,  # W holds gate rows then up rows: silu(gate) * up, [..., N / 2]
) -> torch.Tensor | PartialSums:  # [..., N] in x's dtype
    """x W^T + b for a 4- or 8-bit weight (W = (q - zero) * scale per group): where Triton runs, the kernels of
    kernels/triton_int_weight.py (the GEMV up to a few rows, the tile GEMM above) on `packed` (repacked here,
    a pass over the weight, when not given); elsewhere, and for fp32 x on a GPU (whose tensor-core dots would
    round to TF32), the reference dequantization and a matmul. defer_reduce: as Linear.forward's (PartialSums
    where the kernel splits K, for the add + RMSNorm after it). gated: silu(gate) * up of the product (one
    kernel for one bf16 row on the GPU, see int_weight_matmul_triton), never deferred."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x2) and not (x2.is_cuda and x2.dtype == torch.float32):
        from tandem.kernels.triton_int_weight import int_weight_matmul_triton  # lazy: CPU runs never import Triton

        weight = packed if packed is not None else repack_int_weight(qweight, scales, zeros, bits, group_size)
        out = int_weight_matmul_triton(x2, weight, bias, defer=defer_reduce and x.dim() == 2 and not gated,
                                       gated=gated)
        if isinstance(out, PartialSums):
            return out
    else:
        if qweight is None:
            if packed is None:
                raise ValueError("int_weight_linear needs qweight, scales and zeros, or the repacked weight")
            dense = dequantize_repacked(packed).to(x.dtype)
        else:
            dense = dequantize_int_weight(qweight, scales, zeros, bits, group_size).to(x.dtype)
        out = torch.nn.functional.linear(x2, dense, bias)
        if gated:
            gate, up = out.chunk(2, dim=-1)
            out = torch.nn.functional.silu(gate) * up
    return out.view(*lead, out.shape[-1])
