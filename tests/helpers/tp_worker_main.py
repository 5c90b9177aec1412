"""Run by test_tensor_parallel in one process per TP rank: prefill + greedy decode of a tiny
model through ModelRunner, saving rank 0's logits."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from model_harness import Harness  # noqa: E402
from srt_lite.distributed.parallel_state import exit_together, init_distributed  # noqa: E402
from srt_lite.model_config import ModelConfig  # noqa: E402
from srt_lite.model_executor.model_runner import ModelRunner  # noqa: E402
from srt_lite.server_args import ServerArgs  # noqa: E402

PROMPTS = [[5, 17, 42, 8, 99, 3, 250], [7, 7, 7, 120], list(range(10, 40))]


def main(model_dir: str, rank: int, tp: int, port: int, out: str, steps: int) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, tp, "cpu", f"127.0.0.1:{port}")
    runner = ModelRunner(ModelConfig.load(model_dir), ServerArgs(dtype="float32", max_total_tokens=1024, tp_size=tp))
    h = Harness(runner)
    first = h.prefill(PROMPTS)
    logits = [first.all_logits]
    step = first.next_token_logits
    tokens = []
    for _ in range(steps):
        nxt = step.argmax(-1).tolist()
        tokens.append(nxt)
        step = h.decode(nxt)
        logits.append(step)
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens}, out)
    exit_together(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
    # The rank's result is its file, written and the group left above. Skip the interpreter's
    # teardown: a C++ thread still joinable in a static destructor there (gloo's) has aborted a
    # rank now and then ("terminate called without an active exception"), which says nothing
    # about the logits under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
