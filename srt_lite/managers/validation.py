"""What a request must satisfy before it is queued, checked in one place.

The TokenizerManager checks every request before it reaches the scheduler, so a client gets
its 400 at once; the scheduler runs the same checks again on what arrives (it alone knows the
KV capacity, and it must never act on a request it cannot serve).
"""

from __future__ import annotations

from dataclasses import dataclass

from srt_lite.sampling.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as sent; the message is shown to the client (400)."""


@dataclass(frozen=True)
class LogprobOptions:
    """SGLang's logprob request fields."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False

    @classmethod
    def from_body(cls, body: dict) -> "LogprobOptions":
        opts = cls(
            return_logprob=body.get("return_logprob", False),
            logprob_start_len=body.get("logprob_start_len", -1),
            top_logprobs_num=body.get("top_logprobs_num", 0) or 0,
            token_ids_logprob=body.get("token_ids_logprob"),
            return_text_in_logprobs=body.get("return_text_in_logprobs", False),
        )
        opts.verify()
        return opts

    def verify(self, vocab_size: int | None = None) -> None:
        for name in ("return_logprob", "return_text_in_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a boolean")
        for name, lo in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise RequestError(f"{name} must be an integer >= {lo}")
        if self.top_logprobs_num > 1000:
            raise RequestError("top_logprobs_num must be <= 1000")
        ids = self.token_ids_logprob
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise RequestError("token_ids_logprob must be a list of token ids")
            if vocab_size is not None and any(t >= vocab_size for t in ids):
                raise RequestError("token_ids_logprob contains an id outside the vocabulary")


NO_LOGPROBS = LogprobOptions()


def parse_sampling_params(d: dict | None, vocab_size: int) -> SamplingParams:
    try:
        params = SamplingParams.from_dict(d)
        params.verify(vocab_size)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None
    return params


def check_input(
    input_ids: list[int], params: SamplingParams, context_len: int, vocab_size: int, kv_capacity: int | None = None
) -> None:
    """Raises RequestError when the prompt cannot be served with these parameters."""
    n = len(input_ids)
    if n == 0:
        raise RequestError("the prompt is empty")
    if n >= context_len:
        raise RequestError(f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens).")
    if n + params.max_new_tokens > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input "
            f"and {params.max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input or the completion to fit within the limit."
        )
    if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab_size for t in input_ids):
        raise RequestError(f"input_ids must be integers in [0, {vocab_size})")
    if kv_capacity is not None and n + 1 > kv_capacity:
        raise RequestError(f"the prompt has {n} tokens, more than the KV cache holds ({kv_capacity})")
