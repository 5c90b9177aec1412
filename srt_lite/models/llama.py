"""Llama family (Llama 2/3, SmolLM2, ...), written with TP-sharded layers.

The decoder layer takes two switches that the Qwen families reuse: `qkv_bias` (Qwen2) and
`qk_norm` (Qwen3: RMSNorm over each head of q and k before RoPE).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from srt_lite.layers.activation import SiluAndMul
from srt_lite.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from srt_lite.layers.layernorm import RMSNorm
from srt_lite.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt_lite.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt_lite.layers.radix_attention import RadixAttention
from srt_lite.layers.rotary_embedding import RotaryEmbedding
from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.models.cpp_decoder import CppDecoderStack
from srt_lite.model_loader.weight_utils import InMemory, TensorSource

logger = logging.getLogger(__name__)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
    ):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, config.num_key_value_heads, qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden, getattr(config, "attention_bias", False)
        )
        self.rotary_emb = rotary_emb
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        T, D, Hq = qkv.shape[0], self.head_dim, self.num_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(T, -1, D)  # [T, Hq + Hkv, D], a view
        v = qkv[:, self.q_size + self.kv_size :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :Hq]), self.k_norm(qk[:, Hq:])], dim=1)
        # Query and key heads rotate in one pass; q and k stay views of the result.
        qk = self.rotary_emb(positions, qk)
        q, k = qk[:, :Hq].reshape(T, -1), qk[:, Hq:].reshape(T, -1)
        return self.o_proj(self.attn(q, k, v, fb))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, max_position: int, qkv_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One RoPE table shared by every layer.
        rotary_emb = RotaryEmbedding(config, head_dim, max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, qkv_bias, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The layers as one C++ call for decode steps on the CPU, once the weights are final
        # (ModelRunner.load_model calls use_cpp_stack).
        self.cpp_stack: CppDecoderStack | None = None

    def use_cpp_stack(self) -> bool:
        self.cpp_stack = CppDecoderStack.build(self)
        return self.cpp_stack is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cpp_stack is not None and self.cpp_stack.runs(hidden, fb):
            return self.cpp_stack(hidden, positions, fb)  # the final norm's output
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    # HF checkpoint name -> (our parameter name, shard id) for fused projections.
    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config, max_position: int):
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, max_position, qkv_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            self.model.embed_tokens.lookup_only = True
        self.logits_processor = LogitsProcessor()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> LogitsProcessorOutput:
        hidden = self.model(input_ids, positions, fb)[: fb.num_tokens]  # without padding rows
        return self.logits_processor(hidden, self.lm_head, fb)

    def _route(self, name: str) -> tuple[str, str | int | None]:
        """A checkpoint name -> (our parameter's name, its shard id in a fused projection)."""
        for fused, part, sid in self.stacked_params:
            if f".{part}." in name:
                return name.replace(part, fused), sid
        return name, None

    def load_int4_weights(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
        """Gives linears a 4-bit copy (PackableLinear.use_int4) from checkpoint-named
        (codes [N, K], scale [N, K/32], zero [N, K/32]), sliced for this rank by the
        linears' own weight loaders. A fused projection gets one only when all its parts
        are 4-bit, and a row-parallel slice only when it holds whole groups of 32.
        Returns how many linears got one."""
        modules = dict(self.named_modules())
        parts = {fused: sum(f == fused for f, _, _ in self.stacked_params) for fused, _, _ in self.stacked_params}
        staged: dict[str, list] = {}  # module name -> [codes, scale, zero, parts filled]
        for name, (codes, scale, zero) in tensors.items():
            pname, shard_id = self._route(name)
            mod = modules.get(pname.removesuffix(".weight"))
            if mod is None or not hasattr(mod, "use_int4"):
                continue
            n, k = mod.weight_shape
            if k % 32:
                continue
            if pname not in staged:
                staged[pname] = [
                    torch.empty(n, k, dtype=torch.uint8),  # [N, K] this rank's codes
                    torch.empty(n, k // 32),  # [N, K/32] float32
                    torch.empty(n, k // 32),
                    0,
                ]
            entry = staged[pname]
            for buf, src in zip(entry[:3], (codes, scale, zero)):
                mod.weight_loader(buf, InMemory(src), shard_id)
            entry[3] += 1
        done = 0
        for pname, (codes, scale, zero, filled) in staged.items():
            fused = pname.split(".")[-2]
            if filled == parts.get(fused, 1):
                modules[pname.removesuffix(".weight")].use_int4(codes, scale, zero)
                done += 1
        return done

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, src in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if not name.startswith(("model.", "lm_head.")):
                # A base model's checkpoint (an embedding model such as Qwen3-Embedding saved
                # from Qwen3Model) names its tensors without the "model." prefix.
                name = "model." + name
            name, shard_id = self._route(name)
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[name]
            param.weight_loader(param, src, shard_id)
            loaded.add(name)
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        for module in self.modules():
            if hasattr(module, "finish_gguf"):
                module.finish_gguf()
        missing = set(params) - loaded
        if missing == {"lm_head.weight"}:
            # A base model has no LM head: it serves embeddings; generation goes through the
            # input embeddings as a tied head would, which is what such a model can offer.
            logger.warning("The checkpoint has no lm_head: using the input embeddings as the output head")
            params["lm_head.weight"].data.copy_(params["model.embed_tokens.weight"].data)
            missing = set()
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")


EntryClass = [LlamaForCausalLM]
