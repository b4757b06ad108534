"""The LoRA delta of a batch that mixes adapters: y += (x @ A[slot]^T) @ B[slot]^T per token, slot -1 adding
nothing; the Triton shrink / expand kernels on CUDA, the plain-PyTorch reference below on the CPU. At decode sizes
the expand may instead run in the epilogue of the base projection's kernel (LoRAShrunk: what that epilogue reads), and
the separate kernels find each adapter's rows through the step's tokens grouped by slot once (SlotGroups)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.ops import GEMV_ROWS_LIMIT, silu_and_mul, use_triton

MAX_RANK_TILES = 64  # the Triton shrink's rank tiles a counter buffer serves per slot
# Rows up to which lora_shrink reads each row's adapter rows by itself (the decode GEMV's rows); past it, tokens that
# share an adapter share its reads (the token-block kernel's tile products).
SHRINK_GEMV_MAX_ROWS = 4
# Tokens up to which a step's index is grouped by slot for the sorted decode kernels (triton_lora.ONE_BLOCK_MAX: the
# one-block kernels' rows, which they replace).
SORTED_MAX_ROWS = 128
SORTED_CHUNK = 16  # a slot's grouped rows a sorted kernel program takes (a decode step's slots mostly have fewer)


def sorted_max_chunks(num_slots: int) -> int:
    """The most chunks a grouping of up to SORTED_MAX_ROWS tokens over num_slots slots makes (a part chunk a slot
    and one for the tokens without an adapter, a whole one per SORTED_CHUNK tokens)."""
    return num_slots + 1 + SORTED_MAX_ROWS // SORTED_CHUNK


@dataclass(slots=True)
class SlotGroups:
    """A step's tokens grouped by adapter slot, made with the token index once a step (index_token_slots) and read
    by every projection's sorted shrink and expand: a program per chunk of a slot's rows gathers them from here."""

    num_slots: int  # the pool's slots (token slots outside 0..num_slots-1 count as none)
    rows: torch.Tensor  # [max_num_tokens] int32: token indices slot by slot (ascending), those without one last
    # [sorted_max_chunks(num_slots), 3] int32: (slot, start, end) of the p-th chunk, its tokens rows[start:end]
    # (up to SORTED_CHUNK of one slot; chunks in slot order, those of the tokens without an adapter last, with
    # slot -1: only the gated expand, which writes every row, reads them); (0, 0, 0) past the step's chunks
    chunks: torch.Tensor
    num_tokens: int = 0  # tokens of the last grouping (host side; 0: not grouped, the one-block kernels run)


def slot_groups(max_loras: int, max_num_tokens: int, device: torch.device) -> SlotGroups:
    """Static grouping buffers for a pool of max_loras slots and a step of up to max_num_tokens tokens."""
    return SlotGroups(max_loras, torch.zeros(max_num_tokens, dtype=torch.int32, device=device),
                      torch.zeros(sorted_max_chunks(max_loras), 3, dtype=torch.int32, device=device))


def lora_sorted() -> bool:
    """Whether decode steps (up to SORTED_MAX_ROWS tokens, a pool of more than one slot) group their tokens by slot
    for the sorted shrink and expand; TANDEM_LORA_SORTED=0 keeps the one-block kernels. Read per step, when the
    index is written: a CUDA graph keeps what its capture chose."""
    return os.environ.get("TANDEM_LORA_SORTED") != "0"


def index_token_slots(step_slots: torch.Tensor, token_slots: torch.Tensor, groups: SlotGroups | None) -> None:
    """The step's per-token slots [n] into the static index token_slots[:n]; where the sorted kernels will take the
    step (Triton, 1..SORTED_MAX_ROWS tokens, more than one slot, lora_sorted()), one kernel copies them and groups
    the tokens by slot into groups, which every projection of the step then reads."""
    n = step_slots.shape[0]
    if (groups is not None and 0 < n <= min(SORTED_MAX_ROWS, groups.rows.shape[0]) and groups.num_slots > 1
            and use_triton(step_slots) and lora_sorted()):
        from tandem.kernels.triton_lora_sorted import group_token_slots_triton  # lazy: CPU runs never import Triton

        group_token_slots_triton(step_slots, token_slots, groups)
        return
    token_slots[:n].copy_(step_slots)
    if groups is not None:
        groups.num_tokens = 0


def _grouped(groups: SlotGroups | None, n: int) -> bool:
    """Whether n rows run the sorted kernels: the step's tokens were grouped, over at least these rows."""
    return groups is not None and 0 < n <= groups.num_tokens


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 token_slots: torch.Tensor) -> torch.Tensor:
    """y [n, out] += the delta in place. a [slots, rank, in], b [slots, out, rank] (the scale folded into b),
    token_slots [n] (-1: no adapter). Every token goes through every slot and a one-hot mask keeps its own: no
    host-side count or gather by slot, so it is as graph-safe as the kernels (and exact: the others add zeros)."""
    num_slots, rank, k = a.shape
    n = x.shape[0]
    shrink = (x @ a.reshape(num_slots * rank, k).t()).view(n, num_slots, rank)  # [n, slots, rank]
    own = token_slots.view(n, 1) == torch.arange(num_slots, device=x.device).view(1, num_slots)
    shrink = shrink * own.to(shrink.dtype).unsqueeze(-1)
    # [n, slots * rank] @ [slots * rank, out]
    y += shrink.view(n, num_slots * rank) @ b.transpose(1, 2).reshape(num_slots * rank, b.shape[1])
    return y


