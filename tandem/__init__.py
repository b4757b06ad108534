"""tandem: an LLM inference engine whose CPU and GPU work in tandem."""

from tandem.lora_request import LoRARequest
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput", "EngineCore", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):  # heavy modules (torch, transformers) load on first use
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    if name == "EngineCore":
        from tandem.engine.core import EngineCore

        return EngineCore
    if name == "EngineConfig":
        from tandem.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
