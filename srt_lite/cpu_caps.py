"""What this CPU can do, decided once per process; every CPU fast path asks here.

The levels, from best to most portable:
- `avx512`: AVX-512 F/BW/VL/DQ (ATen's AVX512 kernels); oneDNN runs bf16 here, natively with
  AVX512-BF16 or AMX, emulated without.
- `avx2`: AVX2 + FMA + F16C (most laptops and many cloud VMs); oneDNN refuses bf16 weights here.
- `default`: anything else, ARM included: ATen's portable `at::vec` (NEON on aarch64).

`SRT_LITE_CPU_CAPS=avx2` (or `default`) caps the level below what the CPU has, so that a
better machine runs and tests the lower paths; `avx512` keeps AVX-512 but drops its BF16 and
AMX instructions (a Skylake or Cascade Lake CPU). The variable is also turned into torch's own
knobs (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`) by
`export_forced_env()`, which srt_lite/__init__.py calls before torch is imported, so that
oneDNN refuses what it would refuse on such a CPU and child processes inherit the cap.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform

from srt_lite import envs

logger = logging.getLogger(__name__)

FORCE_ENV = envs.CPU_CAPS.name
_X86 = ("x86_64", "amd64", "AMD64", "i686", "i386")  # platform.machine() names
_ARM = ("aarch64", "arm64")
LEVELS = ("default", "avx2", "avx512")
# torch's, oneDNN's and MKL's names for each level, used when a lower level is forced.
_TORCH_KNOBS = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


@dataclasses.dataclass(frozen=True)
class CpuCaps:
    arch: str  # platform.machine(): x86_64, aarch64, arm64, ...
    level: str  # one of LEVELS: what srt_lite's own vector code is built for
    avx2: bool
    avx512: bool  # F, BW, VL and DQ together
    avx512_bf16: bool
    avx512_vnni: bool  # int8 dot products (vpdpbusd); kept under the avx512 cap (Cascade Lake has them)
    amx_bf16: bool
    arm_bf16: bool  # aarch64 BF16 instructions (Graviton 3, Apple M2 and later)
    onednn_bf16: bool  # oneDNN takes bf16 weights (prepacking, bf16 matmul)
    forced: str | None  # the SRT_LITE_CPU_CAPS cap, if any

    @property
    def is_arm(self) -> bool:
        return self.arch in _ARM

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (not converted to fp32 first)."""
        return self.avx512_bf16 or self.amx_bf16 or self.arm_bf16

    def describe(self) -> str:
        """One line for the start-up banner and /get_server_info."""
        names = [n for n, on in (("avx2", self.avx2), ("avx512", self.avx512), ("avx512_bf16", self.avx512_bf16),
                                 ("avx512_vnni", self.avx512_vnni),
                                 ("amx_bf16", self.amx_bf16), ("arm_bf16", self.arm_bf16)) if on]
        forced = f", capped by {FORCE_ENV}={self.forced}" if self.forced else ""
        return f"{self.arch} {self.level} ({' '.join(names) or 'no vector extensions'}{forced})"


def forced_level() -> str | None:
    value = envs.CPU_CAPS.get().strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError(f"{FORCE_ENV}={value!r}: choose one of {', '.join(LEVELS)}")
    return value


def export_forced_env() -> None:
    """With a forced level, sets torch's own capability knobs (unless the user set them) so
    that ATen, oneDNN and MKL behave as on such a CPU. It must run before torch first
    dispatches a kernel to take effect in this process; children always inherit it."""
    level = forced_level()
    for key, value in _TORCH_KNOBS.get(level or "", {}).items():
        os.environ.setdefault(key, value)


def _cpu_flags() -> set[str]:
    """The kernel's feature flags (x86 `flags`, ARM `Features`); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _onednn_bf16() -> bool:
    """oneDNN's own answer (it also honours ONEDNN_MAX_CPU_ISA)."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def detect(flags: set[str] | None = None, arch: str | None = None, forced: str | None = None,
           onednn_bf16: bool | None = None) -> CpuCaps:
    """The capabilities from CPU flags, capped at `forced`. Arguments stand in for the
    machine in tests; by default they are read from it."""
    flags = _cpu_flags() if flags is None else flags
    arch = platform.machine() if arch is None else arch
    x86 = arch in _X86
    avx2 = x86 and {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    level = "avx512" if avx512 else "avx2" if avx2 else "default"
    if forced is not None and LEVELS.index(forced) < LEVELS.index(level):
        level = forced
    caps = CpuCaps(
        arch=arch,
        level=level,
        avx2=avx2 and level != "default",
        avx512=avx512 and level == "avx512",
        avx512_bf16=level == "avx512" and forced is None and "avx512_bf16" in flags,
        avx512_vnni=level == "avx512" and "avx512_vnni" in flags,
        amx_bf16=level == "avx512" and forced is None and "amx_bf16" in flags,
        arm_bf16=arch in _ARM and "bf16" in flags,
        onednn_bf16=False,
        forced=forced,
    )
    # oneDNN decides for itself (an AVX2 CPU with AVX-NE-CONVERT runs bf16 too); a forced
    # lower level refuses it even if ONEDNN_MAX_CPU_ISA came too late for this process.
    capped = forced is not None and forced != "avx512"
    bf16 = not capped and (_onednn_bf16() if onednn_bf16 is None else onednn_bf16)
    return dataclasses.replace(caps, onednn_bf16=bf16)


# On AVX2, bf16 weights (widened to fp32 as they are read) pay off from about this model size:
# below it batches and prefill are bound by arithmetic more than by reading the weights, and
# fp32 is faster there.
AVX2_BF16_MIN_PARAMS = 500_000_000


def bf16_is_faster(caps: CpuCaps, kernels_built: bool, num_params: int | None = None) -> bool:
    """`--dtype auto` on this CPU: bf16 weights where they were measured faster than fp32
    for a model of `num_params` parameters (None: not known, taken as large) (figures in
    docs/benchmarks.md, "The dtype rule").
    - Native bf16 (AVX512-BF16, AMX; ARM BF16 where oneDNN takes it): oneDNN's bf16 is
      faster at every batch size and in prefill.
    - AVX-512 without BF16: bf16 weights widened as they are read decode faster (half the
      bytes a token) and prefill somewhat slower; decode is most of a chat's time.
    - AVX2: the same for large models; a small one is bound by arithmetic in batches and
      prefill, where the widening costs more than the bytes it saves, and fp32 is faster.
    - Only the portable build (ARM without BF16, x86 before AVX2), or no C++ compiler:
      bf16 is slower or unmeasured, and fp32 stays."""
    if caps.native_bf16 and caps.onednn_bf16:
        return True
    if not kernels_built:
        return False
    if caps.level == "avx512":
        return True
    if caps.level == "avx2":
        return num_params is None or num_params >= AVX2_BF16_MIN_PARAMS
    return False


@functools.lru_cache(maxsize=1)
def get() -> CpuCaps:
    """This process's capabilities (read once)."""
    caps = detect(forced=forced_level())
    logger.debug("CPU capabilities: %s", caps)
    return caps