Output = torch.Tensor | PartialSums


def _rows(y: Output) -> torch.Tensor:
    """Where a delta adds onto a base output: its rows [n, out], or a split-K GEMM's first partial sums (fp32; the
    add + RMSNorm after it adds the splits, so the delta needs no reduce kernel first)."""
    if isinstance(y, PartialSums):
        if y.scale is not None:  # the channel scale would multiply the delta too
            raise ValueError("a LoRA delta cannot go into the partial sums of a scaled (FP8) GEMM")
        return y.ws[0]
    return y.view(-1, y.shape[-1])


def _gated(y: Output, gated: int) -> Output:
    """silu(gate) * up of a gate/up projection's output with its delta (gated), else the output itself."""
    return silu_and_mul(y) if gated else y  # type: ignore[arg-type]


def lora_add(y: Output, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, counters: torch.Tensor | None = None,
             groups: SlotGroups | None = None, gated: int = 0) -> Output:
    """y [..., out] (or a split-K GEMM's PartialSums, scale None) += the per-token adapter delta of x [..., in]
    (see lora_add_ref); returns y, or with gated (a gate/up projection: gate rows, then up; the parts of its B,
    lora_expand_gated_sorted_triton's) silu(gate) * up of it. counters: the kernels' split counters
    (triton_lora.lora_counters), shared by a pool's linears; groups: the step's tokens grouped by slot (the sorted
    kernels run where they cover x's rows)."""
    y2, x2 = _rows(y), x.reshape(-1, x.shape[-1])
    slots = token_slots[: x2.shape[0]]
    if _lora_kernels(x2) and _grouped(groups, x2.shape[0]):
        from tandem.kernels.triton_lora_sorted import lora_shrink_sorted_triton  # lazy: no Triton on CPU

        shrink = lora_shrink_sorted_triton(x2, a, groups, counters)
        return _expand_sorted(y, shrink, b, groups, gated)  # type: ignore[arg-type]
    if _lora_kernels(x2):
        from tandem.kernels.triton_lora import lora_add_triton  # lazy: CPU runs never import Triton

        lora_add_triton(y2, x2, a, b, slots, counters)
    else:
        lora_add_ref(y2, x2, a, b, slots)
    return _gated(y, gated)


