"""Maps a config's `architectures` entry to our model class."""

from __future__ import annotations

import importlib

_MODULES = ["llama", "qwen2", "qwen3"]


def _all_models() -> dict[str, type]:
    out = {}
    for mod in _MODULES:
        for cls in importlib.import_module(f"srt_lite.models.{mod}").EntryClass:
            out[cls.__name__] = cls
            # The base model (an embedding checkpoint saved from, say, Qwen3Model) loads into
            # the same class: its tensors lack the "model." prefix and the LM head, which the
            # loader allows (LlamaForCausalLM.load_weights).
            out[cls.__name__.replace("ForCausalLM", "Model")] = cls
    return out


def get_model_class(architectures: list[str] | None) -> type:
    models = _all_models()
    for arch in architectures or []:
        if arch in models:
            return models[arch]
    raise ValueError(
        f"unsupported model architecture {architectures}; supported: {', '.join(sorted(models))}"
    )
