"""A tiny Qwen3-architecture "reasoning" model for tests (a helper module, not a test file).

`make_reasoning_model(path)` writes into `path` a small Qwen3ForCausalLM (safetensors, float32)
with the default model's (SmolLM2) tokenizer and a Qwen3-like chat template, trained on CPU to
memorise two conversations, so that greedy decoding of the chat prompt for QUESTION gives

* with thinking on (the default):           REASONING_REPLY + "<|im_end|>"
* with `enable_thinking=False` in the template: PLAIN_REPLY + "<|im_end|>"

Prompts are tokenized as the server does it: the rendered template text encoded with
`add_special_tokens=False`. The build checks, with transformers' greedy `generate`, that both
replies come out token for token, and raises otherwise (tiny_chat_model.py trains it).

The model is trained once per process; further calls only save it again (or nothing, if that
path already holds it).
"""

from __future__ import annotations

from tiny_chat_model import BOS_ID, EOS_ID, Example, TrainedOnce, load_tokenizer, reply_ids, train

__all__ = [  # BOS_ID and EOS_ID are re-exported: they used to be defined here
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "PLAIN_REPLY",
    "QUESTION",
    "REASONING_REPLY",
    "make_reasoning_model",
    "prompt_ids",
]

QUESTION = "What is 2+2?"
REASONING_REPLY = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4."
PLAIN_REPLY = "The answer is 4."

# Qwen3-like: no default system prompt; `enable_thinking=False` pre-fills an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

SEED = 0
LR = 2e-2
MAX_STEPS = 1000
CHECK_EVERY = 10
MIN_MARGIN = 6.0  # see tiny_chat_model.train


def prompt_ids(tokenizer, enable_thinking: bool | None = None) -> list[int]:
    """Token ids of the one-turn chat prompt for QUESTION, as the server builds them
    (enable_thinking=None leaves the template variable undefined, i.e. thinking on)."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _examples(tokenizer) -> list[Example]:
    """(prompt ids, reply ids ending in EOS) for thinking on and thinking off."""
    return [
        (prompt_ids(tokenizer, enable_thinking), reply_ids(tokenizer, reply))
        for enable_thinking, reply in ((None, REASONING_REPLY), (False, PLAIN_REPLY))
    ]


def _build() -> tuple:
    tokenizer = load_tokenizer(CHAT_TEMPLATE)
    model = train(
        _examples(tokenizer), tokenizer, "reasoning",
        seed=SEED, lr=LR, max_steps=MAX_STEPS, check_every=CHECK_EVERY, min_margin=MIN_MARGIN,
    )
    return model, tokenizer


_model = TrainedOnce(_build)


def make_reasoning_model(path: str) -> str:
    """Writes the tiny reasoning model (weights, config, generation config, tokenizer) into
    `path` and returns it as a string. Trains once per process."""
    return _model.save(path)
