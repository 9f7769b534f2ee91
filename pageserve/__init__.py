"""pageserve: a paged-KV LLM serving engine written from scratch in PyTorch + Triton."""
from .engine.beam_search import BeamSearchParams
from .engine.config import EngineConfig
from .engine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in the engine (and torch models); import it on first use
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from .engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "LoRARequest":
        from .engine.lora import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'pageserve' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "BeamSearchParams", "EngineConfig", "LoRARequest", "SamplingParams"]
