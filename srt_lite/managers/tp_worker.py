"""TpModelWorker: one rank's forward pass plus batched sampling."""

from __future__ import annotations

import torch

from srt_lite.managers.schedule_batch import ScheduleBatch
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.sampling.sampler import Sampler
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.server_args import ServerArgs


class TpModelWorker:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs):
        self.model_runner = ModelRunner(model_config, server_args)
        self.device = self.model_runner.device
        self.vocab_size = model_config.vocab_size
        self.sampler = Sampler(server_args.random_seed, self.device)

    def forward_batch_generation(self, batch: ScheduleBatch, out_cache_loc: torch.Tensor) -> list[int]:
        """Runs the batch and returns one sampled token per request (meaningless for a
        request whose prefill chunk does not reach the end of its prompt)."""
        fb = batch.to_forward_batch(out_cache_loc, self.device)
        logits = self.model_runner.forward(fb).next_token_logits
        info = SamplingBatchInfo.from_reqs(batch.reqs, self.vocab_size, self.device)
        return self.sampler(logits, info).tolist()
