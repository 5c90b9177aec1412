"""Maps a config's `architectures` entry to our model class.

The table names modules rather than importing them, so that a process that only checks a
config (the HTTP server's, which never imports torch) can say which models are supported.
"""

from __future__ import annotations

import importlib

# Class name -> the module under srt_lite.models that defines it (in its EntryClass).
_MODULES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _known() -> dict[str, str]:
    """Every accepted architecture name -> its class name. The base model (an embedding
    checkpoint saved from, say, Qwen3Model) loads into the same class: its tensors lack the
    "model." prefix and the LM head, which the loader allows (LlamaForCausalLM.load_weights)."""
    names = {name: name for name in _MODULES}
    names.update({name.replace("ForCausalLM", "Model"): name for name in _MODULES})
    return names


def model_class_name(architectures: list[str] | None) -> str:
    """The class that serves the first supported entry of `architectures`; ValueError if none is."""
    known = _known()
    for arch in architectures or []:
        if arch in known:
            return known[arch]
    raise ValueError(
        f"unsupported model architecture {architectures}; supported: {', '.join(sorted(known))}"
    )


def get_model_class(architectures: list[str] | None) -> type:
    name = model_class_name(architectures)
    return getattr(importlib.import_module(f"srt_lite.models.{_MODULES[name]}"), name)
