"""srt_lite: an LLM serving engine built the way SGLang is built."""

from srt_lite.sampling.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it only when asked for.
    if name == "Engine":
        from srt_lite.engine import Engine

        return Engine
    raise AttributeError(name)
