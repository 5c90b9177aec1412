"""Serving a GGUF file as it is: its config and tokenizer from its metadata, its weights
from its mapped blocks.

`prepare(path)` writes a small folder into the cache, once per file: config.json (built here
from the file's metadata), generation_config.json (its end-of-generation tokens) and the
tokenizer files (the vocabulary, merges and chat template of the file, converted by
transformers' GGUF tokenizer converter); no weights. Tokenizers and configs load from that
folder as from any Hugging Face directory. `iter_weights` yields the weights under Hugging
Face names: float tensors as views of the file, quantized ones as `QuantSource`s that a
layer may keep in their blocks (layers/cpu_linear/gguf.py) or read dequantized.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Iterator

import torch

from srt_lite.model_loader.gguf_reader import GGUFError, GGUFFile
from srt_lite.model_loader.gguf_types import GGUFType, dense, dequantize
from srt_lite.model_loader.weight_utils import InMemory, TensorSource
from srt_lite.utils import cache_root, write_json_atomic

logger = logging.getLogger(__name__)

# general.architecture -> (model class, model_type). Llama files also cover Mistral-style
# and SmolLM models (llama.cpp writes them as llama).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp stores these architectures' q and k rows permuted for its interleaved RoPE.
_PERMUTED_QK = ("llama",)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Metadata of the file, not weights: llama3-style RoPE frequency factors go into the config.
_CONFIG_TENSORS = ("rope_freqs.weight",)
META_RECORD = "srt_lite_gguf.json"  # written last into a prepared folder
PREPARED_VERSION = 2  # of what prepare() writes: a change makes new folders


class QuantSource:
    """A quantized tensor of the file, not yet read: `raw` uint8 [rows, row_bytes] blocks of
    `type` (a view of the mapped file). Indexing it reads the values dequantized (float32),
    so a layer that does not keep blocks loads it as any other tensor; `narrow_rows` and
    `narrow_cols` give the blocks of a slice, for layers that keep them."""

    def __init__(self, raw: torch.Tensor, type: GGUFType, cols: int, keep: bool = True):
        self.raw, self.type, self.cols = raw, type, cols
        self.keep = keep  # whether layers may keep the blocks (else they read it dequantized)

    def get_shape(self) -> list[int]:
        return [self.raw.shape[0], self.cols]

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        return dequantize(self.raw[rows], self.type, self.cols)[(slice(None), *index[1:])]

    def narrow_rows(self, start: int, length: int) -> "QuantSource":
        return QuantSource(self.raw[start : start + length], self.type, self.cols, self.keep)

    def narrow_cols(self, start: int, length: int) -> "QuantSource | None":
        """The blocks of columns [start, start + length), or None where the slice cuts a block."""
        unit = self.type.unit
        if start % unit or length % unit:
            return None
        b0, b1 = self.type.row_bytes(start), self.type.row_bytes(start + length)
        return QuantSource(self.raw[:, b0:b1], self.type, length, self.keep)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".")  # blk.<i>.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def architecture(f: GGUFFile) -> str:
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def build_config(f: GGUFFile) -> dict:
    """A Hugging Face config.json for the file, from its metadata alone."""
    arch = architecture(f)

    def field(key: str, default=None):
        value = f.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{f.path}: metadata {arch}.{key} is missing")
        return value

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    vocab = f.tensors["token_embd.weight"].rows if "token_embd.weight" in f.tensors else len(f.get("tokenizer.ggml.tokens", []))
    cls, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(field("context_length", 2048)),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        # Llama's flag covers all four projections; Qwen2's q/k/v biases are its model class's.
        "attention_bias": arch == "llama" and "blk.0.attn_output.bias" in f.tensors,
        "torch_dtype": "bfloat16",
    }
    for key, tok in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if f.get(tok) is not None:
            config[key] = int(f.get(tok))
    scaling = f.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(field("rope.scaling.factor"))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(field("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise GGUFError(f"{f.path}: RoPE scaling {scaling!r} is not supported (linear, yarn)")
    if "rope_freqs.weight" in f.tensors:  # llama3-style: each frequency divided by its factor
        t = f.tensors["rope_freqs.weight"]
        config["rope_freq_factors"] = dense(f.raw(t.name), t.type, t.cols).float().flatten().tolist()
    return config


def end_token_ids(f: GGUFFile) -> list[int]:
    """The tokens llama.cpp ends generation on: end of sequence, of turn, of message."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = f.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def prepared_dir(f: GGUFFile) -> str:
    """The cache folder of a file's config and tokenizer, keyed by its header (metadata and
    tensor list), which is all they depend on: a copy or a move of the file finds it again."""
    import hashlib

    stem = os.path.basename(f.path).removesuffix(".gguf")
    digest = hashlib.sha256(f"{PREPARED_VERSION}:".encode() + f.header_bytes()).hexdigest()[:16]
    return os.path.join(cache_root(), "gguf", f"{stem}-{digest}")


def prepare(gguf_path: str) -> str:
    """The folder of config and tokenizer files for `gguf_path` (made once, atomically)."""
    f = GGUFFile(gguf_path)
    out_dir = prepared_dir(f)
    if os.path.isfile(os.path.join(out_dir, META_RECORD)):
        _record(out_dir, gguf_path)
        return out_dir
    config = build_config(f)
    logger.info("Reading the tokenizer and config of %s (once) into %s", gguf_path, out_dir)
    from transformers import AutoTokenizer

    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare-", dir=os.path.dirname(out_dir))
    try:
        folder, fname = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        except Exception as e:  # noqa: BLE001 - the converter's errors name no file
            raise GGUFError(f"{gguf_path}: cannot build its tokenizer from the metadata ({e})") from e
        template = f.get("tokenizer.chat_template")
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as out:
            json.dump(config, out, indent=1)
        with open(os.path.join(tmp, "generation_config.json"), "w") as out:
            json.dump({"eos_token_id": end_token_ids(f), "bos_token_id": config.get("bos_token_id")}, out)
        _record(tmp, gguf_path)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, META_RECORD)):  # else another process won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _record(folder: str, gguf_path: str) -> None:
    """Marks `folder` complete, noting the file it was last prepared for."""
    write_json_atomic(os.path.join(folder, META_RECORD), {"gguf_file": os.path.abspath(gguf_path)})


def _unpermute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (each head's rows interleaved in pairs)."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def count_weights(f: GGUFFile) -> int:
    return sum(1 for name in f.tensors if name not in _CONFIG_TENSORS)


def iter_weights(f: GGUFFile, keep: bool = True) -> Iterator[tuple[str, TensorSource | QuantSource]]:
    """(Hugging Face name, source) for every weight of the file; a tensor with no place in
    the supported architectures is an error that names it. keep: layers may keep quantized
    tensors in their blocks."""
    arch = architecture(f)
    heads = int(f.get(f"{arch}.attention.head_count"))
    kv_heads = int(f.get(f"{arch}.attention.head_count_kv", heads))
    for name, t in f.tensors.items():
        if name in _CONFIG_TENSORS:
            continue
        hf = _hf_name(name)
        if hf is None:
            raise GGUFError(f"{f.path}: tensor {name} has no place in a {arch} model")
        value = f.raw(name) if t.type.quantized else dense(f.raw(name), t.type, t.cols).view(t.shape)
        if arch in _PERMUTED_QK and (".q_proj." in hf or ".k_proj." in hf):
            value = _unpermute_rows(value, heads if ".q_proj." in hf else kv_heads)
        yield hf, QuantSource(value, t.type, t.cols, keep) if t.type.quantized else InMemory(value)
