"""Fill-in-the-middle on /v1/completions: a tiny model whose tokenizer carries Qwen2.5-Coder's
FIM tokens (detected), and a prefix-middle-suffix template given by a JSON
--completion-template. The default model, which has none, answers 400 (test_openai_api)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from openai_helpers import MODEL, client_for
from server_utils import ServerProcess
from srt_lite.entrypoints.openai.fim import BUILTIN, load_template, resolve_template
from srt_lite.model_loader.default_model import resolve_model_path

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    """A tiny random Llama over SmolLM2's tokenizer with the three FIM tokens added."""
    path = tmp_path_factory.mktemp("tiny_fim")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tokenizer.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def test_templates_render_and_load(tmp_path):
    assert BUILTIN["qwen_coder"].render("P", "S") == "<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>"
    assert BUILTIN["deepseek_coder"].render("P", "S") == "<｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>"
    spec = tmp_path / "t.json"
    spec.write_text(json.dumps({"fim_begin_token": "<A>", "fim_middle_token": "<M>", "fim_end_token": "<E>", "fim_position": "MIDDLE"}))
    assert load_template(str(spec)).render("P", "S") == "<A>P<M>S<E>"
    with pytest.raises(ValueError, match="neither a built-in"):
        load_template("no_such_template")
    smol = AutoTokenizer.from_pretrained(resolve_model_path(None))
    assert resolve_template(smol, None) is None
    with pytest.raises(ValueError, match="does not have"):
        resolve_template(smol, "star_coder")


def test_suffix_builds_the_fim_prompt(fim_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(fim_model)
    fim_text = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    ids = tokenizer.encode(fim_text)
    assert [i for i in ids if i >= 49152] == tokenizer.convert_tokens_to_ids(FIM_TOKENS)  # one token each
    with ServerProcess("--model-path", fim_model, "--dtype", "float32", "--served-model-name", MODEL) as s:
        client = client_for(s)
        fim = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
        raw = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
        assert fim.usage.prompt_tokens == len(ids) and fim.choices[0].text == raw.choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0, stream=True))
        assert streamed == fim.choices[0].text
        for body, word in [({"prompt": [1, 2, 3], "suffix": "x"}, "token ids"), ({"prompt": "a", "suffix": "b", "echo": True}, "echo")]:
            r = httpx.post(s.base_url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
            assert r.status_code == 400 and word in r.json()["error"]["message"]
    # A JSON template (DeepSeek's order, Qwen's tokens): the prompt follows the file.
    spec = tmp_path / "fim.json"
    spec.write_text(json.dumps({"fim_begin_token": "<|fim_prefix|>", "fim_middle_token": "<|fim_middle|>",
                                "fim_end_token": "<|fim_suffix|>", "fim_position": "MIDDLE"}))
    with ServerProcess("--model-path", fim_model, "--dtype", "float32", "--served-model-name", MODEL,
                       "--completion-template", str(spec)) as s:
        r = client_for(s).completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=1, temperature=0)
        middle = tokenizer.encode(f"<|fim_prefix|>{PREFIX}<|fim_middle|>{SUFFIX}<|fim_suffix|>")
        assert r.usage.prompt_tokens == len(middle)
