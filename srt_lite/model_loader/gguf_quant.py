"""The 4-bit weights of a GGUF file, read as they are stored (not dequantized).

A GGUF's Q4_0 and Q4_1 tensors hold blocks of 32 weights along each row: a float16 scale
`d`, for Q4_1 a float16 minimum `m`, and 16 bytes of 4-bit codes `q` (byte j: element j in
its low nibble, element j + 16 in its high one). The weight is `d * q + m` (Q4_1) or
`d * (q - 8)` (Q4_0). `read_q4_tensors` returns, under the Hugging Face parameter names
that the checkpoint converted from the same file uses:
    codes  uint8 [N, K]      one code (0..15) per weight, unpacked so that TP can slice it
    scale  float32 [N, K/32]
    zero   float32 [N, K/32] the weight at code 8: w = (q - 8) * scale + zero
which is the form of torch's CPU int4 matmul (layers/linear.py, Int4Weight).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from srt_lite.utils import write_json_atomic

logger = logging.getLogger(__name__)

# Written next to a converted checkpoint: the GGUF file it came from.
SOURCE_FILE = "srt_lite_gguf_source.json"
CACHE_FILE = "srt_lite_q4.st"  # load_q4_tensors' cache (safetensors; not *.safetensors, which are the checkpoint)
GROUP = 32  # weights per GGUF block
# GGUF name -> Hugging Face name, for the linears of a decoder layer (llama.cpp's names).
_LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose GGUF layout is known here; llama.cpp stores llama's q and k rows
# permuted for its RoPE, which the reading undoes as transformers' conversion does.
SUPPORTED_ARCHS = ("llama",)


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


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")  # blk.<i>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_LINEARS:
        return f"model.layers.{parts[1]}.{_LAYER_LINEARS[parts[2]]}.weight"
    return None


def _unpermute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (rows of each head interleaved in pairs)."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _decode_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """raw uint8 [rows, cols / 32 * block bytes] -> codes [rows, cols], scale, zero [rows, cols / 32]."""
    groups = cols // GROUP
    head = 4 if kind == "Q4_1" else 2  # bytes of float16 fields before the 16 code bytes
    blocks = torch.from_numpy(np.array(raw))  # a writable copy of the mapped file's bytes
    blocks = blocks.view(rows, groups, head + 16)
    halves = blocks[..., :head].contiguous().view(torch.float16).float()  # [rows, groups, 1 or 2]
    d = halves[..., 0]
    packed = blocks[..., head:]  # [rows, groups, 16]
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).reshape(rows, cols)  # [rows, cols]
    zero = halves[..., 1] + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    return codes.contiguous(), d.contiguous(), zero.contiguous()


def load_q4_tensors(model_dir: str, gguf_path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """read_q4_tensors, through a cache beside the converted checkpoint: gguf's reader parses
    every metadata field in Python (the tokenizer's vocabulary too), seconds per start, where
    the cache is a memory-mapped safetensors file. Codes are stored two to a byte."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(model_dir, CACHE_FILE)
    if os.path.isfile(path):
        out = {}
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.endswith(".codes"):
                    name = key.removesuffix(".codes")
                    pairs = f.get_tensor(key)  # [N, K / 2]: element 2j low, 2j + 1 high
                    codes = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).view(pairs.shape[0], -1)
                    out[name] = (codes, f.get_tensor(f"{name}.scale"), f.get_tensor(f"{name}.zero"))
        return out
    out = read_q4_tensors(gguf_path)
    flat = {}
    for name, (codes, scale, zero) in out.items():
        flat[f"{name}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        flat[f"{name}.scale"], flat[f"{name}.zero"] = scale, zero
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        save_file(flat, tmp)
        os.replace(tmp, path)  # concurrent ranks write the same file; the last rename wins
    except OSError as e:  # a read-only cache still serves, just slower to start
        logger.warning("Could not cache the GGUF's 4-bit weights (%s)", e)
    return out


def read_q4_tensors(gguf_path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF weight name -> (codes, scale, zero) for every Q4_0/Q4_1 linear of a decoder layer.
    Empty for an architecture this module does not know (those load dequantized)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in SUPPORTED_ARCHS:
        logger.info("GGUF architecture %s: its 4-bit weights load dequantized", arch)
        return {}

    def field(name: str) -> int:
        return int(reader.fields[f"{arch}.{name}"].parts[-1][0])

    n_head = field("attention.head_count")
    n_kv = field("attention.head_count_kv")
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        kind = t.tensor_type.name
        if name is None or kind not in ("Q4_0", "Q4_1"):
            continue
        cols, rows = (int(n) for n in t.shape)  # GGUF lists the innermost dimension first
        if cols % GROUP:
            continue
        tensors = _decode_blocks(t.data, kind, rows, cols)
        if ".q_proj." in name or ".k_proj." in name:
            heads = n_head if ".q_proj." in name else n_kv
            tensors = tuple(_unpermute_rows(x, heads) for x in tensors)
        out[name] = tensors
    return out


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [N, K], scale/zero [N, K/32] -> float32 weights [N, K] (for tests and checks)."""
    n, k = codes.shape
    q = codes.float().view(n, k // GROUP, GROUP) - 8
    return (q * scale[..., None] + zero[..., None]).view(n, k)
