"""A Llama-family model's decoder layers and final norm as one C++ call
(srt_lite_cpu::decoder_layers, csrc/cpu_decoder.cpp) for the CPU steps whose attention is the
C++ token cascade: every decode step, and verify steps over a shared prefix; with
batch-invariant inference every step, whose attention is then the C++ prompt op.

Eager, each layer costs a dozen Python calls around the C++ ops that do its work; at a few
rows a step that Python is a large share of the step. The C++ loop calls the same ops in the
same order, so its output equals the Python layers' bit for bit. Other steps (prompts,
mixed batches) and models the loop does not cover (tensor parallelism, q/k norms, partial
RoPE, oneDNN-packed weights) keep the Python layers. GGUF weights kept in their blocks take
part through a key (GGUFWeight.cpp_key) to the same product as their Python forward.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from srt_lite import envs
from srt_lite.distributed import get_tp_size
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.packable import cpp_row_bounds
from srt_lite.layers.layernorm import RMSNorm

if TYPE_CHECKING:
    from srt_lite.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class CppDecoderStack:
    """The registered C++ copy of a model's layer list and final norm (its tensors, not copies
    of them)."""

    def __init__(self, key: int, layers: nn.ModuleList):
        self.key = key
        attn = layers[0].self_attn
        self.scale = attn.attn.scaling
        self.dtype = layers[0].input_layernorm.weight.dtype

    @classmethod
    def build(cls, model: nn.Module) -> "CppDecoderStack | None":
        """The stack for `model` (a LlamaModel on the CPU), or None where the C++ loop does not
        cover it; released when the model is."""
        if envs.DISABLE_CPP_DECODER.is_set() or not cpu_kernels.load() or get_tp_size() != 1:
            return None
        bounds = cpp_row_bounds()
        class_rows = (bounds[0], bounds[1], bounds[1] + 1)  # one row count per class: where each choice is read
        tensors: list[torch.Tensor | None] = []
        kinds: list[int] = []
        for layer in model.layers:
            if not _covered(layer, model.layers[0]):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for lin, bias_after in ((attn.qkv_proj, 0), (attn.o_proj, 1), (mlp.gate_up_proj, 0), (mlp.down_proj, 1)):
                choices = [lin.cpp_choice(rows) for rows in class_rows]
                if None in choices:
                    return None
                tensors.append(lin.bias)
                kinds.append(bias_after)  # row-parallel: the bias is added after the product
                for kind, a, b, n in choices:
                    tensors += [a, b]
                    kinds += [kind, n]
        attn = model.layers[0].self_attn
        norm, rope = model.norm, attn.rotary_emb
        # The final norm as RMSNorm.forward computes it for the stack's hidden states (its
        # C++ op: the weight in their dtype), and RoPE rows from the rotary module's tables.
        if type(norm) is not RMSNorm or norm.weight.dtype != model.layers[0].input_layernorm.weight.dtype:
            return None
        key = torch.ops.srt_lite_cpu.register_decoder_stack(
            tensors, kinds, list(bounds), attn.num_heads, attn.num_kv_heads, attn.head_dim,
            model.layers[0].input_layernorm.eps, norm.weight, norm.eps, rope.cos_cache, rope.sin_cache,
        )
        weakref.finalize(model, torch.ops.srt_lite_cpu.release_decoder_stack, key)
        logger.info("Decoder layers of decode steps: one C++ call a step")
        return cls(key, model.layers)

    def runs(self, hidden: torch.Tensor, fb: "ForwardBatch") -> bool:
        """Whether this step goes through the stack: its attention backend gives the step in
        the stack's form (a C++ cascade, or the C++ prompt op for the whole step), its token
        axis is not padded, the C++ norms take its hidden states (as RMSNorm.forward asks),
        and no graph is being traced."""
        return (
            fb.attn_backend.decoder_stack_args(fb) is not None
            and hidden.shape[0] == fb.num_tokens
            and hidden.dtype == self.dtype
            and hidden.is_contiguous()
            and not torch.compiler.is_compiling()
        )

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        """hidden [T, hidden] (the embedding) -> the final norm's output [T, hidden]."""
        pool = fb.token_to_kv_pool
        a = fb.attn_backend.decoder_stack_args(fb)
        prefix_index = a.slots[:0] if a.prefix_index is None else a.prefix_index
        return torch.ops.srt_lite_cpu.decoder_layers(
            self.key, hidden, positions, fb.out_cache_loc, a.slots, a.q_offsets, a.k_offsets, a.prefix_start,
            a.prefix_len, prefix_index, self.scale, pool.k_buffer, pool.v_buffer,
        )


def _covered(layer: nn.Module, first: nn.Module) -> bool:
    """Whether the C++ loop computes `layer` as LlamaDecoderLayer.forward does, with the
    head shape, attention scale and norm settings of the `first` layer, which it uses for all."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or getattr(attn, "q_norm", None) is not None:
        return False
    ref = first.self_attn
    if attn.rotary_emb is not ref.rotary_emb or attn.rotary_emb.rotary_dim != attn.head_dim:
        return False
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scaling) != (
        ref.num_heads, ref.num_kv_heads, ref.head_dim, ref.attn.scaling
    ):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    ref_norm = first.input_layernorm
    return all(n.weight.dtype == ref_norm.weight.dtype and n.eps == ref_norm.eps for n in norms)
