"""A tiny Qwen3-architecture model that calls a tool, for tests (a helper module, not a test file).

`make_tool_call_model(path)` writes into `path` a small Qwen3ForCausalLM (safetensors, float32)
with the default model's (SmolLM2) tokenizer and a chat template that supports tools the way
Qwen2.5's does (the `tools` list rendered into the system turn inside <tools></tools>, with
instructions to answer in <tool_call> JSON; assistant `tool_calls` rendered as <tool_call>
blocks; `tool` messages as <tool_response> inside a user turn). It is trained on CPU to
memorise two conversations, so that greedy decoding of the chat prompt rendered with
`tools=TOOLS` gives

* for QUESTION alone:                                            TOOL_CALL_REPLY + "<|im_end|>"
* for QUESTION, the assistant's call, and the tool's TOOL_RESULT: FINAL_REPLY + "<|im_end|>"

(the second conversation is `after_tool_messages()`). Prompts are tokenized as the server
does it: the rendered template text encoded with `add_special_tokens=False`. The build checks
with transformers' greedy `generate` that both replies come out token for token, and raises
otherwise (tiny_chat_model.py trains it).

The model is trained once per process; further calls only save it again (or nothing, if that
path already holds it).
"""

from __future__ import annotations

from tiny_chat_model import Example, TrainedOnce, load_tokenizer, reply_ids, train

QUESTION = "What is the weather in Paris?"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CALL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULT = '{"temperature": 18}'
FINAL_REPLY = "It is 18 degrees in Paris."

# Qwen2.5's tool-calling template, less its default system prompt. Arguments of an assistant's
# tool call may be a JSON string (as OpenAI clients send them) or an object (as HF chats do):
# both render the same.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SEED = 0
LR = 1e-2  # converged in 80-120 steps for seeds 0-3; 2e-2 took 80-180
MAX_STEPS = 1000
CHECK_EVERY = 10
MIN_MARGIN = 6.0  # see tiny_chat_model.train


def question_messages() -> list[dict]:
    """The first conversation: the user's question."""
    return [{"role": "user", "content": QUESTION}]


def after_tool_messages() -> list[dict]:
    """The second conversation: the question, the assistant's call (as an OpenAI client
    sends it back: content None, arguments as a JSON string), and the tool's answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": TOOL_RESULT},
    ]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat prompt for `messages` with TOOLS, as the server builds them."""
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _examples(tokenizer) -> list[Example]:
    return [
        (prompt_ids(tokenizer, question_messages()), reply_ids(tokenizer, TOOL_CALL_REPLY)),
        (prompt_ids(tokenizer, after_tool_messages()), reply_ids(tokenizer, FINAL_REPLY)),
    ]


def _build() -> tuple:
    tokenizer = load_tokenizer(CHAT_TEMPLATE)
    model = train(
        _examples(tokenizer), tokenizer, "tool-call",
        seed=SEED, lr=LR, max_steps=MAX_STEPS, check_every=CHECK_EVERY, min_margin=MIN_MARGIN, lean=True,
    )
    return model, tokenizer


_model = TrainedOnce(_build)


def make_tool_call_model(path: str) -> str:
    """Writes the tiny tool-calling model (weights, config, generation config, tokenizer)
    into `path` and returns it as a string. Trains once per process."""
    return _model.save(path)
