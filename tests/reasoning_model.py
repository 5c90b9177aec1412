"""A tiny Qwen3-architecture "reasoning" model for tests (a helper module, not a test file).

`make_reasoning_model(path)` writes into `path` a small Qwen3ForCausalLM (safetensors, float32)
with the default model's (SmolLM2) tokenizer and a Qwen3-like chat template, trained on CPU to
memorise two conversations, so that greedy decoding of the chat prompt for QUESTION gives

* with thinking on (the default):           REASONING_REPLY + "<|im_end|>"
* with `enable_thinking=False` in the template: PLAIN_REPLY + "<|im_end|>"

Prompts are tokenized as the server does it: the rendered template text encoded with
`add_special_tokens=False`. The build checks, with transformers' greedy `generate`, that both
replies come out token for token, and raises otherwise.

The model is trained once per process; further calls only save it again (or nothing, if that
path already holds it).
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

QUESTION = "What is 2+2?"
REASONING_REPLY = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4."
PLAIN_REPLY = "The answer is 4."

EOS_ID = 2  # <|im_end|> in the SmolLM2 tokenizer
BOS_ID = 1  # <|im_start|>

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
# Stop once every reply token beats the runner-up logit by this much under teacher forcing
# (so greedy decoding is robust to small numeric differences, e.g. another backend).
MIN_MARGIN = 6.0

_trained: tuple | None = None  # (model, tokenizer), built once per process
_saved: set[str] = set()  # paths already written in this process


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        architectures=["Qwen3ForCausalLM"],
    )


def _load_tokenizer():
    from transformers import AutoTokenizer

    from srt_lite.model_loader.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.chat_template = CHAT_TEMPLATE
    assert tok.eos_token_id == EOS_ID and tok.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"
    return tok


def prompt_ids(tokenizer, enable_thinking: bool | None = None) -> list[int]:
    """Token ids of the one-turn chat prompt for QUESTION, as the server builds them
    (enable_thinking=None leaves the template variable undefined, i.e. thinking on)."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids ending in EOS) for thinking on and thinking off."""
    out = []
    for enable_thinking, reply in ((None, REASONING_REPLY), (False, PLAIN_REPLY)):
        reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [EOS_ID]
        assert tokenizer.decode(reply_ids[:-1]) == reply
        out.append((prompt_ids(tokenizer, enable_thinking), reply_ids))
    return out


def _train(tokenizer):
    from transformers import GenerationConfig, Qwen3ForCausalLM

    examples = _examples(tokenizer)
    seqs = [p + r for p, r in examples]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), EOS_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    # targets[b, t] is the token that position t must predict; -100 outside the replies.
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for b, ((p, r), s) in enumerate(zip(examples, seqs)):
        input_ids[b, : len(s)] = torch.tensor(s)
        attention_mask[b, : len(s)] = 1
        targets[b, len(p) - 1 : len(s) - 1] = torch.tensor(r)
    mask = targets != -100
    flat_targets = targets[mask]

    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3ForCausalLM(_config()).to(torch.float32)
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
        )
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        steps, margin = 0, float("-inf")
        while steps < MAX_STEPS:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[mask]
            loss = torch.nn.functional.cross_entropy(logits, flat_targets)
            if steps % CHECK_EVERY == 0:
                with torch.no_grad():
                    tgt = logits.gather(1, flat_targets[:, None])[:, 0]
                    other = logits.scatter(1, flat_targets[:, None], float("-inf")).max(1).values
                    margin = (tgt - other).min().item()
                if margin >= MIN_MARGIN:
                    break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        model.eval()
    elapsed = time.perf_counter() - t0
    logger.info(
        "reasoning model trained in %.1fs (%d steps, loss %.4f, min logit margin %.2f)",
        elapsed, steps, loss.item(), margin,
    )
    if margin < MIN_MARGIN:
        raise RuntimeError(f"reasoning model did not converge in {MAX_STEPS} steps (margin {margin:.2f})")

    # Greedy generation must reproduce both replies exactly, token for token.
    for p, r in examples:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=len(r) + 8,
            )
        got = out[0, len(p) :].tolist()
        if got != r:
            raise RuntimeError(
                f"reasoning model does not reproduce its reply: wanted {tokenizer.decode(r)!r}, "
                f"got {tokenizer.decode(got)!r}"
            )
    return model


def make_reasoning_model(path: str) -> str:
    """Writes the tiny reasoning model (weights, config, generation config, tokenizer) into
    `path` and returns it as a string. Trains once per process."""
    global _trained
    path = str(path)
    key = os.path.realpath(path)
    if key in _saved and os.path.isfile(os.path.join(path, "config.json")):
        return path
    if _trained is None:
        tokenizer = _load_tokenizer()
        _trained = (_train(tokenizer), tokenizer)
    model, tokenizer = _trained
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _saved.add(key)
    return path
