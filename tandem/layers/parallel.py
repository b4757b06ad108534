"""Megatron-style tensor-parallel layers: column/row-parallel Linear subclasses, vocab-parallel embedding and logits.

Every rank holds a slice of each sharded weight. A column-parallel layer keeps whole output rows (its
input is replicated, its output is this rank's part); a row-parallel layer keeps input columns and ends
with one all-reduce. The collectives run in the TPGroup the layer was built with (tandem/distributed/); with
one rank every layer is exactly its base class.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.config import ModelConfig, ParallelConfig
from tandem.distributed.group import TPGroup, Unreduced
from tandem.kernels.fp8 import PartialSums, QuantizedRows
from tandem.layers.linear import Embedding, Linear, lm_head_logits

Ranks = ParallelConfig | TPGroup  # what the shape helpers read: rank and size


# ---------------------------------------------------------------- shapes


def check_tp_shape(config: ModelConfig, tp: ParallelConfig) -> None:
    """ValueError when the model cannot be split evenly over tp.size ranks."""
    n = tp.size
    if n == 1:
        return
    name = config.architecture
    if config.num_heads % n:
        raise ValueError(f"{name}: {config.num_heads} attention heads cannot be split over tensor_parallel_size={n}")
    kv = config.num_kv_heads
    if (kv >= n and kv % n) or (kv < n and n % kv):
        raise ValueError(f"{name}: {kv} KV heads cannot be split or replicated over tensor_parallel_size={n}")
    if config.intermediate_size % n:
        raise ValueError(f"{name}: intermediate size {config.intermediate_size} is not divisible by "
                         f"tensor_parallel_size={n}")
    if config.num_experts == 0:
        return
    if tp.expert_parallel and config.num_experts % n:
        raise ValueError(f"{name}: {config.num_experts} experts cannot be spread evenly over {n} ranks "
                         "(enable_expert_parallel)")
    if not tp.expert_parallel and config.moe_intermediate_size % n:
        raise ValueError(f"{name}: expert intermediate size {config.moe_intermediate_size} is not divisible by "
                         f"tensor_parallel_size={n}")
    if config.shared_expert_intermediate_size % n:
        raise ValueError(f"{name}: shared expert intermediate size {config.shared_expert_intermediate_size} is "
                         f"not divisible by tensor_parallel_size={n}")


def local_kv_heads(config: ModelConfig, tp: Ranks) -> int:
    """KV heads this rank holds: split when there are at least as many as ranks, else one replicated head."""
    return max(config.num_kv_heads // tp.size, 1)


def kv_head_start(config: ModelConfig, tp: Ranks) -> int:
    """Index of the first KV head of this rank (ranks r*kv//n share head r*kv//n when kv < n)."""
    if config.num_kv_heads >= tp.size:
        return tp.rank * (config.num_kv_heads // tp.size)
    return tp.rank * config.num_kv_heads // tp.size


# ---------------------------------------------------------------- loading only a rank's shard


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: narrow() reads only the slice (safetensors get_slice)."""

    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def full(self) -> torch.Tensor: ...


def take(t: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a tensor or lazy tensor."""
    if start == 0 and length == t.shape[dim]:
        return t if isinstance(t, torch.Tensor) else t.full()
    return t.narrow(dim, start, length)


def materialize(t: torch.Tensor | LazyTensor) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.full()


class TransposedLazy:
    """The transpose of a lazy [in, out] tensor (GPT-2's Conv1D), still read slice by slice."""

    def __init__(self, inner: LazyTensor) -> None:
        self.inner = inner
        self.shape = tuple(reversed(inner.shape))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.inner.narrow(1 - dim, start, length).t()

    def full(self) -> torch.Tensor:
        return self.inner.full().t()


def transpose(t: torch.Tensor | LazyTensor) -> torch.Tensor | LazyTensor:
    return t.t() if isinstance(t, torch.Tensor) else TransposedLazy(t)


# ---------------------------------------------------------------- layers


class ColumnParallelLinear(Linear):
    """Output rows split over ranks. `parts` lists the fused sub-projections (q, k, v or gate, up) as
    (first row of this rank in the checkpoint tensor that shard_for_load gets for the part, rows this
    rank keeps); the local weight is their concatenation. `full_sizes`: each part's rows in the whole (unsharded)
    projection (a replicated KV head counted once), which LoRA's shape checks read."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], full_sizes: list[int],
                 bias: bool = False) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=bias)
        if len(full_sizes) != len(parts):
            raise ValueError(f"{len(parts)} parts but {len(full_sizes)} full sizes")
        self.parts = parts
        self.full_sizes = full_sizes

    def shard_for_load(self, tensor: torch.Tensor | LazyTensor, part: int = 0) -> tuple[torch.Tensor, int]:
        """(this rank's rows of a checkpoint weight or bias of sub-projection `part`, row offset in the param)."""
        start, rows = self.parts[part]
        offset = sum(n for _, n in self.parts[:part])
        return take(tensor, 0, start, rows), offset


def column_parts(full_sizes: list[int], tp: Ranks, fused_source: bool) -> list[tuple[int, int]]:
    """Even split of each sub-projection: rank r keeps rows [r * s / n, (r + 1) * s / n) of each. Source rows
    count from the start of the fused checkpoint tensor (fused_source, GPT-2's c_attn) or of each part's own."""
    parts, base = [], 0
    for size in full_sizes:
        rows = size // tp.size
        parts.append((base + tp.rank * rows, rows))
        base += size if fused_source else 0
    return parts


class RowParallelLinear(Linear):
    """Input columns split over ranks; the partial products are summed by one all-reduce. The bias lives
    on rank 0 only, so it is added exactly once."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False) -> None:
        super().__init__(in_features // tp.size, out_features, bias=bias and tp.rank == 0)
        self.tp = tp
        self.has_bias = bias

    def forward(self, x: torch.Tensor | QuantizedRows,
                defer_reduce: bool = False) -> torch.Tensor | PartialSums | Unreduced:
        """defer_reduce (the output goes only into RMSNorm's residual add): as Linear's on one rank; across ranks
        the all-reduce may be left to the norm (Unreduced)."""
        if self.tp.size > 1:
            # Split-K partial sums, too, may go on to the norm: its all-reduce kernel adds them up.
            out = super().forward(x, defer_reduce and self.tp.defers_all_reduce())
            return self.tp.all_reduce_or_defer(out) if defer_reduce else self.tp.all_reduce(out)  # type: ignore[arg-type]
        return super().forward(x, defer_reduce)

    def _columns_input(self, x: torch.Tensor) -> torch.Tensor:
        """An act-order integer weight's input: its checkpoint columns are sorted by group before they are split,
        so this rank holds whole groups of columns from anywhere in the input, and its `perm` names them in the
        whole input (shard_for_load), which the ranks' slices are gathered into first (one all-gather of the
        layer's input per step)."""
        if self.tp.size == 1:
            return x
        whole = self.tp.all_gather_last_dim(x.reshape(-1, x.shape[-1]))
        return whole.view(*x.shape[:-1], whole.shape[-1])

    def shard_for_load(self, tensor: torch.Tensor | LazyTensor, is_bias: bool,
                       param: str = "weight") -> torch.Tensor | None:
        """This rank's columns of the weight (or of an integer weight's `param`: qweight's packed columns,
        scales' and zeros' groups, each a 1/tp share, whole groups since use_int_weight_ checked the local
        columns; a single per-row group is every rank's; an act-order `perm`: the input columns of this rank's
        sorted columns); the bias on rank 0, None (skip it) elsewhere."""
        if is_bias:
            return materialize(tensor) if self.tp.rank == 0 else None
        if param == "perm":
            return take(tensor, 0, self.tp.rank * self.in_features, self.in_features)
        cols = self.in_features if param == "weight" else getattr(self, param).shape[1]
        if param in ("scales", "zeros") and tensor.shape[1] == cols == 1:
            return materialize(tensor)
        return take(tensor, 1, self.tp.rank * cols, cols)


def _vocab_rows(vocab_size: int, tp: Ranks) -> int:
    return -(-vocab_size // tp.size)  # ceil: the last rank's tail rows are zero padding


def _vocab_shard(tensor: torch.Tensor | LazyTensor, vocab_size: int, tp: Ranks) -> torch.Tensor:
    rows = _vocab_rows(vocab_size, tp)
    start = tp.rank * rows
    n = max(min(rows, vocab_size - start), 0)
    local = take(tensor, 0, start, n)
    if n == rows:
        return local
    padded = torch.zeros(rows, *local.shape[1:], dtype=local.dtype)
    padded[:n] = local
    return padded


class VocabParallelEmbedding(Embedding):
    """Rows [r * ceil(V / n), (r + 1) * ceil(V / n)) of the table on rank r; lookups outside them give
    zeros, and one all-reduce assembles the embeddings."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TPGroup) -> None:
        rows = _vocab_rows(vocab_size, tp)
        super().__init__(rows, embedding_dim)
        self.tp = tp
        self.vocab_size = vocab_size
        self.start = tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = super().forward(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def shard_for_load(self, tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
        return _vocab_shard(tensor, self.vocab_size, self.tp)


class ParallelLMHead(Linear):
    """The untied output projection, vocabulary rows split like VocabParallelEmbedding (in FP8 once
    quantize_fp8_() ran, in integer codes once quantize_int_() did: quantize_lm_head)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__(hidden_size, _vocab_rows(vocab_size, tp))
        self.tp = tp
        self.vocab_size = vocab_size

    @classmethod
    def tied_copy(cls, embedding: VocabParallelEmbedding, vocab_size: int, tp: TPGroup) -> ParallelLMHead:
        """A head over the same rows as a tied embedding table (sharing its storage until quantize_fp8_()
        replaces the weight by an FP8 copy; the embedding keeps its own for lookups)."""
        with torch.device("meta"):
            head = cls(embedding.weight.shape[1], vocab_size, tp)
        head.weight = torch.nn.Parameter(embedding.weight.data, requires_grad=False)
        return head

    def shard_for_load(self, tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
        return _vocab_shard(tensor, self.vocab_size, self.tp)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.int_bits:  # the integer product of any Linear (the int-weight kernels on a GPU)
            return gather_vocab(self.base_forward(hidden), self.vocab_size, self.tp, out)
        return parallel_logits(hidden, self.weight, self.vocab_size, self.tp, out, self.weight_scale)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup,
                    out: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[n, hidden] against this rank's vocabulary rows (FP8 with weight_scale), all-gathered: [n, vocab] in the
    model dtype, the same on every rank."""
    if tp.size == 1:
        return lm_head_logits(hidden, weight, out, weight_scale)  # straight into out
    return gather_vocab(lm_head_logits(hidden, weight, weight_scale=weight_scale), vocab_size, tp, out)


def gather_vocab(logits: torch.Tensor, vocab_size: int, tp: TPGroup, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's [n, vocabulary rows] logits all-gathered to [n, vocab] (the padding rows dropped), copied into
    `out` when given."""
    if tp.size > 1:
        logits = tp.all_gather_last_dim(logits)[:, :vocab_size]
    return logits if out is None else out.copy_(logits)
