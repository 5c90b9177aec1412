"""Every environment variable srt_lite reads, in one place.

Settings a user chooses per server are flags (`ServerArgs`). The variables here are the rest:
where caches live, what the CPU may be assumed to do (it must act before torch starts), and
development hooks that tests and benchmarks use and no user needs. Code reads them through
these accessors only, so this file is the complete list (docs/development.md explains each).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_int(self) -> int:
        value = self.get().strip()
        return int(value) if value else 0

    def is_set(self) -> bool:
        """True for any value but empty and "0"."""
        return self.get().strip() not in ("", "0")


# Where converted models, built C++ ops and torch.compile's cache live.
CACHE_DIR = EnvVar("SRT_LITE_CACHE", "", "cache directory; default ~/.cache/srt_lite")
# Caps the CPU level (avx512, avx2, default) so one machine can test a lesser CPU's paths.
CPU_CAPS = EnvVar("SRT_LITE_CPU_CAPS", "", "cap the CPU level: avx512, avx2 or default")
# The standard OpenMP thread count: when set, each scheduler rank keeps torch's reading of it
# instead of taking its node's cores / ranks.
OMP_NUM_THREADS = EnvVar("OMP_NUM_THREADS", "", "threads per scheduler rank; default: cores / ranks on the node")
# The network interface of gloo's (and NCCL's bootstrap) sockets. Unset, each rank sets it to
# the interface that reaches --dist-init-addr (distributed/rendezvous.py).
GLOO_SOCKET_IFNAME = EnvVar("GLOO_SOCKET_IFNAME", "", "interface for gloo; default: the one reaching --dist-init-addr")
NCCL_SOCKET_IFNAME = EnvVar("NCCL_SOCKET_IFNAME", "", "interface for NCCL's bootstrap; default: as gloo's")
# FlashInfer's float workspace in bytes; default by model family as SGLang sizes it.
FLASHINFER_WORKSPACE_SIZE = EnvVar("SRT_LITE_FLASHINFER_WORKSPACE_SIZE", "", "FlashInfer workspace bytes")

# ---- development hooks ------------------------------------------------------------------
# Do not build or load the C++ CPU ops: runs the pure-torch fallback paths.
DISABLE_CPU_KERNELS = EnvVar("SRT_LITE_DISABLE_CPU_KERNELS", "0", "1: skip the C++ CPU ops")
# Run decode steps through the Python decoder layers, not the C++ stack (models/cpp_decoder.py).
DISABLE_CPP_DECODER = EnvVar("SRT_LITE_DISABLE_CPP_DECODER", "0", "1: keep the Python decoder layers")
# Fault tests: the scheduler raises inside its loop after this many forward steps.
TEST_CRASH_AT_STEP = EnvVar("SRT_LITE_TEST_CRASH_AT_STEP", "0", "raise in the scheduler after N steps")
# benchmarks/replay_steps.py: each forward's rows are appended to this file (JSON lines).
RECORD_STEPS = EnvVar("SRT_LITE_RECORD_STEPS", "", "append each forward step's shape to this file")

ALL = [CACHE_DIR, CPU_CAPS, OMP_NUM_THREADS, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, FLASHINFER_WORKSPACE_SIZE, DISABLE_CPU_KERNELS, DISABLE_CPP_DECODER, TEST_CRASH_AT_STEP, RECORD_STEPS]
