"""A native generate request, normalised: what POST /generate and `Engine.generate` take
(one prompt or a batch, as text or token ids, with one set of sampling parameters or one per
prompt) turned into one list entry per prompt, checked before anything is queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from srt_lite.managers.validation import NO_LOGPROBS, LogprobOptions, RequestError
from srt_lite.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager


@dataclass
class GenerateRequest:
    input_ids: list[list[int]]  # one entry per prompt
    params: list[SamplingParams]
    rids: list[str | None]
    is_batch: bool
    stream: bool = False
    logprobs: LogprobOptions = NO_LOGPROBS

    def choice_rids(self) -> list[str | None]:
        """One id per choice (`split_choices` order): a client rid names a prompt's only
        choice; the choices of a prompt with n > 1 get ids of the manager's choosing."""
        return [rid if p.n == 1 else None for p, rid in zip(self.params, self.rids) for _ in range(p.n)]

    def shape(self, outputs: list[dict]) -> dict | list[dict]:
        """A list for a batch or n > 1 (the n completions of each prompt in turn), else one."""
        return outputs if self.is_batch or len(outputs) > 1 else outputs[0]


def normalize_generate_request(
    tm: TokenizerManager,
    *,
    text: Any = None,
    input_ids: Any = None,
    sampling_params: Any = None,
    rid: Any = None,
    stream: bool = False,
    logprobs: LogprobOptions = NO_LOGPROBS,
    text_field: str = "text",
) -> GenerateRequest:
    """Raises RequestError for anything malformed, out of range or too long, before a single
    prompt reaches the scheduler. `text_field` is the caller's name for the text argument
    (`text` in the HTTP body, `prompt` in the Engine), used in the error messages."""
    prompts, is_batch = _prompts(tm, text, input_ids, text_field)
    params = _sampling_params(tm, sampling_params, len(prompts))
    rids = _rids(rid, len(prompts), is_batch)
    for ids, p in zip(prompts, params):
        tm.validate(ids, p)
    if stream and (is_batch or params[0].n > 1):
        raise RequestError("stream=true takes a single prompt with n == 1")
    return GenerateRequest(prompts, params, rids, is_batch, stream, logprobs)


def _prompts(tm: TokenizerManager, text: Any, input_ids: Any, text_field: str) -> tuple[list[list[int]], bool]:
    if (text is None) == (input_ids is None):
        raise RequestError(f"give exactly one of {text_field} or input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"{text_field} must be a string or a non-empty list of strings")
        return [tm.tokenize(t) for t in texts], is_batch
    if not isinstance(input_ids, (list, tuple)):
        raise RequestError("input_ids must be a non-empty list of token ids or of lists of token ids")
    # An empty list is one empty prompt, which the prompt checks reject by name.
    is_batch = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
    prompts = input_ids if is_batch else [input_ids]
    if not all(isinstance(x, (list, tuple)) for x in prompts):
        raise RequestError("input_ids must not mix token ids and lists")
    return [list(x) for x in prompts], is_batch


def _sampling_params(tm: TokenizerManager, sp: Any, count: int) -> list[SamplingParams]:
    if isinstance(sp, list):
        if len(sp) != count:
            raise RequestError("sampling_params list must have one entry per prompt")
        params = []
        for p in sp:
            if not isinstance(p, dict):
                raise RequestError("each sampling_params entry must be an object")
            params.append(tm.make_sampling_params(p))
        return params
    if sp is not None and not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object")
    return [tm.make_sampling_params(sp)] * count


def _rids(rid: Any, count: int, is_batch: bool) -> list[str | None]:
    if rid is not None and is_batch and not isinstance(rid, list):
        raise RequestError("rid must be a list for a batch")
    rids = rid if isinstance(rid, list) else [rid] * count
    if len(rids) != count or not all(r is None or isinstance(r, str) for r in rids):
        raise RequestError("rid must be a string (or a list of strings for a batch)")
    return rids