def _expand_sorted(y: Output, shrink: torch.Tensor, b: torch.Tensor, groups: SlotGroups, gated: int) -> Output:
    """The sorted expand of a grouped step onto y; gated (B's parts): one kernel adds the delta and applies
    silu(gate) * up."""
    from tandem.kernels.triton_lora_sorted import lora_expand_gated_sorted_triton, lora_expand_sorted_triton  # lazy

    if gated:
        y2 = _rows(y)
        return lora_expand_gated_sorted_triton(y2, shrink, b, groups, gated).view(*y.shape[:-1], y.shape[-1] // 2)
    lora_expand_sorted_triton(_rows(y), shrink, b, groups)
    return y


def lora_add_beside(x: torch.Tensor, base: Callable[[], Output], a: torch.Tensor, b: torch.Tensor,
                    token_slots: torch.Tensor, counters: torch.Tensor | None,
                    side: torch.cuda.Stream | None, groups: SlotGroups | None = None, gated: int = 0) -> Output:
    """base() (x's base projection, [..., out], or its split-K PartialSums) plus the per-token delta (gated: then
    silu(gate) * up, as lora_add's). Where the Triton kernels run and a side stream is given, the shrink, which
    reads only x, runs on `side` while base() runs, and the expand after both (a captured graph keeps the fork and
    the join): the shrink's fixed cost, ~6-10 us a projection at 32 rows, leaves the step's critical path.
    counters: the side stream's own (its shrinks may overlap the main stream's); groups: as lora_add's."""
    x2 = x.reshape(-1, x.shape[-1])
    if side is None or not _lora_kernels(x2):
        return lora_add(base(), x, a, b, token_slots, counters, groups, gated)
    from tandem.kernels.triton_lora import lora_expand_triton, lora_shrink_block_triton  # lazy: no Triton on CPU
    from tandem.kernels.triton_lora_sorted import lora_shrink_sorted_triton

    slots = token_slots[: x2.shape[0]]
    grouped = _grouped(groups, x2.shape[0])
    main = torch.cuda.current_stream(x2.device)
    side.wait_stream(main)  # x (and the step's grouping) is written
    with torch.cuda.stream(side):
        # Its memory returns to the side stream's pool, whose next use waits on the main stream (above) again.
        shrink = (lora_shrink_sorted_triton(x2, a, groups, counters) if grouped
                  else lora_shrink_block_triton(x2, a, slots, counters))
    y = base()
    main.wait_stream(side)
    if grouped:
        return _expand_sorted(y, shrink, b, groups, gated)  # type: ignore[arg-type]
    lora_expand_triton(_rows(y), shrink, b, slots)
    return _gated(y, gated)


def _lora_kernels(x2: torch.Tensor) -> bool:
    """Whether the Triton kernels take x2's rows (not fp32 on a GPU, where tensor-core dots round to TF32)."""
    return use_triton(x2) and not (x2.is_cuda and x2.dtype == torch.float32)


def lora_counters(num_slots: int, device: torch.device) -> torch.Tensor:
    """The split counters the Triton kernels of a pool of num_slots slots share (a slot's or a sorted chunk's rank
    tiles): zero, and zero again after every call, so one buffer serves every linear of a model (their kernels run
    one after another on a stream)."""
    return torch.zeros(sorted_max_chunks(num_slots) * MAX_RANK_TILES, dtype=torch.int32, device=device)


@dataclass(slots=True)
class LoRAShrunk:
    """What a base GEMM's epilogue needs to add each token's delta to the tile of y it computed: the shrink (x @
    A[slot]^T, fp32), B and the per-token slots. An epilogue reads s only on rows whose slot is >= 0 (the
    token-block shrink leaves the others unwritten)."""

    s: torch.Tensor  # [n, rank] fp32
    b: torch.Tensor  # [slots, out, rank], the scale folded in; rows match the base weight's rows
    token_slots: torch.Tensor  # [>= n] int32, -1: no adapter


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ A[slot]^T per token -> [n, rank] fp32 (zero where the slot is -1), as lora_add_ref's one-hot
    sum: graph-safe, no gather by slot on the host."""
    num_slots, rank, k = a.shape
    n = x.shape[0]
    shrink = (x.float() @ a.reshape(num_slots * rank, k).float().t()).view(n, num_slots, rank)
    own = token_slots[:n].view(n, 1) == torch.arange(num_slots, device=x.device).view(1, num_slots)
    return (shrink * own.to(shrink.dtype).unsqueeze(-1)).sum(dim=1)


def lora_in_gemv() -> bool:
    """Whether a LoRA target linear that runs a decode kernel (the GEMV, the skinny tile GEMM) adds its delta in
    that kernel's epilogue (a shrink kernel, then base + expand in one kernel) rather than with the separate shrink
    and expand after the base output; TANDEM_LORA_FUSED=0 turns it off (read per call: a CUDA graph keeps what its
    capture chose)."""
    return os.environ.get("TANDEM_LORA_FUSED") != "0"


def lora_in_skinny() -> bool:
    """Whether 5-32 rows (the skinny tile GEMM's) add the delta in that GEMM's epilogue too: TANDEM_LORA_FUSED_SKINNY=1
    (default off: on an H200, 2026-11-29, 32 sequences over 8 adapters ran 0.650x the base model with it against
    0.706x with the separate shrink and expand kernels; the one-row GEMV's epilogue paid, 0.902x against 0.795x).
    Read per call, like lora_in_gemv."""
    return os.environ.get("TANDEM_LORA_FUSED_SKINNY") == "1"


def lora_skinny_rows(x: torch.Tensor, in_features: int) -> bool:
    """Whether a LoRA target on x ([..., in_features]) runs the skinny GEMM with the delta in its epilogue even
    where the base model's linear would not (use_skinny): up to TANDEM_LORA_SKINNY_MAX_ROWS rows (default 0: only
    where use_skinny says; at most GEMV_ROWS_LIMIT). At 33-64 rows the base model's cuBLAS outran the skinny GEMM
    (0.8-0.96x of its speed on an H200), but an adapted projection there pays for separate expand kernels (and
    the gate/up projection for a silu_and_mul) that the fused GEMM does not run; the setting lets a run compare."""
    numel = x.numel()
    if numel > GEMV_ROWS_LIMIT * in_features:  # prefill-sized: no env lookups
        return False
    rows = int(os.environ.get("TANDEM_LORA_SKINNY_MAX_ROWS", "0"))
    return numel <= rows * in_features and not (x.is_cuda and x.dtype == torch.float32) and use_triton(x)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                counters: torch.Tensor | None = None, groups: SlotGroups | None = None) -> torch.Tensor:
    """[n, rank] fp32 shrink of x [n, in] through each token's A (see lora_shrink_ref; rows with slot -1 may be left
    unwritten: LoRAShrunk). Where Triton runs: up to SHRINK_GEMV_MAX_ROWS rows a GEMV over each row's own A rows
    (no K split, no second pass), more rows lora_add's shrink (the sorted one where groups cover the rows;
    counters: its split counters)."""
    if not use_triton(x):
        return lora_shrink_ref(x, a, token_slots)
    if x.shape[0] <= SHRINK_GEMV_MAX_ROWS:
        from tandem.kernels.triton_gemv import lora_shrink_triton  # lazy: CPU runs never import Triton

        return lora_shrink_triton(x, a, token_slots)
    if _grouped(groups, x.shape[0]):
        from tandem.kernels.triton_lora_sorted import lora_shrink_sorted_triton  # lazy: CPU runs never import Triton

        return lora_shrink_sorted_triton(x, a, groups, counters)
    from tandem.kernels.triton_lora import lora_shrink_block_triton  # lazy: CPU runs never import Triton

    return lora_shrink_block_triton(x, a, token_slots, counters)

