"""Scheduler package: continuous batching over a paged, prefix-shared KV cache (pure Python, no CUDA)."""

from tandem.scheduler.block_pool import BlockPool
from tandem.scheduler.kv_cache_manager import KVCacheManager, hash_block_tokens
from tandem.scheduler.output import ScheduledRequest, SchedulerOutput
from tandem.scheduler.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerConfig

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "BlockPool",
    "KVCacheManager",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "hash_block_tokens",
]
