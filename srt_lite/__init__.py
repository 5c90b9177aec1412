"""srt_lite: an LLM serving engine built the way SGLang is built."""

from srt_lite import cpu_caps

# Before anything imports torch: a forced lower CPU level must reach ATen and oneDNN too.
cpu_caps.export_forced_env()

from srt_lite.sampling.sampling_params import SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it only when asked for.
    if name == "Engine":
        from srt_lite.engine import Engine

        return Engine
    raise AttributeError(name)
