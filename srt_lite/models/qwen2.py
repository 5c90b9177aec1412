"""Qwen2: the Llama architecture with a bias on the q, k and v projections."""

from srt_lite.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


EntryClass = [Qwen2ForCausalLM]
