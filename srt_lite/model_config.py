"""ModelConfig: what the runtime needs to know of a model, read from its HF config files."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from srt_lite.model_loader.default_model import ModelPathError, resolve_model_path
from srt_lite.model_loader.hf_config import HFConfig, read_config, read_generation_config

logger = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    path: str  # local HF directory
    hf_config: HFConfig
    context_len: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: list[int]
    generation_defaults: dict  # temperature / top_p / top_k ... from generation_config.json
    gguf_file: str | None = None  # a GGUF file served natively: its weights (path: its config and tokenizer)

    def approx_num_params(self) -> int:
        """Parameters of a Llama-shaped decoder from its config (embedding, attention, MLP,
        and an LM head unless tied), without loading the weights."""
        cfg, h = self.hf_config, self.hidden_size
        inter = getattr(cfg, "intermediate_size", 4 * h)
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim + self.num_heads * self.head_dim * h
        heads = 1 if getattr(cfg, "tie_word_embeddings", False) else 2
        return heads * self.vocab_size * h + self.num_layers * (attn + 3 * h * inter)

    def verify_tp(self, tp_size: int) -> None:
        """Refuses a tensor-parallel size the model cannot be split by, in one line."""
        inter = getattr(self.hf_config, "intermediate_size", tp_size)
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"{self.num_heads} attention heads")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads (neither divides the other)")
        if inter % tp_size:
            problems.append(f"intermediate size {inter}")
        if problems:
            raise ValueError(f"--tp-size {tp_size} does not divide the model's {', '.join(problems)}")

    @classmethod
    def load(cls, model_path: str | None, context_length: int | None = None) -> "ModelConfig":
        path = resolve_model_path(model_path)
        gguf_file = None
        if model_path is not None and os.path.isfile(os.path.expanduser(model_path)):
            gguf_file = os.path.abspath(os.path.expanduser(model_path))  # resolve accepts only .gguf files
        try:
            hf = read_config(path)
            generation = read_generation_config(path)
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad model dir
            raise ModelPathError(f"cannot read the model config in {path}: {e}") from e
        from srt_lite.models.registry import model_class_name

        try:
            model_class_name(getattr(hf, "architectures", None))
        except ValueError as e:
            raise ModelPathError(str(e)) from e
        max_pos = int(getattr(hf, "max_position_embeddings", 2048))
        if context_length is not None and context_length > max_pos:
            logger.warning(
                "--context-length %d exceeds the model's max_position_embeddings %d",
                context_length, max_pos,
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            path=path,
            hf_config=hf,
            context_len=context_length or max_pos,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            hidden_size=hf.hidden_size,
            vocab_size=hf.vocab_size,
            eos_token_ids=_eos_ids(hf, generation),
            generation_defaults=_generation_defaults(generation),
            gguf_file=gguf_file,
        )


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


def _eos_ids(hf: HFConfig, generation: dict) -> list[int]:
    ids = _as_list(getattr(hf, "eos_token_id", None))
    return ids + [i for i in _as_list(generation.get("eos_token_id")) if i not in ids]


def _generation_defaults(generation: dict) -> dict:
    """Sampling values the model's generation_config.json sets (SGLang and vLLM use them as
    the defaults for fields a request leaves unset)."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: generation[k] for k in keys if generation.get(k) is not None}
