"""Plain-PyTorch KV-cache write, paged attention and 4- / 8-bit weight dequantization: the CPU path and the oracle
for the GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import FP8_DTYPE, FP8_MAX


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping[: k.shape[0]].long()
    keep = (slots >= 0).nonzero().squeeze(1)  # [num_written]
    if keep.shape[0] != slots.shape[0]:
        k, v, slots = k[keep], v[keep], slots[keep]
    k_flat[slots] = to_cache_dtype(k, k_cache.dtype)
    v_flat[slots] = to_cache_dtype(v, v_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: an FP8 cache (scale 1) saturates at +-448 first, as the Triton kernels do."""
    if dtype == FP8_DTYPE:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def compute_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """What attention multiplies in: the cache's dtype, except that an FP8 cache is read back in q's."""
    return q.dtype if cache.dtype == FP8_DTYPE else cache.dtype


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if meta.num_seqs == 0 or q.shape[0] == 0:
        return torch.zeros_like(q)
    if meta.max_query_len <= 1:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    return _varlen_attention(q, k_cache, v_cache, meta, scale)


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Copies each sequence's first blocks into [num_seqs, num_kv_heads, padded_len, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = min(-(-max_seq_len // block_size), block_tables.shape[1])
    num_blocks = max(num_blocks, 1)
    num_seqs = block_tables.shape[0]
    num_kv_heads, head_dim = cache.shape[2:]
    # index_select copies whole blocks (memcpy-like), several times faster than advanced indexing on CPU.
    blocks = cache.index_select(0, block_tables[:, :num_blocks].reshape(-1))  # [num_seqs * num_blocks, bs, h, d]
    return blocks.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Every sequence has at most one query token: one masked SDPA over the padded contexts, no host sync."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = meta.num_seqs
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]  # [num_seqs]
    seq_lens = meta.seq_lens.long()
    valid = (query_lens == 1) & (seq_lens > 0)  # [num_seqs]
    token_idx = starts[:-1].clamp(max=num_tokens - 1)  # [num_seqs]

    dt = compute_dtype(q, k_cache)
    keys = _gather_context(k_cache, meta.block_tables, meta.max_seq_len).to(dt)  # [num_seqs, kv_heads, ctx, dim]
    values = _gather_context(v_cache, meta.block_tables, meta.max_seq_len).to(dt)
    ctx_len = keys.shape[2]
    # A padding row attends to position 0 only, so no row is fully masked (which would give NaN).
    visible = torch.arange(ctx_len, device=q.device)[None, :] < seq_lens.clamp(min=1)[:, None]  # [num_seqs, ctx]
    # Masked slots (block-table padding reads block 0, a last block's unused tail) are read but weighted 0:
    # they must hold finite values, which a zero-initialized cache guarantees (NaN * 0 would still be NaN).
    identity = num_tokens == num_seqs and _is_identity(starts, num_seqs)
    # The query heads sharing one KV head play the role of the query length: no KV head expansion.
    queries = (q if identity else q[token_idx]).reshape(num_seqs, num_kv_heads, group, head_dim).to(keys.dtype)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=visible[:, None, None, :], scale=scale
    )  # [num_seqs, kv_heads, group, dim]
    # where (not a multiply by 0) so junk in a padding row's block 0 can never leak NaN.
    out = torch.where(valid[:, None, None], out.reshape(num_seqs, num_heads, head_dim).to(q.dtype), 0.0)
    if identity:
        return out
    result = torch.zeros_like(q)
    # index_add (not index_copy) because an empty sequence shares its start index with the next one.
    result.index_add_(0, token_idx, out)
    return result


def _is_identity(starts: torch.Tensor, num_seqs: int) -> bool:
    """True when sequence i's single query is token i (checked on the host only for CPU tensors)."""
    if starts.device.type != "cpu":
        return False
    return bool(torch.equal(starts, torch.arange(num_seqs + 1, dtype=starts.dtype)))


def _varlen_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Mixed prefill/decode: one SDPA per sequence with a causal mask offset by its cached prefix."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    block_tables = meta.block_tables
    dt = compute_dtype(q, k_cache)
    result = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], min(starts[i + 1], num_tokens)
        query_len = end - start
        if query_len <= 0 or seq_len <= 0:
            continue
        blocks = block_tables[i, : -(-seq_len // block_size)]
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).to(dt)
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).to(dt)
        queries = q[start:end].transpose(0, 1).to(keys.dtype)  # [num_heads, query_len, dim]
        mask = None
        if query_len != seq_len:
            # Query j sits at absolute position seq_len - query_len + j and sees keys up to there.
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [query_len, ctx]
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None and query_len > 1,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [num_heads, query_len, dim]
        result[start:end] = out.transpose(0, 1).to(q.dtype)
    return result


INT_WEIGHT_BITS = (4, 8)


def check_int_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                     group_size: int, strict: bool = True) -> tuple[int, int]:
    """(N, K) of a weight in the tandem int-N layout, or a ValueError that says what does not fit it: qweight
    uint8 [N, K // 2] (4 bits: element k in byte k // 2, even k in the low nibble) or [N, K] (8 bits); scales
    and zeros [N, K // group_size] in one floating dtype; group_size divides K (-1: one group a row). Not
    strict (the reference dequantization of a checkpoint's tensors): more group columns than used, and two
    floating dtypes, pass."""
    if bits not in INT_WEIGHT_BITS:
        raise ValueError(f"int weights have 4 or 8 bits, got {bits}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D uint8 tensor, got {qweight.dtype} of shape {tuple(qweight.shape)}")
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 // bits)
    group_size = k if group_size == -1 else group_size
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {k} input features")
    groups = (n, k // group_size)
    fits = (lambda t: tuple(t.shape) == groups) if strict else \
        (lambda t: t.dim() == 2 and t.shape[0] == n and t.shape[1] >= groups[1])
    if not fits(scales) or not fits(zeros):
        raise ValueError(f"scales and zeros must be {list(groups)} for qweight {tuple(qweight.shape)} at {bits} bits "
                         f"and group_size {group_size}, got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    if not scales.is_floating_point() or not zeros.is_floating_point() or (strict and zeros.dtype != scales.dtype):
        raise ValueError(f"scales and zeros must share one floating dtype, got {scales.dtype} and {zeros.dtype}")
    return n, k


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in // 2] -> uint8 codes [out, in]: element k of a row sits in byte k // 2, even k in the low
    nibble, odd k in the high one (the tandem int-N layout)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def dequantize_int_weight(
    qweight: torch.Tensor,  # uint8 [N, K // 2] (4 bits) or [N, K] (8 bits): unsigned codes q
    scales: torch.Tensor,  # [N, K // group_size] in the activation dtype
    zeros: torch.Tensor,  # [N, K // group_size] in the activation dtype: the zero point as a real number
    bits: int,
    group_size: int,  # columns per group; -1 for one group a row
) -> torch.Tensor:  # [N, K] fp32
    """weight[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size], in fp32."""
    n, k = check_int_weight(qweight, scales, zeros, bits, group_size, strict=False)
    group = k if group_size == -1 else group_size
    q = unpack_int4_rows(qweight) if bits == 4 else qweight
    q = q.reshape(n, k // group, group).float()
    g = k // group  # the group columns used (a checkpoint's tensors may carry more)
    return ((q - zeros[:, :g].float()[:, :, None]) * scales[:, :g].float()[:, :, None]).view(n, k)
