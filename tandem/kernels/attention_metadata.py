"""AttentionMetadata: where each token of a step reads and writes the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One step's view of the paged KV cache, built by the runner on static device buffers.

    Tokens of all sequences are flattened into one dimension of length num_tokens (possibly padded).
    The KV cache of one layer is two tensors, k_cache and v_cache, each
    [num_blocks, block_size, num_kv_heads, head_dim]; block 0 is never handed to a request, so
    padding rows may point at it. Token t of sequence i sits at flat slot
    block_tables[i, t // block_size] * block_size + t % block_size.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; where each token's K/V is written, -1 = skip (padding)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32; cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32; context length incl. this step's tokens (0 for padding rows)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int  # host int; 1 means every sequence decodes one token
    max_seq_len: int  # host int; an upper bound of seq_lens (static under CUDA graphs)
    # Host int: how many leading sequences (rows 0..num_decodes-1, one token each) decode one token; num_seqs
    # in a decode-only step. A mixed step's attention runs them through the decode kernel.
    num_decodes: int = 0
    # [num_decodes] int32 (all rows in a decode step): the decode rows longest context first, the order the
    # decode kernel starts its programs in (load balance across its waves); None: row order.
    decode_order: torch.Tensor | None = None
    # Host bool: a decode step's attention kernel may write the step's K/V itself (each row reads only its own
    # sequence's earlier KV). False in a verify step written one row per token, whose rows read KV the other rows
    # of the same step write: the KV is then written by a kernel before the attention.
    fuse_kv_write: bool = True

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1
