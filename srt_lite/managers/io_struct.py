"""Every message that crosses a process boundary, as small typed dataclasses.

Wire format: orjson of `[type_tag, fields]`; decoding looks the tag up in a fixed registry of
these classes and calls the constructor with the fields. Nothing is ever unpickled, so a
message can only ever become one of the types below. PortArgs, at the end, holds the
addresses these messages travel to.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from srt_lite.utils import get_free_port


@dataclass
class TokenizedGenerateReqInput:
    """TokenizerManager -> Scheduler: one request, already tokenized."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams fields, verified by the sender
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position to return a logprob for; -1: none
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    # With a grammar and a reasoning parser: where the output starts. "forced": inside a
    # think block the prompt opened; "optional": the model may open one. The grammar starts
    # after the block. None: no reasoning, the grammar starts at once.
    reasoning: str | None = None
    # An embedding request: its prompt is computed (max_new_tokens 0) and the last layer's
    # hidden states are pooled (--embedding-pooling) into one L2-normalized vector.
    embed: bool = False


@dataclass
class AbortReq:
    rid: str  # "" aborts every request


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class PrepareGrammarReq:
    """TokenizerManager -> Scheduler at the first grammar request: build the grammar backend
    now. The TokenizerManager is about to import its own copy of the grammar library to check
    the grammar, and the two imports (seconds each) then run side by side, not one after the
    other."""

    pass


@dataclass
class ShutdownReq:
    """Scheduler rank 0 -> the other ranks (never over ZMQ): leave the loop together."""

    pass


@dataclass
class GetLoadReq:
    """Asks the scheduler for its queue and memory state (health checks, tests)."""

    pass


@dataclass
class GetLoadReqOutput:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_used_tokens: int  # held by requests (running or retracted-in-progress)
    kv_cached_tokens: int  # held only by the radix cache (evictable)
    kv_free_tokens: int
    kv_capacity: int
    invariant_ok: bool  # free + cached + in use == capacity, and the tree checks out
    num_retractions: int = 0  # since start
    num_aborted_reqs: int = 0  # since start: ended by an abort (client gone, /abort_request, shutdown)
    evicted_tokens: int = 0  # since start
    gen_throughput: float = 0.0  # token/s over the latest decode log interval
    # Speculative decoding since start: request-steps that verified draft tokens, and the
    # tokens they produced (their ratio is the mean accept length).
    spec_verified_rows: int = 0
    spec_new_tokens: int = 0
    num_waiting_tokens: int = 0  # prompt (and, once retracted, output) tokens of the waiting requests


@dataclass
class BatchTokenIDOut:
    """Scheduler -> Detokenizer: new token ids of every request that advanced this step."""

    rids: list[str] = field(default_factory=list)
    # ids generated since the previous message for that rid
    new_ids: list[list[int]] = field(default_factory=list)
    # {"type": "stop"|"length"|"abort", "matched": ..., "message"?}
    finished_reasons: list[dict | None] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    # Per request, None or new logprob entries since the previous message, keyed like SGLang's
    # meta_info fields ("output_token_logprobs": [[logprob, id], ...], "input_top_logprobs", ...).
    logprobs: list[dict | None] = field(default_factory=list)
    # Detokenization settings, repeated per message so the detokenizer keeps no set-up state.
    skip_special_tokens: list[bool] = field(default_factory=list)
    spaces_between_special_tokens: list[bool] = field(default_factory=list)
    stops: list[list[str]] = field(default_factory=list)
    no_stop_trim: list[bool] = field(default_factory=list)
    # For metrics: seconds the request waited before its first scheduling, and the wall-clock
    # time (time.time()) of its first output token; None until known.
    queue_times: list[float | None] = field(default_factory=list)
    first_token_times: list[float | None] = field(default_factory=list)
    # Per request, its pooled embedding (embedding requests, once finished) or None.
    embeddings: list[list[float] | None] = field(default_factory=list)


@dataclass
class BatchStrOut:
    """Detokenizer -> TokenizerManager: text deltas, safe to show (stop strings held back)."""

    rids: list[str]
    texts: list[str]  # new text since the previous message for that rid
    new_ids: list[list[int]]
    finished_reasons: list[dict | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[dict | None]
    queue_times: list[float | None] = field(default_factory=list)
    first_token_times: list[float | None] = field(default_factory=list)
    embeddings: list[list[float] | None] = field(default_factory=list)


@dataclass
class SchedulerReady:
    """Sent once over the start-up pipe by each scheduler rank (not over ZMQ)."""

    tp_rank: int
    max_total_num_tokens: int
    max_context_len: int
    max_running_requests: int
    vocab_size: int
    device: str
    dtype: str
    linear_path: str = ""  # how the linears compute (model_runner.linear_path)
    cpu: str = ""  # cpu_caps.get().describe()
    # Layers that keep a GGUF file's blocks, by weight format ("Q4_K", "Q4_K+Q6_K" for a
    # fused projection of both); empty when every weight is a float tensor.
    gguf_formats: dict[str, int] = field(default_factory=dict)
    weight_bytes: int = 0  # bytes of weights held, quantized blocks included
    # --enable-deterministic-inference: whether outputs are batch-invariant here, and if
    # asked for but not, what keeps them from it (model_executor/determinism.gaps).
    deterministic: bool = False
    deterministic_gaps: list[str] = field(default_factory=list)


_REGISTRY: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReqInput,
        AbortReq,
        FlushCacheReq,
        FlushCacheReqOutput,
        PrepareGrammarReq,
        ShutdownReq,
        GetLoadReq,
        GetLoadReqOutput,
        BatchTokenIDOut,
        BatchStrOut,
        SchedulerReady,
    )
}


def encode(obj: Any) -> bytes:
    return orjson.dumps([type(obj).__name__, obj])


def decode(data: bytes) -> Any:
    tag, payload = orjson.loads(data)
    cls = _REGISTRY.get(tag)
    if cls is None or not isinstance(payload, dict):
        raise ValueError(f"unknown message type {tag!r}")
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in payload.items() if k in names})


@dataclass
class PortArgs:
    """IPC endpoints of one server, all inside a private (0700) temp dir, and the address
    where its tensor-parallel ranks meet."""

    ipc_dir: str
    scheduler_input: str  # TokenizerManager -> Scheduler rank 0
    detokenizer_input: str  # Scheduler rank 0 -> Detokenizer
    tokenizer_input: str  # Detokenizer and Scheduler -> TokenizerManager
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's TCP store, for tp_size > 1

    @classmethod
    def create(cls, tp_size: int = 1, dist_init_addr: str | None = None) -> "PortArgs":
        d = tempfile.mkdtemp(prefix="srt_lite-")
        os.chmod(d, 0o700)
        if dist_init_addr is None and tp_size > 1:
            dist_init_addr = f"127.0.0.1:{get_free_port()}"
        return cls(
            ipc_dir=d,
            scheduler_input=os.path.join(d, "scheduler"),
            detokenizer_input=os.path.join(d, "detokenizer"),
            tokenizer_input=os.path.join(d, "tokenizer"),
            dist_init_addr=dist_init_addr,
        )
