"""Mixture-of-experts block: the router and every expert's gate/up and down weights stacked, sharded tensor- or
expert-parallel (Qwen2-MoE's gated shared expert is added in models/moe.py).

Sharding over the tensor-parallel group (tokens are replicated on every rank there):
- tensor parallel (default): every rank holds every expert's 1/N of the intermediate dimension, as the dense MLP;
- expert parallel (`ParallelConfig.expert_parallel`): expert e lives whole on rank e mod N (local index e // N);
  each rank runs its experts on the tokens routed to them and writes zeros for the others' pairs.
Either way the partial outputs are summed by one all-reduce, which the decode graphs capture.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.group import TPGroup, Unreduced
from tandem.kernels.fp8 import DEFER_REDUCE, FP8_DTYPE, PartialSums
from tandem.kernels.int_weight import IntWeight, repack_int_weight, use_tiles
from tandem.kernels.ops import count_routed_experts, fused_moe, moe_route
from tandem.layers.int_quant import check_int_layout, quantize_rtn_experts
from tandem.layers.linear import Linear
from tandem.layers.parallel import LazyTensor, materialize, take
from tandem.layers.quantization import quantize_weight_fp8


class RouterLinear(Linear):
    """The router's [num_experts, hidden] projection, replicated; it stays in the model dtype under FP8 and
    int4 / int8 (its logits choose the experts: tiny, and precision-sensitive)."""

    def quantize_fp8_(self) -> bool:
        return True  # nothing to do: counted as handled, not as a shape FP8 cannot take

    def quantize_int_(self, bits: int, group_size: int | None = None, name: str = "linear") -> None:
        return None  # int4 / int8 leave it in the model dtype too


class FusedMoE(nn.Module):
    """Routed experts: w13 [local experts, 2 * local inter, hidden] (gate rows, then up rows) and
    w2 [local experts, hidden, local inter]; FP8 after quantize_fp8_() with per-output-channel scales, 4- / 8-bit
    integer codes after quantize_int_() (w13_words, w13_scales, w13_mins and the same for w2: IntWeight stacks)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob  # Mixtral's config sets it (registry.py)
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        inter = config.moe_intermediate_size
        self.num_local_experts = config.num_experts // tp.size if self.expert_parallel else config.num_experts
        self.local_inter = inter if self.expert_parallel else inter // tp.size
        hidden = config.hidden_size
        self.gate = RouterLinear(hidden, config.num_experts)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.local_inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, self.local_inter), requires_grad=False)
        self.register_buffer("w13_scale", None)  # [local experts, 2 * local inter] fp32 with FP8 weights
        self.register_buffer("w2_scale", None)  # [local experts, hidden] fp32
        self.int_bits = 0  # 4 / 8 once quantize_int_() has replaced w13 and w2 by integer stacks
        self.int_group_sizes = (0, 0)  # (w13's, w2's) input columns per group
        self.int_tiled = (False, False)  # (w13's, w2's) words in tiles (int_weight.tile_words)
        self.act_order = False  # integer experts whose columns are sorted by group: w13_perm and w2_perm
        # A checkpoint whose experts are quantized (use_int_experts_): each expert matrix's tandem int-N tensors
        # gathered until its three (qweight, scales, zeros; and perm with act order) have come, by (expert, gate | up |
        # down).
        self._int_parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        # TANDEM_MOE_ROUTE_STATS=1 (set by `tandem bench` before the engine captures its graphs): a device counter of
        # the distinct experts each forward routes to, summed over forwards, for the roofline's expert bytes.
        stats = os.environ.get("TANDEM_MOE_ROUTE_STATS") == "1"
        self.register_buffer("routed_experts", torch.zeros((), dtype=torch.int64) if stats else None,
                             persistent=False)
        if self.expert_parallel:  # global id -> local index, -1 where another rank holds it
            ids = torch.arange(config.num_experts)
            local = torch.where(ids % tp.size == tp.rank, ids // tp.size, -1).to(torch.int32)
            self.register_buffer("expert_map", local, persistent=False)
        else:
            self.expert_map = None

    def local_expert(self, expert: int) -> int | None:
        """Index of global expert `expert` in this rank's stack; None where another rank holds it."""
        if not self.expert_parallel:
            return expert
        return expert // self.tp.size if expert % self.tp.size == self.tp.rank else None

    def forward(self, x: torch.Tensor,
                reduce: bool = True) -> torch.Tensor | Unreduced | PartialSums:  # [num_tokens, hidden]
        """reduce=False leaves the cross-rank sum to the caller (who adds more partial sums first); with reduce
        the output goes only into the RMSNorm after the block, which may take it unreduced over ranks (Unreduced)
        or as the pair path's unsummed rows (PartialSums, TANDEM_MOE_PAIR's "norm"), on one rank or inside
        Unreduced."""
        weights, ids = moe_route(self.gate(x), self.top_k, self.renormalize)
        if self.routed_experts is not None:
            count_routed_experts(ids, self.num_experts, self.routed_experts)
        # Unsummed rows go on to the norm on one rank, and across ranks where its all-reduce kernel adds them up.
        into_norm = reduce and DEFER_REDUCE and (self.tp.size == 1 or self.tp.defers_all_reduce())
        w13, w2 = self.expert_weights()
        perms = (self.w13_perm.data, self.w2_perm.data) if self.act_order else None
        # Act order over ranks that split the intermediate size: down reads the ranks' activations gathered whole.
        gather = self.tp.all_gather_last_dim if self.act_order and self.tp.size > 1 and not self.expert_parallel \
            else None
        out = fused_moe(x, w13, w2, weights, ids, self.expert_map, self.w13_scale, self.w2_scale,
                        into_norm=into_norm, perms=perms, gather_inter=gather)
        return self.tp.all_reduce_or_defer(out) if reduce and self.tp.size > 1 else out

    def expert_weights(self) -> tuple[torch.Tensor | IntWeight, torch.Tensor | IntWeight]:
        """(w13, w2): the stacked parameters, or with integer experts IntWeight stacks viewing them (made per call,
        so they follow the parameters wherever the module moves)."""
        if not self.int_bits:
            return self.w13, self.w2
        return tuple(IntWeight(getattr(self, f"{proj}_words").data, getattr(self, f"{proj}_scales").data,
                               getattr(self, f"{proj}_mins").data, self.int_bits, group, tiled)
                     for proj, group, tiled in zip(("w13", "w2"), self.int_group_sizes, self.int_tiled)
                     )  # type: ignore[return-value]

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor | LazyTensor) -> tuple[str, int]:
        """Copies one checkpoint expert matrix (proj: gate, up or down; Hugging Face [out, in]) into this rank's
        stack; returns (parameter name, elements copied: 0 where another rank holds the expert)."""
        param = "w2" if proj == "down" else "w13"
        local = self.local_expert(expert)
        if local is None:
            return param, 0
        n = self.local_inter
        start = 0 if self.expert_parallel else self.tp.rank * n
        if proj == "down":
            self.w2.data[local].copy_(take(tensor, 1, start, n))
        else:
            rows = slice(0, n) if proj == "gate" else slice(n, 2 * n)
            self.w13.data[local, rows].copy_(take(tensor, 0, start, n))
        return param, n * self.w2.shape[1]

    def load_stacked(self, proj: str, tensor: torch.Tensor | LazyTensor) -> tuple[str, int]:
        """A tensor of every expert ([experts, out, in]: GGUF's ffn_*_exps; proj gate_up: gate rows then up rows,
        transformers 5's fused layout); returns (parameter name, elements copied)."""
        full = materialize(tensor)
        copied = 0
        for e in range(self.num_experts):
            if proj == "gate_up":
                half = full.shape[1] // 2
                copied += self.load_expert(e, "gate", full[e, :half])[1] + self.load_expert(e, "up", full[e, half:])[1]
            else:
                copied += self.load_expert(e, proj, full[e])[1]
        return ("w2" if proj == "down" else "w13"), copied

    def use_int_experts_(self, bits: int, group_size: int, name: str = "experts", act_order: bool = False) -> None:
        """Replaces the (unloaded) expert stacks by empty integer stacks in the kernels' layout, for a checkpoint
        whose experts are quantized already (load_int_expert fills them); group_size -1: one group per row of a
        stack's (local) input columns. act_order: each expert matrix's columns come sorted by group, with the input
        column each reads (w13_perm [experts, hidden], shared by an expert's gate and up; w2_perm [experts, local
        inter]: with tensor parallelism this rank's slice of down's sorted columns, which name columns of the whole
        intermediate size). ValueError naming the layer where this shard's columns do not hold whole groups."""
        if self.int_bits:
            return
        hidden, n = self.w2.shape[1], self.local_inter
        dtype, device = self.w13.dtype, self.w13.device
        groups = []
        for proj, rows, cols in (("w13", 2 * n, hidden), ("w2", hidden, n)):
            group = check_int_layout(f"{name}.{proj}", bits, group_size, rows, cols)
            if cols * bits % 32 or group * bits % 32:
                raise ValueError(f"{name}.{proj}: {bits}-bit experts need input columns and groups of whole 32-bit "
                                 f"words, got {cols} columns in groups of {group}")
            delattr(self, proj)
            shapes = {"words": ((rows, cols * bits // 32), torch.int32), "scales": ((rows, cols // group), dtype),
                      "mins": ((rows, cols // group), dtype if bits == 4 else torch.float32)}
            for part, (shape, part_dtype) in shapes.items():
                setattr(self, f"{proj}_{part}", nn.Parameter(
                    torch.empty(self.num_local_experts, *shape, dtype=part_dtype, device=device), requires_grad=False))
            groups.append(group)
        self.int_bits, self.int_group_sizes = bits, (groups[0], groups[1])
        self.int_tiled = self._int_tiled(bits, hidden)
        if act_order:
            self.act_order = True
            for proj, cols in (("w13", hidden), ("w2", n)):
                setattr(self, f"{proj}_perm", nn.Parameter(
                    torch.empty(self.num_local_experts, cols, dtype=torch.int64, device=device), requires_grad=False))
            self._perms_loaded: set[tuple[int, str]] = set()  # (local expert, stack) whose permutation came

    def load_int_expert(self, expert: int, proj: str, part: str, tensor: torch.Tensor | LazyTensor,
                        source: str) -> list[tuple[str, int]]:
        """One tensor (qweight, scales, zeros, and with act order perm; tandem int-N layout, the whole matrix:
        Hugging Face [out, in]) of a quantized checkpoint expert matrix (proj: gate, up or down). Once the matrix's
        tensors have come, this rank's share (its rows of gate / up, its input columns of down, whole groups) is
        repacked into the stack; returns the (parameter name, elements copied) that filled: none before, or where
        another rank holds the expert. ValueError naming the tensor (`source`) when a shape does not fit, or where
        an expert's gate and up read their input in different orders."""
        parts = self._int_parts.setdefault((expert, proj), {})
        parts[part] = materialize(tensor)
        if len(parts) < (4 if self.act_order else 3):
            return []
        del self._int_parts[(expert, proj)]
        local = self.local_expert(expert)
        if local is None:
            return []
        stack = "w2" if proj == "down" else "w13"
        bits, group = self.int_bits, self.int_group_sizes[stack == "w2"]
        n = self.local_inter
        hidden = self.w2_words.shape[1]
        start = 0 if self.expert_parallel else self.tp.rank * n
        inter = n if self.expert_parallel else n * self.tp.size  # the checkpoint's whole intermediate size
        full = (hidden, inter) if proj == "down" else (inter, hidden)
        q, scales, zeros = parts["qweight"], parts["scales"], parts["zeros"]
        if q.shape != (full[0], full[1] * bits // 8) or scales.shape != zeros.shape or scales.shape[0] != full[0]:
            raise ValueError(f"expert weight {source!r}: qweight {tuple(q.shape)}, scales {tuple(scales.shape)}, "
                             f"zeros {tuple(zeros.shape)} do not fit a {bits}-bit [{full[0]}, {full[1]}] expert")
        if proj == "down":  # this rank's input columns: whole groups (one group a row: the same scales)
            q = q[:, start * bits // 8:(start + n) * bits // 8]
            if scales.shape[1] > 1:
                scales, zeros = (t[:, start // group:(start + n) // group] for t in (scales, zeros))
        else:
            q, scales, zeros = (t[start:start + n] for t in (q, scales, zeros))
        target = getattr(self, f"{stack}_words")
        dtype = getattr(self, f"{stack}_scales").dtype
        weight = repack_int_weight(q.to(target.device).contiguous(), scales.to(target.device, dtype).contiguous(),
                                   zeros.to(target.device, dtype).contiguous(), bits, group,
                                   self.int_tiled[stack == "w2"])
        rows = slice(None) if proj == "down" else slice(0, n) if proj == "gate" else slice(n, 2 * n)
        copied = []
        if self.act_order:  # down: this rank's slice of the sorted columns (whole groups), naming whole-input columns
            perm = parts["perm"].reshape(-1)
            copied += self._load_perm(local, stack, perm[start:start + n] if proj == "down" else perm, source)
        for name in ("words", "scales", "mins"):
            value = getattr(weight, name)
            getattr(self, f"{stack}_{name}").data[local, rows].copy_(value)
            copied.append((f"{stack}_{name}", value.numel()))
        return copied

    def _load_perm(self, local: int, stack: str, perm: torch.Tensor, source: str) -> list[tuple[str, int]]:
        """An expert matrix's act-order permutation into its stack's row: the first of gate / up fills it, the other
        must equal it (both read the one input x)."""
        target = getattr(self, f"{stack}_perm").data[local]
        if perm.shape != target.shape:
            raise ValueError(f"expert weight {source!r}: act-order permutation of {perm.shape[0]} columns for "
                             f"{target.shape[0]}")
        if (local, stack) not in self._perms_loaded:
            target.copy_(perm)
            self._perms_loaded.add((local, stack))
            return [(f"{stack}_perm", perm.numel())]
        if not torch.equal(target.cpu(), perm.to(target.dtype).cpu()):
            raise ValueError(f"expert weight {source!r}: its input-column order differs from the expert's other "
                             "projection of the same input (act-order g_idx of gate and up must agree)")
        return []

    def _int_tiled(self, bits: int, hidden: int) -> tuple[bool, bool]:
        """Whether w13's and w2's words are held in tiles (int_weight.use_tiles): w13's by its gate and up halves
        (each loaded on its own, and the kernels find the up rows a tile apart), w2's by its shape."""
        return use_tiles(self.local_inter, hidden, bits), use_tiles(hidden, self.local_inter, bits)

    def quantize_fp8_(self) -> bool:
        """Expert weights to FP8 with a scale per expert output channel (the router stays in the model dtype)."""
        if self.int_bits:
            return False
        if self.w13.dtype == FP8_DTYPE:
            return True
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q, scale = quantize_weight_fp8(w.reshape(-1, w.shape[-1]))
            setattr(self, name, nn.Parameter(q.view(w.shape), requires_grad=False))
            setattr(self, f"{name}_scale", scale.view(w.shape[0], w.shape[1]))
        return True

    def quantize_int_(self, bits: int, group_size: int | None = None, name: str = "experts") -> None:
        """Expert weights to 4- / 8-bit codes, round to nearest per group of each stack's (local) input columns
        (group_size None: rtn_group_size, 128 where it divides; a tensor-parallel shard is quantized after it is
        cut, so its groups never straddle ranks), held in the kernels' layout only; the full-precision stacks
        are freed and the router stays in the model dtype. ValueError naming the layer where no group fits."""
        if self.int_bits:
            return
        if self.w13.dtype == FP8_DTYPE:
            raise ValueError(f"{name}: FP8 experts cannot be quantized to {bits} bits")
        groups = []
        tiled = self._int_tiled(bits, self.w13.shape[2])
        for proj, in_tiles in zip(("w13", "w2"), tiled):
            stack = quantize_rtn_experts(getattr(self, proj).data, bits, group_size, f"{name}.{proj}", in_tiles)
            delattr(self, proj)
            for part in ("words", "scales", "mins"):
                setattr(self, f"{proj}_{part}", nn.Parameter(getattr(stack, part), requires_grad=False))
            groups.append(stack.group_size)
        self.int_bits, self.int_group_sizes, self.int_tiled = bits, (groups[0], groups[1]), tiled
