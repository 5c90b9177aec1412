"""Maps a config's `architectures` entry to our model class."""

from __future__ import annotations

import importlib

_MODULES = ["llama", "qwen2", "qwen3"]


def _all_models() -> dict[str, type]:
    out = {}
    for mod in _MODULES:
        for cls in importlib.import_module(f"srt_lite.models.{mod}").EntryClass:
            out[cls.__name__] = cls
    return out


def supported_architectures() -> list[str]:
    return sorted(_all_models())


def get_model_class(architectures: list[str] | None) -> type:
    models = _all_models()
    for arch in architectures or []:
        if arch in models:
            return models[arch]
    raise ValueError(
        f"unsupported model architecture {architectures}; supported: {', '.join(sorted(models))}"
    )
