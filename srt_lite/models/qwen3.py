"""Qwen3 (dense): Llama layout, no qkv bias, RMSNorm on each q and k head before RoPE."""

from srt_lite.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


EntryClass = [Qwen3ForCausalLM]
