"""The tiny tool-calling model fixture: greedy decoding with transformers reproduces its
replies, and the hermes tool-call parser reads its call."""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from srt_lite.parser.tool_call_parser import ToolCallItem, ToolCallParser, detect_tool_call_format

from tiny_chat_model import greedy_text
from tool_call_model import (
    FINAL_REPLY,
    TOOL_CALL_REPLY,
    TOOL_RESULT,
    TOOLS,
    after_tool_messages,
    make_tool_call_model,
    question_messages,
)


def _greedy(model, tokenizer, messages: list[dict]) -> str:
    return greedy_text(model, tokenizer, messages, tools=TOOLS)


def test_tool_call_model_fixture(tmp_path_factory):
    path = make_tool_call_model(str(tmp_path_factory.mktemp("tool_call_model")))
    assert make_tool_call_model(path) == path  # second call is cached

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["eos_token_id"] == 2
    assert any(name.endswith(".safetensors") for name in os.listdir(path))

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert detect_tool_call_format(tokenizer.chat_template) == "hermes"

    # The template renders the tools, the call and the tool's answer the way Qwen2.5 does.
    prompt = tokenizer.apply_chat_template(question_messages(), tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    followup = tokenizer.apply_chat_template(
        after_tool_messages(), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert followup == (
        prompt + TOOL_CALL_REPLY + "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + TOOL_RESULT
        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Arguments as an object (HF style) and content "" render the same as the OpenAI form.
    hf_style = after_tool_messages()
    hf_style[1]["content"] = ""
    hf_style[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert tokenizer.apply_chat_template(hf_style, tools=TOOLS, add_generation_prompt=True, tokenize=False) == followup

    reply = _greedy(model, tokenizer, question_messages())
    assert reply == TOOL_CALL_REPLY + "<|im_end|>"
    assert ToolCallParser("hermes").parse_non_stream(reply.removesuffix("<|im_end|>")) == (
        "", [ToolCallItem("get_weather", '{"city": "Paris"}')]
    )
    assert _greedy(model, tokenizer, after_tool_messages()) == FINAL_REPLY + "<|im_end|>"
