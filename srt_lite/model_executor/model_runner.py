"""ModelRunner: owns the model weights, the KV pools and the attention backend of one rank."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from srt_lite import cpu_caps
from srt_lite.distributed import get_tp_rank, get_tp_size
from srt_lite.distributed.parallel_state import tp_min
from srt_lite.layers import batch_invariant
from srt_lite import cpu_kernels
from srt_lite.layers.attention import create_attention_backend
from srt_lite.layers.attention.base import AttentionConfig
from srt_lite.layers.cpu_linear.products import EXACT_ROWS, bucketed_rows
from srt_lite.layers.cpu_linear.paths import PATH_PACKED, PATH_TORCH, cpu_linear_path
from srt_lite.layers.cpu_linear.packable import prepare_linears_for_cpu
from srt_lite.layers.logits_processor import LogitsProcessorOutput
from srt_lite.layers.radix_attention import RadixAttention, compiled_forward_batch
from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.model_loader import default_model, gguf_model, gguf_quant
from srt_lite.model_loader.gguf_reader import GGUFFile
from srt_lite.model_loader.weight_utils import count_checkpoint_tensors, iter_checkpoint
from srt_lite.models.registry import get_model_class
from srt_lite.server_args import ServerArgs
from srt_lite.model_executor import determinism
from srt_lite.model_executor.dtype import resolve_dtype
from srt_lite.utils import available_memory_bytes, progress, resolve_device

logger = logging.getLogger(__name__)

# Default share of memory for weights + KV: CUDA as SGLang; on CPU the KV buffers are
# allocated lazily (untouched pages cost nothing) but RAM is shared with everything else.
_DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.25}


def agree_dtype(dtype: torch.dtype) -> torch.dtype:
    """One dtype for every rank: `auto` resolves per CPU, and nodes may differ. float32 when
    they disagree (any CPU runs it, and it is the exact one)."""
    codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    if tp_min(codes[dtype]) == -tp_min(-codes[dtype]):
        return dtype
    if get_tp_rank() == 0:
        logger.warning("The ranks' CPUs chose different dtypes for --dtype auto; all run float32")
    return torch.float32


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs):
        self.model_config = model_config
        self.server_args = server_args
        self.device = resolve_device(server_args.device)
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.dtype = agree_dtype(resolve_dtype(server_args.dtype, self.device, model_config.approx_num_params()))
        model_config.verify_tp(self.tp_size)
        if server_args.enable_deterministic_inference:
            batch_invariant.enable()  # before loading: the layers read it as they pack
        self.load_model()
        self.init_memory_pool()
        self.attn_backend = create_attention_backend(server_args.attention_backend, self.attention_config())
        self.deterministic_gaps: list[str] = []
        if server_args.enable_deterministic_inference:
            head_dims = {m.head_dim for m in self.model.modules() if isinstance(m, RadixAttention)}
            self.deterministic_gaps = determinism.gaps(
                self.device, self.dtype, self.linear_path, head_dims, server_args.enable_torch_compile)
            if self.deterministic_gaps and self.tp_rank == 0:
                logger.warning("Deterministic inference asked for, not batch-invariant here: %s",
                               "; ".join(self.deterministic_gaps))
        self.deterministic = server_args.enable_deterministic_inference and not self.deterministic_gaps
        self.compiled_body = None
        if server_args.enable_torch_compile:
            self.init_torch_compile()
        self.cuda_graph_runner = None
        if self.attn_backend.supports_cuda_graph and not server_args.disable_cuda_graph:
            from srt_lite.model_executor.cuda_graph_runner import CudaGraphRunner

            max_bs = min(server_args.cuda_graph_max_bs or 160, server_args.max_running_requests)
            self.cuda_graph_runner = CudaGraphRunner(self, max_bs)

    # ---- set-up -------------------------------------------------------------------------

    def attention_config(self) -> AttentionConfig:
        """What an attention backend is built from: this rank's head shape and the pools."""
        cfg = self.model_config
        layers = [m for m in self.model.modules() if isinstance(m, RadixAttention)]
        return AttentionConfig(
            device=self.device, dtype=self.dtype, num_heads=cfg.num_heads // self.tp_size,
            num_kv_heads=self.kv_heads_per_rank(), head_dim=cfg.head_dim,
            scaling=layers[0].scaling if layers else cfg.head_dim**-0.5,
            architectures=tuple(getattr(cfg.hf_config, "architectures", None) or ()),
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
        )

    def load_model(self) -> None:
        # While the ranks load, the main process imports transformers and loads its tokenizer,
        # which keeps one core busy. A pool that takes every core would wait at each parallel
        # op of the load for the thread that lost its core, so on the CPU the load leaves one.
        # A GGUF file's blocks are repacked by threads that claim work as they go (a lost core
        # delays one group of rows), so that load takes every core: most of its time is the
        # first writes to the packed copy's fresh pages, which go in parallel.
        threads = torch.get_num_threads()
        if self.device == "cpu" and threads > 1 and self.model_config.gguf_file is None:
            torch.set_num_threads(threads - 1)
        try:
            self._build_model()
        finally:
            torch.set_num_threads(threads)

    def _build_model(self) -> None:
        t0 = time.perf_counter()
        cfg = self.model_config
        cls = get_model_class(getattr(cfg.hf_config, "architectures", None))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = cls(cfg.hf_config, max_position=max(cfg.context_len, 1))
        finally:
            torch.set_default_dtype(prev)
        if cfg.gguf_file is not None:
            gguf = GGUFFile(cfg.gguf_file)
            # Blocks are kept on the CPU (the GGUF kernels are CPU kernels) unless asked not to.
            keep = self.device == "cpu" and self.server_args.quantization != "none"
            source, count = gguf_model.iter_weights(gguf, keep), gguf_model.count_weights(gguf)
        else:
            source, count = iter_checkpoint(cfg.path), count_checkpoint_tensors(cfg.path)
        self.model.load_weights(progress(source, count, "Loading weights", enabled=self.tp_rank == 0))
        self.model.eval()
        if cfg.gguf_file is not None:
            gguf.drop_resident_pages()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.gguf_formats: dict[str, int] = {}  # weight format -> layers that keep GGUF blocks
        for m in self.model.modules():
            if getattr(m, "gguf", None) is not None:
                self.weight_bytes += m.gguf.nbytes
                self.gguf_formats[m.gguf.format] = self.gguf_formats.get(m.gguf.format, 0) + 1
        # Packed linears run at bucketed row counts; forward() pads the tokens once for them.
        self.pad_rows = False
        self.linear_path = PATH_TORCH  # F.linear (cuBLAS on CUDA)
        if self.device == "cpu":
            self.linear_path = cpu_linear_path(self.dtype, self.server_args.disable_weight_packing)
            prepare_linears_for_cpu(self.model, self.linear_path)
            self.pad_rows = self.linear_path == PATH_PACKED
        self.int4_linears = self.load_int4_weights()
        # After the last change to the linears: the stack holds the weights as they are now.
        # A compiled graph traces the Python layers instead.
        self.cpp_stack = (
            self.device == "cpu" and not self.server_args.enable_torch_compile
            and hasattr(self.model.model, "use_cpp_stack") and self.model.model.use_cpp_stack()
        )
        int4 = f", {self.int4_linears} with 4-bit GGUF weights" if self.int4_linears else ""
        if self.gguf_formats:
            int4 = ", GGUF blocks: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.gguf_formats.items()))
        logger.info(
            "Loaded %s (%.1f MB, %s, %s, linears: %s%s; CPU %s) in %.1f s",
            cls.__name__, self.weight_bytes / 2**20, self.dtype, self.device, self.linear_path, int4,
            cpu_caps.get().describe(), time.perf_counter() - t0,
        )

    def load_int4_weights(self) -> int:
        """A checkpoint converted from a GGUF file keeps its Q4_0/Q4_1 linears' 4-bit weights
        beside the dequantized ones (PackableLinear.use_int4), unless --quantization none.
        torch's CPU int4 matmul is vectorised for bf16 activations only (fp32 and fp16 take a
        scalar loop, far slower than their own matmul), so a model in another dtype, or on
        CUDA, runs dequantized: in fp32 exactly the dequantized checkpoint, as before."""
        mode = self.server_args.quantization
        gguf = default_model.source_gguf(self.model_config.path)
        if mode == "gguf" and gguf is None and self.model_config.gguf_file is None:
            raise ValueError("--quantization gguf needs a .gguf checkpoint (--model-path FILE.gguf)")
        if mode == "none" or gguf is None or self.device != "cpu" or self.dtype != torch.bfloat16:
            return 0
        if not hasattr(self.model, "load_int4_weights"):
            return 0
        return self.model.load_int4_weights(gguf_quant.load_q4_tensors(self.model_config.path, gguf))

    def init_torch_compile(self) -> None:
        """Compiles the decoder stack (embedding to final norm). Attention and the oneDNN
        matmuls stay opaque custom ops inside the graph; everything between them (residual
        adds, RMSNorm, RoPE, SiLU * up) is fused by inductor. `dynamic=True` makes one graph
        serve every token count; torch specialises a single token (T = 1) into a second one.
        The LM head and logits selection stay eager: they depend on the batch's rows.

        Inductor's C++ wrapper (`cpp_wrapper`) calls the graph's kernels and custom ops from
        generated C++ instead of Python: a CPU step runs many small calls, whose Python
        dispatch it saves. Its cost is a C++ compile of each graph on a cold inductor cache.
        With the C++ CPU ops built (cpu_kernels.py) the graph's attention and matmuls
        are C++ ops too."""
        self.attn_layers = {m.layer_id: m for m in self.model.modules() if isinstance(m, RadixAttention)}
        if self.attn_backend.has_cpp_graph_op:
            cpu_kernels.use_private_inductor_cache()
            for layer in self.attn_layers.values():
                layer.use_cpp_graph_op()
        options = {"cpp_wrapper": True} if self.device == "cpu" else None
        self.compiled_body = torch.compile(self.model.model, dynamic=True, fullgraph=True, options=options)
        logger.info("torch.compile on: the first forward of each graph compiles it (minutes without a cache)")

    def kv_heads_per_rank(self) -> int:
        return max(1, self.model_config.num_kv_heads // self.tp_size)

    def init_memory_pool(self) -> None:
        cfg, args = self.model_config, self.server_args
        per_token = TokenToKVPool.bytes_per_token(
            cfg.num_layers, self.kv_heads_per_rank(), cfg.head_dim, self.dtype
        )
        if args.max_total_tokens is not None:
            capacity = args.max_total_tokens
        else:
            kind = "cuda" if self.device.startswith("cuda") else "cpu"
            frac = args.mem_fraction_static or _DEFAULT_MEM_FRACTION[kind]
            if kind == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                budget = available_memory_bytes(self.device) - (1 - frac) * total
            else:
                budget = frac * available_memory_bytes(self.device) - self.weight_bytes
            # Every rank must hold the same number of slots (they schedule in lockstep); each
            # measured its own free memory, on its own node.
            capacity = tp_min(int(budget // per_token))
            if capacity < 16:
                raise ValueError(
                    f"not enough memory for the KV cache ({budget / 2**20:.0f} MB budget); "
                    "raise --mem-fraction-static or set --max-total-tokens"
                )
        self.max_total_num_tokens = capacity
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 16, cfg.context_len + 8, self.device
        )
        self.token_to_kv_pool = TokenToKVPool(
            capacity, cfg.num_layers, self.kv_heads_per_rank(), cfg.head_dim, self.dtype, self.device
        )
        logger.info(
            "KV cache: %d tokens (%.1f MB), context length %d",
            capacity, capacity * per_token / 2**20, cfg.context_len,
        )

    # ---- forward ------------------------------------------------------------------------

    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(fb):
            return self.cuda_graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        input_ids, positions = fb.input_ids, fb.positions
        T = fb.num_tokens
        rows = bucketed_rows(T) if self.pad_rows else T
        if rows != T:
            # The token axis padded once to the packed linears' row bucket, not in each of
            # the 4 linears of every layer. The model drops the extra rows before the LM
            # head, and attention gives them no KV and a zero output.
            input_ids = F.pad(input_ids, (0, rows - T))  # [rows]
            positions = F.pad(positions, (0, rows - T))
        if self.compiled_body is None:
            return self.model(input_ids, positions, fb)
        step = self.attn_backend.compiled_step(fb, self.attn_layers)  # C++ attention state, if any
        with torch.inference_mode(), compiled_forward_batch(fb, self.attn_layers), step:
            hidden = self.compiled_body(input_ids, positions, None)[:T]  # [T, hidden]
            return self.model.logits_processor(hidden, self.model.lm_head, fb)

    # no_grad, not inference_mode: the scheduler builds its batches outside inference mode,
    # and torch.compile guards on that (an inference tensor input would compile the graphs
    # again for the first real batches).
    @torch.no_grad()
    def warmup(self, max_decode_batch: int, num_draft_tokens: int, prefill_chunk: int) -> None:
        """Dummy forwards before serving, so the first requests do not pay for kernel set-up
        (oneDNN creates a primitive per new shape) and allocator growth: a prefill, decode
        steps at batch sizes up to `max_decode_batch`, with speculative decoding
        (`num_draft_tokens` > 0) one request verifying 2..n tokens, and one prompt of
        `prefill_chunk` tokens (the first use of a full chunk's shape costs more on the CPU;
        0: none). n is the draft plus the model's own token, at most the row counts the CPU
        linears run unpadded (EXACT_ROWS), each a shape of its own. Uses scratch KV that it
        frees."""
        max_verify = min(num_draft_tokens + 1, EXACT_ROWS) if num_draft_tokens else 1
        sizes = [b for b in (1, 2, 4, 8, 16, 32) if b <= max_decode_batch] or [1]
        # GGUF linears take the same integer products or dequantize a slab at a time into the
        # same scratch at any prompt length, so the first pass's size warms nothing for them:
        # one token a request, as decode, instead of seconds of 8-bit compute at start-up.
        # Nor does a batch size: their passes stop at 4 rows (one at 32 rows is half a second
        # of compute on a 1B model, and sets up only what the first such batch does anyway).
        prompt = 1 if self.gguf_formats else 8
        if self.gguf_formats:
            sizes = [b for b in sizes if b <= 4]
        width = prompt + max(max_verify, 1)  # KV slots per scratch request
        need = sizes[-1] * width
        if need > self.max_total_num_tokens or sizes[-1] > self.req_to_token_pool.available_size():
            return  # a tiny test cache: nothing worth warming
        r2t = self.req_to_token_pool.req_to_token
        # A long prompt (last) runs over all the scratch slots if the cache and context allow.
        fits = prefill_chunk <= min(self.max_total_num_tokens // 2, r2t.shape[1])
        long_prompt = prefill_chunk if prompt < prefill_chunk and fits else 0
        if self.gguf_formats:  # the first batch of prompts sets up their slabs, as above
            long_prompt = 0
        rows = [self.req_to_token_pool.alloc() for _ in range(sizes[-1])]
        slots = self.token_to_kv_pool.alloc(max(need, long_prompt))
        for i, row in enumerate(rows):
            r2t[row, :width] = slots[i * width : (i + 1) * width].to(r2t.dtype)

        def step(batch: int, prefix: int, new: int) -> None:
            locs = torch.cat([r2t[row, prefix : prefix + new] for row in rows[:batch]]).to(torch.int64)
            self.forward(ForwardBatch.create(
                input_ids=[1] * (batch * new), req_pool_indices=rows[:batch], prefix_lens=[prefix] * batch,
                extend_lens=[new] * batch, out_cache_loc=locs, device=self.device,
            ))

        t0 = time.perf_counter()
        steps = [(sizes[-1], 0, prompt)] + [(b, prompt, 1) for b in sizes]
        steps += [(1, prompt, n) for n in range(2, max_verify + 1)]
        if long_prompt:
            steps.append((1, 0, long_prompt))
        for batch, prefix, new in progress(steps, len(steps), "Warming up", enabled=self.tp_rank == 0):
            if new == long_prompt:
                r2t[rows[0], :long_prompt] = slots[:long_prompt].to(r2t.dtype)
            step(batch, prefix, new)
        self.token_to_kv_pool.free(slots)
        for row in rows:
            self.req_to_token_pool.free(row)
        logger.info("Warm-up: %d forward passes in %.1f s", len(steps), time.perf_counter() - t0)
