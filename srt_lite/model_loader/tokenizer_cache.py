"""The tokenizer of the scheduler and detokenizer processes, with `tokenizers` alone.

Those processes only decode ids and encode a tag or two; importing transformers for that costs
seconds of CPU in each of them at every start. transformers' tokenizer classes may rebuild
parts of the `tokenizers` pipeline that tokenizer.json describes (Qwen2's pre-tokenizer and
normalizer, say), so the file on disk is not always what transformers runs. A process that
loads a tokenizer through transformers therefore saves the pipeline it built, keyed by the
tokenizer files and transformers' version; later starts load that pipeline directly and decode
exactly as transformers' fast tokenizer does (its decode is the pipeline's, plus a clean-up
that transformers skips for BPE models; other models are not cached).

The HTTP process needs transformers' whole tokenizer API (chat templates, special tokens), but
the class-picking path (AutoTokenizer) imports torch and the model configs: seconds of every
start, on the critical path. Most tokenizer classes of the supported models only build a
pipeline and set attributes in `__init__`, so transformers' plain fast tokenizer over the
cached pipeline, with those attributes copied, is the same tokenizer. That is checked once,
when the cache is written, and recorded beside the pipeline; a class that differs in anything
else keeps the slow path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from typing import Any, Sequence

from srt_lite.utils import cache_root

logger = logging.getLogger(__name__)

# Everything transformers reads to build a fast tokenizer from a directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# Part of the key: entries written before the plain-tokenizer record existed are not read.
CACHE_FORMAT = 2
# Attributes of transformers' tokenizer that need not match the class's for the plain fast
# tokenizer to behave the same: the pipeline (compared as text), the constructor's arguments
# (kept for save_pretrained) and the vocabulary and merges some classes build the pipeline from.
UNCOMPARED = {"_tokenizer", "init_kwargs", "_vocab", "_merges"}
# Methods that may differ between classes without changing what a tokenizer does.
NEUTRAL_METHODS = {"__init__", "__repr__"}
# Attribute values the record can hold; anything else has to be equal already.
PLAIN_VALUES = (type(None), bool, int, float, str)


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
    digest = hashlib.sha256(f"{CACHE_FORMAT}\0{version}".encode())
    for name in TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        digest.update(f"\0{name}\0".encode())
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return os.path.join(cache_root(), "tokenizers", digest.hexdigest()[:24] + ".json")


def plain_record_path(path: str) -> str:
    """Where the cache entry `path` records whether the plain fast tokenizer may stand in."""
    return path.removesuffix(".json") + ".plain.json"


def save(tokenizer: Any, model_dir: str) -> None:
    """Caches the pipeline of `tokenizer` (loaded by transformers from `model_dir`) unless it is
    cached already or may decode differently from its pipeline alone, with a record of whether
    transformers' plain fast tokenizer over that pipeline is `tokenizer`."""
    path = cache_path(model_dir)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if path is None or backend is None or os.path.isfile(path):
        return
    if type(backend.model).__name__ != "BPE" or has_own_methods(tokenizer):
        # transformers may clean up the decoded text of other models, and a class of its own
        # may encode or decode in ways the pipeline alone does not.
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        backend.save(tmp)
        with open(tmp + ".plain", "w") as f:
            json.dump({"overrides": plain_overrides(tokenizer, model_dir, tmp)}, f)
        os.replace(tmp + ".plain", plain_record_path(path))
        os.replace(tmp, path)  # last: a pipeline file means its record is written
    except OSError as e:  # a read-only cache only costs later starts the slow path
        logger.warning("could not cache the tokenizer of %s: %s", model_dir, e)


def load_plain(model_dir: str, pipeline: str, overrides: dict[str, Any]) -> Any:
    """transformers' plain fast tokenizer of `model_dir` over the pipeline file `pipeline`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, tokenizer_object=Tokenizer.from_file(pipeline))
    for name, value in overrides.items():
        setattr(tokenizer, name, value)
    return tokenizer


def has_own_methods(tokenizer: Any) -> bool:
    """Whether the class of `tokenizer` does more than transformers' plain fast tokenizer
    (methods of its own beyond its constructor), or is not one at all."""
    from transformers import PreTrainedTokenizerFast

    for cls in type(tokenizer).__mro__:
        if cls is PreTrainedTokenizerFast:
            return False
        if any(callable(v) or isinstance(v, (property, classmethod, staticmethod))
               for k, v in vars(cls).items() if k not in NEUTRAL_METHODS and not isinstance(v, type)):
            return True
    return True


def plain_overrides(tokenizer: Any, model_dir: str, pipeline: str) -> dict[str, Any] | None:
    """The attributes to set on the plain fast tokenizer over `pipeline` to make it `tokenizer`,
    or None when no setting of attributes does (one differs in a value the record cannot hold)."""
    try:
        plain = load_plain(model_dir, pipeline, {})
    except Exception as e:  # noqa: BLE001 - any failure only keeps the slow path
        logger.debug("the plain fast tokenizer of %s failed to load: %s", model_dir, e)
        return None
    theirs, ours = vars(tokenizer), vars(plain)
    overrides = {}
    for name in (set(theirs) | set(ours)) - UNCOMPARED:
        value = theirs.get(name)
        if name in theirs and name in ours and repr(value) == repr(ours[name]):
            continue
        if name not in theirs or not isinstance(value, PLAIN_VALUES):
            return None
        overrides[name] = value
    plain = load_plain(model_dir, pipeline, overrides)
    if plain.backend_tokenizer.to_str() != tokenizer.backend_tokenizer.to_str():
        return None
    return overrides


def load(model_dir: str) -> Any:
    """`model_dir`'s tokenizer for decoding: the cached pipeline when there is one, else
    transformers' (whose pipeline is then cached for the next start)."""
    path = cache_path(model_dir)
    if path is not None and os.path.isfile(path):
        from tokenizers import Tokenizer

        return CachedTokenizer(Tokenizer.from_file(path))
    return load_transformers(model_dir)


def load_transformers(model_dir: str) -> Any:
    """transformers' tokenizer of `model_dir`: the plain fast tokenizer over the cached pipeline
    where the cache recorded that it is the same, else AutoTokenizer's (whose pipeline is then
    cached for the other processes and later starts)."""
    path = cache_path(model_dir)
    if path is not None and os.path.isfile(path):
        with open(plain_record_path(path)) as f:
            overrides = json.load(f)["overrides"]
        if overrides is not None:
            return load_plain(model_dir, path, overrides)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    save(tokenizer, model_dir)
    return tokenizer
