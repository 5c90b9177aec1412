"""The tokenizer of the scheduler and detokenizer processes, with `tokenizers` alone.

Those processes only decode ids and encode a tag or two; importing transformers for that costs
seconds of CPU in each of them at every start. transformers' tokenizer classes may rebuild
parts of the `tokenizers` pipeline that tokenizer.json describes (Qwen2's pre-tokenizer and
normalizer, say), so the file on disk is not always what transformers runs. A process that
loads a tokenizer through transformers therefore saves the pipeline it built, keyed by the
tokenizer files and transformers' version; later starts load that pipeline directly and decode
exactly as transformers' fast tokenizer does (its decode is the pipeline's, plus a clean-up
that transformers skips for BPE models; other models are not cached).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from typing import Any, Sequence

from srt_lite.utils import cache_root

logger = logging.getLogger(__name__)

# Everything transformers reads to build a fast tokenizer from a directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


class CachedTokenizer:
    """decode / encode as transformers' fast tokenizer does them, over the saved pipeline."""

    def __init__(self, backend: Any):
        self.backend = backend  # tokenizers.Tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_options: Any) -> str:
        # transformers' other decode options (spaces between special tokens, clean-up of
        # tokenization spaces) do nothing for the BPE tokenizers that are cached.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids


def cache_path(model_dir: str) -> str | None:
    """Where `model_dir`'s tokenizer pipeline is cached; None without a tokenizer.json."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    digest = hashlib.sha256(version.encode())
    for name in TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        digest.update(f"\0{name}\0".encode())
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return os.path.join(cache_root(), "tokenizers", digest.hexdigest()[:24] + ".json")


def save(tokenizer: Any, model_dir: str) -> None:
    """Caches the pipeline of `tokenizer` (loaded by transformers from `model_dir`) unless it is
    cached already or decodes differently from its pipeline alone."""
    path = cache_path(model_dir)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if path is None or backend is None or os.path.isfile(path):
        return
    if type(backend.model).__name__ != "BPE":
        return  # transformers may clean up the decoded text of other models
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        backend.save(tmp)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache only costs later starts the slow path
        logger.warning("could not cache the tokenizer of %s: %s", model_dir, e)


def load(model_dir: str) -> Any:
    """`model_dir`'s tokenizer for decoding: the cached pipeline when there is one, else
    transformers' (whose pipeline is then cached for the next start)."""
    path = cache_path(model_dir)
    if path is not None and os.path.isfile(path):
        from tokenizers import Tokenizer

        return CachedTokenizer(Tokenizer.from_file(path))
    return load_transformers(model_dir)


def load_transformers(model_dir: str) -> Any:
    """transformers' tokenizer of `model_dir` (its pipeline cached for the other processes)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    save(tokenizer, model_dir)
    return tokenizer
