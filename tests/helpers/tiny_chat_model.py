"""Training tiny chat models for tests (a helper module, not a test file).

The test fixtures (reasoning_model.py, tool_call_model.py) each memorise a few conversations
in a small Qwen3ForCausalLM (float32) that uses the default model's (SmolLM2) tokenizer with
the fixture's own chat template. This module holds what they share: the architecture, the
tokenizer, a training loop that stops once greedy decoding is safely memorised and then
checks it with transformers' `generate`, and the train-once-per-process, save-anywhere cache.

Prompts are tokenized as the server does it: the rendered template text encoded with
`add_special_tokens=False`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

EOS_ID = 2  # <|im_end|> in the SmolLM2 tokenizer
BOS_ID = 1  # <|im_start|>

# (prompt ids, reply ids ending in EOS)
Example = tuple[list[int], list[int]]


def model_config():
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


def greedy_text(model, tokenizer, messages: list[dict], **template_kwargs) -> str:
    """transformers' greedy reply (special tokens kept) to `messages`, with the prompt built
    as the server builds it: the rendered template encoded without added special tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=64,
        )
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=False)


def load_tokenizer(chat_template: str):
    """The default model's tokenizer with `chat_template` as its template."""
    from transformers import AutoTokenizer

    from srt_lite.model_loader.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.chat_template = chat_template
    assert tok.eos_token_id == EOS_ID and tok.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"
    return tok


def reply_ids(tokenizer, reply: str) -> list[int]:
    """The reply's token ids followed by EOS; the reply must survive a decode round trip."""
    ids = tokenizer.encode(reply, add_special_tokens=False) + [EOS_ID]
    assert tokenizer.decode(ids[:-1]) == reply
    return ids


def _batch(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The examples padded into one batch: (input_ids, attention_mask, mask of the reply
    positions, the tokens those positions must predict)."""
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
    return input_ids, attention_mask, mask, targets[mask]


def _min_margin(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The smallest lead of a target token's logit over the best other token."""
    with torch.no_grad():
        tgt = logits.gather(1, targets[:, None])[:, 0]
        other = logits.scatter(1, targets[:, None], float("-inf")).max(1).values
        return (tgt - other).min().item()


def _fit(model, examples: list[Example], lr: float, max_steps: int, check_every: int, min_margin: float,
         lean: bool) -> tuple[int, float, float]:
    """Adam steps until the margin reaches min_margin or max_steps: (steps, loss, margin)."""
    input_ids, attention_mask, mask, flat_targets = _batch(examples)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps, margin = 0, float("-inf")
    while steps < max_steps:
        if lean:
            hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = model.lm_head(hidden[mask])
        else:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[mask]
        loss = torch.nn.functional.cross_entropy(logits, flat_targets)
        if steps % check_every == 0:
            margin = _min_margin(logits, flat_targets)
            if margin >= min_margin:
                break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
    return steps, loss.item(), margin


def _check_greedy(model, examples: list[Example], tokenizer, what: str) -> None:
    """Greedy generation must reproduce every reply exactly, token for token."""
    for p, r in examples:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=len(r) + 8)
        got = out[0, len(p) :].tolist()
        if got != r:
            raise RuntimeError(f"{what} model does not reproduce its reply: wanted {tokenizer.decode(r)!r}, "
                               f"got {tokenizer.decode(got)!r}")


def train(
    examples: list[Example],
    tokenizer,
    what: str,
    *,
    seed: int,
    lr: float,
    max_steps: int,
    check_every: int,
    min_margin: float,
    lean: bool = False,
):
    """Trains a fresh model (seeded, without disturbing the global RNG) on the replies of
    `examples` until every reply token beats the runner-up logit by `min_margin` under
    teacher forcing (so greedy decoding is robust to small numeric differences, e.g. another
    backend), then checks that greedy generation reproduces each reply token for token.
    Raises RuntimeError otherwise. `what` names the model in logs and errors.

    `lean` trains on one thread and projects only the reply positions onto the vocabulary:
    for long prompts about 4x faster on a busy 2-core machine (the vocabulary projection
    dominates, and threads fight over the cores), and the result does not depend on the
    core count. The reasoning model keeps the original path so its weights stay the same."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    if lean:
        torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(model_config()).to(torch.float32)
        model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
        model.train()
        steps, loss, margin = _fit(model, examples, lr, max_steps, check_every, min_margin, lean)
        model.eval()
    torch.set_num_threads(threads)
    logger.info("%s model trained in %.1fs (%d steps, loss %.4f, min logit margin %.2f)",
                what, time.perf_counter() - t0, steps, loss, margin)
    if margin < min_margin:
        raise RuntimeError(f"{what} model did not converge in {max_steps} steps (margin {margin:.2f})")
    _check_greedy(model, examples, tokenizer, what)
    return model


class TrainedOnce:
    """A fixture model built (trained) on first use in a process, then saved into any
    directory asked for; saving again to a path already written is skipped."""

    def __init__(self, build: Callable[[], tuple]) -> None:
        self._build = build  # returns (model, tokenizer)
        self._trained: tuple | None = None
        self._saved: set[str] = set()

    def save(self, path: str) -> str:
        """Writes weights, config, generation config and tokenizer into `path`; returns it."""
        path = str(path)
        key = os.path.realpath(path)
        if key in self._saved and os.path.isfile(os.path.join(path, "config.json")):
            return path
        if self._trained is None:
            self._trained = self._build()
        model, tokenizer = self._trained
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        self._saved.add(key)
        return path
