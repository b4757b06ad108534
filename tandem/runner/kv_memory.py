"""The KV pool: how many blocks fit (a profiling forward at full token budget measures what the activations take) and
the cache tensor itself."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from tandem.config import EngineConfig
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.runner.sampler import sample
from tandem.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

RESERVE_FOR_GRAPHS = 512 << 20  # bytes kept free for the CUDA graphs' pool, captured after the cache is allocated


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One rank's KV cache geometry."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
        cache = torch.zeros(self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                            dtype=self.dtype, device=device)
        logger.info("KV cache: %d blocks of %d tokens in %s (%.2f GiB)", num_blocks, self.block_size,
                    str(self.dtype).removeprefix("torch."), cache.numel() * cache.element_size() / 2**30)
        return cache


def num_blocks_from_memory(config: EngineConfig, layout: KVLayout, model: nn.Module, device: torch.device,
                           max_num_tokens: int, max_blocks_per_seq: int, reserved_bytes: int = 0) -> int:
    """Blocks that fit the budget: cpu_kv_cache_gib on the CPU; on a GPU what is left of gpu_memory_utilization
    after the weights, a full-budget forward's activations and the graphs' reserve; less reserved_bytes (memory
    allocated beside the pool, such as a speculative head's scratch blocks). Never more than every seat filled to
    the context limit can use."""
    budget = int(config.cpu_kv_cache_gib * (1 << 30)) if device.type != "cuda" else \
        _gpu_budget(config, layout, model, device, max_num_tokens)
    budget -= reserved_bytes
    num_blocks = min(budget // layout.bytes_per_block, config.max_num_seqs * max_blocks_per_seq + 1)
    if num_blocks < 2:
        raise ValueError(f"not enough memory for the KV cache: {budget / 2**30:.2f} GiB left, "
                         f"{layout.bytes_per_block} bytes per block")
    return int(num_blocks)


@torch.inference_mode()
def _gpu_budget(config: EngineConfig, layout: KVLayout, model: nn.Module, device: torch.device,
                num_tokens: int) -> int:
    """Memory left for the KV cache after the weights and a profiling forward at full token budget."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    scratch = torch.zeros(layout.num_layers, 2, 1, layout.block_size, layout.num_kv_heads, layout.head_dim,
                          dtype=layout.dtype, device=device)
    ids = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, math.ceil(num_tokens / layout.block_size), dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens,
    )
    hidden = model(ids, ids, scratch, meta)
    # A step samples a row per sequence, and with grammar-forced drafts as many draft rows more (ModelRunner).
    logits = model.compute_logits(hidden[: config.max_num_seqs * (2 if config.forced_drafts else 1)])
    rows = logits.shape[0]
    sample(logits, torch.ones(rows, device=device), torch.full((rows,), 5, dtype=torch.int32, device=device),
           torch.full((rows,), 0.9, device=device), torch.zeros(rows, dtype=torch.int64, device=device),
           torch.zeros(rows, dtype=torch.int64, device=device),
           all_greedy=False, any_top_k_top_p=True, num_logprobs=MAX_LOGPROBS)
    del hidden, logits, scratch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # so that `free` below counts the profiling activations as free again
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    free, total = torch.cuda.mem_get_info(device)
    budget = int(free - (1.0 - config.gpu_memory_utilization) * total - activation_peak - RESERVE_FOR_GRAPHS)
    logger.info("KV budget %.2f GiB (free %.2f, activation peak %.2f)", budget / 2**30, free / 2**30,
                activation_peak / 2**30)
    return max(budget, 0)

