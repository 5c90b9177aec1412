"""Attention with torch's scaled_dot_product_attention, for any device (the CPU path).

Once per step `init_forward_metadata` splits the ragged batch into groups and picks a plan
for each (the cost rule: layers/attention/torch_native/choose.py), builds the plans' indices and masks
(build.py) and stores the step's plan in `ForwardBatch.attn_metadata`; every layer then runs
it (steps.py, plans.py, cascade.py). On the CPU a step that is one token cascade runs in the
C++ op (csrc/cpu_attention.cpp) when it is built.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from srt_lite import cpu_caps
from srt_lite.layers import batch_invariant
from srt_lite import cpu_kernels
from srt_lite.layers.attention.base import AttentionBackend, AttentionConfig, DecoderStackArgs
from srt_lite.layers.attention.torch_native.build import RowSlots, build_step
from srt_lite.layers.attention.torch_native.choose import choose_plan, cpp_cascade_ok, prompt_rows_in_flash
from srt_lite.layers.attention.torch_native.steps import StepPlan

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.model_executor.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    # Each layer's result is written straight into its padded output: slicing the padding
    # off and padding the result again cost two more copies per layer.
    takes_padded_rows = True

    def __init__(self, config: AttentionConfig, use_cpu_kernels: bool = True):
        device = self.device = config.device
        self.num_heads = config.num_heads  # query heads of a layer on this rank
        # The C++ token-cascade op: one call a layer instead of the Python plan's dozens of
        # op calls, with each row's suffix attended exactly instead of one masked sequence.
        self.cpu_kernels = use_cpu_kernels and device == "cpu" and cpu_kernels.load()
        # AMX: torch's flash kernel then runs bf16 prompts faster than the C++ prompt op.
        self.amx = device == "cpu" and cpu_caps.get().amx_bf16

    @property
    def has_cpp_graph_op(self) -> bool:
        return self.cpu_kernels

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        pool = fb.token_to_kv_pool
        _, num_kv_heads, head_dim = pool.k_buffer[0].shape
        slots = RowSlots(fb)
        choices = choose_plan(
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, slots.shared_prefix,
            cpp=cpp_cascade_ok(self.cpu_kernels, pool.dtype, head_dim),
            flash_rows=prompt_rows_in_flash(pool.dtype, self.amx), invariant=batch_invariant.enabled(),
        )
        fb.attn_metadata = build_step(fb, choices, slots, self.num_heads // num_kv_heads)

    def compiled_step(self, fb: "ForwardBatch", layers: dict) -> contextlib.AbstractContextManager:
        step: StepPlan = fb.attn_metadata
        return step.compiled_step(fb, layers)

    def decoder_stack_args(self, fb: "ForwardBatch") -> DecoderStackArgs | None:
        step: StepPlan = fb.attn_metadata
        return step.decoder_stack_args()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        fb: "ForwardBatch",
    ) -> torch.Tensor:
        T, rows = fb.num_tokens, q.shape[0]
        out = q.new_empty(rows, layer.num_heads * layer.head_dim)  # [rows, H * D]
        if rows != T:
            out[T:].zero_()  # rows past T pad the token axis to a row bucket: no KV, zero output
        step: StepPlan = fb.attn_metadata
        step.run(q, k, v, layer, fb, out)
        return out
