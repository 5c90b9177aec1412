"""Decode CUDA graphs: the whole decode forward (embedding to logits) captured once per batch
size and replayed, so a step costs one graph launch instead of hundreds of kernel launches
from Python. Decode steps of a small model are launch-bound on a GPU.

A batch of B rows runs in the smallest captured size >= B; the extra rows are padding: token
0 at position 0, writing its K/V into the padding slot 0 and attending to that slot alone, and
their logits are dropped. Only plain decode steps replay (one token per row, last-token
logits); prefill, mixed and speculative verify steps run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Protocol

import torch

from srt_lite.layers.attention.base import AttentionBackend
from srt_lite.layers.logits_processor import LogitsProcessorOutput
from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.model_executor.forward_batch import ForwardBatch, ForwardMode


class GraphSource(Protocol):
    """What graphs are captured from (a ModelRunner): the model, its attention backend and pools."""

    model: torch.nn.Module
    attn_backend: AttentionBackend
    device: str
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool


logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (SGLang's ladder), and max_bs."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return sizes + [max_bs]


class CudaGraphRunner:
    def __init__(self, runner: GraphSource, max_bs: int):
        self.runner = runner
        self.backend = runner.attn_backend
        self.batch_sizes = capture_batch_sizes(max_bs)
        dev = runner.device
        self.max_bs = max_bs
        # Static inputs every graph reads; a replay copies the real batch into their heads.
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs], 0 = padding slot
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)  # [max_bs]
        self.backend.init_graph_state(max_bs, runner.req_to_token_pool.req_to_token.shape[1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bs, vocab] float32 logits per size
        self.capture()

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.forward_mode.is_decode()
            and fb.batch_size <= self.max_bs
            and fb.logit_index is None
            and not fb.return_all_logits
            and self.backend.graph_can_run(fb)
        )

    # ---- capture ------------------------------------------------------------------------

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
            extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=self.backend,
        )

    def capture(self) -> None:
        t0 = time.perf_counter()
        dev = self.runner.device
        pool = None  # one memory pool shared by all graphs: the largest is captured first
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            self.backend.init_forward_metadata_capture(fb)
            for _ in range(2):  # warm-up outside the graph (lazy inits, autotuning)
                self._forward(fb)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(fb)
            pool = graph.pool()
            self.graphs[bs] = graph
        logger.info(
            "CUDA graphs: captured decode for batch sizes %s in %.1f s",
            self.batch_sizes, time.perf_counter() - t0,
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            return self.runner.model(fb.input_ids, fb.positions, fb).next_token_logits

    # ---- replay -------------------------------------------------------------------------

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        bs = fb.batch_size
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        if size > bs:  # padding rows: token 0 at position 0 into slot 0
            self.input_ids[bs:size].zero_()
            self.positions[bs:size].zero_()
            self.out_cache_loc[bs:size].zero_()
        self.backend.init_forward_metadata_replay(fb, size)
        self.graphs[size].replay()
        # The graph's output buffer is overwritten by the next replay: hand out a copy.
        return LogitsProcessorOutput(self.outputs[size][:bs].clone())
