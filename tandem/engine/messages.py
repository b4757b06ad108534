"""Typed messages between the API processes and the engine-core process (msgspec msgpack, never pickle)."""

from __future__ import annotations

import msgspec

from tandem.lora_request import LoRARequest
from tandem.outputs import EngineOutput
from tandem.sampling_params import SamplingParams

# ---- API process -> engine core (one message holds every command a client had ready) ---------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated by the API process; msgspec rebuilds the frozen dataclass
    client_index: int  # which API process gets this request's outputs
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


class UnloadLoRA(msgspec.Struct, tag="unload_lora", array_like=True):
    """Forget an adapter: requests queued or running with it finish with it; new ones must name a loaded one."""

    lora_int_id: int


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    reason: str  # a FinishReason value: "abort", or "stop" when the client matched a stop string
    stop_reason: int | str | None = None


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Fail whatever is left and exit (sent by the launcher after the API processes have drained)."""


class AbortClient(msgspec.Struct, tag="abort_client", array_like=True):
    """Abort every request API process `client_index` owns (sent by the launcher when that process died)."""

    client_index: int


ClientCommand = AddRequest | AbortRequest | Shutdown | AbortClient | UnloadLoRA


# ---- engine core -> one API process (one message per engine step) ------------------------


class Rejection(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    status: int  # 400: the engine refused the input; 429: the engine holds --max-queue requests already


class WireStats(msgspec.Struct, array_like=True):
    """EngineStats on the wire: the figures /metrics shows."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_free_blocks: int
    num_blocks: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_verified_rows: int = 0
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}
    lora_page_ins: int = 0
    lora_host_copies: int = 0


class EngineBatch(msgspec.Struct, tag="batch", array_like=True):
    """One engine step's news for one API process; an empty one is the heartbeat of an idle engine."""

    outputs: list[EngineOutput] = []  # the engine's own outputs go on the wire as they are
    accepted: list[str] = []
    rejected: list[Rejection] = []
    stats: WireStats | None = None
    engine_index: int = 0  # which data-parallel replica sent it
    stalled_s: float = 0.0  # heartbeats: seconds since the engine loop last went round (0 from the loop itself)


class EngineInfo(msgspec.Struct, tag="info"):
    """What the API processes need to know of the loaded engine (sent once, at start)."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    pid: int
    # With LoRA on: every projection an adapter may target, by Hugging Face module name -> [in, out] features
    # (the API processes check an adapter's shapes against it before they name it in a request).
    lora_modules: dict[str, list[int]] = {}


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine could not start (bad model path, out of memory ...)."""

    message: str


StartupReply = EngineInfo | EngineFailed


def stats_to_wire(stats: object) -> WireStats:
    # Figures a stats object lacks (an engine without speculative decoding's counters) keep their defaults.
    return WireStats(**{name: getattr(stats, name) for name in WireStats.__struct_fields__ if hasattr(stats, name)})


def merge_reported(parts: list[WireStats | None]) -> WireStats | None:
    """The replicas' latest figures as one view; None until every replica has reported."""
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else merge_stats(parts)  # type: ignore[arg-type]


_PER_ADAPTER = ("lora_running", "lora_waiting")  # adapter name -> requests
_NOT_SUMMED = ("spec_accepted_per_position", *_PER_ADAPTER)


def merge_stats(parts: list[WireStats]) -> WireStats:
    """One view of several replicas: counts add up; KV usage is over all blocks; the hit rate is the mean."""
    total = {name: sum(getattr(p, name) for p in parts) for name in WireStats.__struct_fields__
             if name not in _NOT_SUMMED}
    for name in _PER_ADAPTER:  # requests per adapter, over the replicas
        merged: dict[str, int] = {}
        for p in parts:
            for adapter, n in getattr(p, name).items():
                merged[adapter] = merged.get(adapter, 0) + n
        total[name] = merged
    total["spec_accepted_per_position"] = tuple(
        sum(p.spec_accepted_per_position[j] for p in parts if j < len(p.spec_accepted_per_position))
        for j in range(max(len(p.spec_accepted_per_position) for p in parts)))
    blocks = total["num_blocks"] or 1
    total["kv_cache_usage"] = sum(p.kv_cache_usage * p.num_blocks for p in parts) / blocks
    total["prefix_cache_hit_rate"] = total["prefix_cache_hit_rate"] / len(parts)
    return WireStats(**total)
