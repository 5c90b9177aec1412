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

import logging
import os

import torch

from srt_lite.model_loader import gguf_model
from srt_lite.model_loader.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

CACHE_FILE = "srt_lite_q4.st"  # load_q4_tensors' cache (safetensors; not *.safetensors, which are the checkpoint)
GROUP = 32  # weights per GGUF block


def _decode_blocks(raw: torch.Tensor, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """raw uint8 [rows, cols / 32 * block bytes] -> codes [rows, cols], scale, zero [rows, cols / 32]."""
    groups = cols // GROUP
    head = 4 if kind == "Q4_1" else 2  # bytes of float16 fields before the 16 code bytes
    blocks = raw.clone().view(rows, groups, head + 16)  # a writable copy of the mapped file's bytes
    halves = blocks[..., :head].contiguous().view(torch.float16).float()  # [rows, groups, 1 or 2]
    d = halves[..., 0]
    packed = blocks[..., head:]  # [rows, groups, 16]
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).reshape(rows, cols)  # [rows, cols]
    zero = halves[..., 1] + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    return codes.contiguous(), d.contiguous(), zero.contiguous()


def load_q4_tensors(model_dir: str, gguf_path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """read_q4_tensors, through a cache beside the converted checkpoint: unpacking every block
    into codes, scales and zeros is work a start need not repeat, where the cache is a
    memory-mapped safetensors file. Codes are stored two to a byte."""
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
    """HF weight name -> (codes, scale, zero) for every Q4_0/Q4_1 linear of a decoder layer
    (q and k rows un-permuted by gguf_model.iter_weights). Empty for an architecture other
    than llama (those load dequantized)."""
    f = GGUFFile(gguf_path)
    if f.get("general.architecture") != "llama":
        logger.info("GGUF architecture %s: its 4-bit weights load dequantized", f.get("general.architecture"))
        return {}
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, src in gguf_model.iter_weights(f):
        if not isinstance(src, gguf_model.QuantSource) or src.type.name not in ("Q4_0", "Q4_1"):
            continue
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            out[name] = _decode_blocks(src.raw, src.type.name, src.raw.shape[0], src.cols)
    return out


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [N, K], scale/zero [N, K/32] -> float32 weights [N, K] (for tests and checks)."""
    n, k = codes.shape
    q = codes.float().view(n, k // GROUP, GROUP) - 8
    return (q * scale[..., None] + zero[..., None]).view(n, k)
