"""The C++ CPU ops (srt_lite/csrc/*.cpp), built on first use.

torch.utils.cpp_extension compiles them with the machine's C++ compiler (the one inductor's
C++ wrapper uses) into the srt_lite cache, once per machine and torch version, and
registers `torch.ops.srt_lite_cpu.*`: the attention backend's cascade step and prompt
attention, the compiled graph's packed linear, the linears' panel products (AVX-512 and
AMX), a decoder layer's elementwise ops (RMSNorm, RoPE, SiLU-and-mul), the GGUF products and
the sampler's greedy pick.
Without a compiler, or with SRT_LITE_DISABLE_CPU_KERNELS=1, `load()` returns False and the
callers keep their torch ops.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from srt_lite import cpu_caps
from srt_lite import envs
from srt_lite.utils import cache_root

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [os.path.join(_CSRC, name) for name in ("cpu_attention.cpp", "cpu_prompt_attention.cpp", "cpu_linear.cpp",
                                                  "cpu_amx_linear.cpp", "cpu_int4_linear.cpp", "cpu_prefix_attention.cpp",
                                                  "cpu_norm_rope.cpp", "cpu_decoder.cpp", "cpu_gguf_linear.cpp",
                                                  "cpu_sampling.cpp")]
# Headers the sources include: not compiled on their own, but part of the build's identity.
HEADERS = [os.path.join(_CSRC, name) for name in ("cpu_amx.h", "cpu_attention_common.h", "cpu_int4.h", "cpu_ops.h",
                                                  "cpu_prefix_attention.h")]
_loaded: bool | None = None
# Compiler flags by CPU level (srt_lite.cpu_caps), so at::vec in the sources gets the vector
# width ATen's own kernels use on this CPU (as ATen builds its AVX2 and AVX-512 kernels).
# Without an entry (ARM and other CPUs) at::vec is its portable version, which is NEON on
# aarch64. The level is part of the build directory's name, so a forced lower level builds
# its own copy.
VEC_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


def load() -> bool:
    """True once the op is registered in this process (built or found in the cache)."""
    global _loaded
    if _loaded is None:
        _loaded = _build()
    return _loaded


def _build() -> bool:
    if envs.DISABLE_CPU_KERNELS.is_set():
        return False
    t0 = time.perf_counter()
    level = cpu_caps.get().level
    try:
        # One folder per build (torch, CPU level, flags, sources and their place): two
        # installs of srt_lite on one machine each keep their own copy instead of rebuilding
        # each other's.
        build_dir = os.path.join(cache_root(), "torch_extensions", f"cpu_ops-{build_tag()}")
        built = os.path.join(build_dir, "srt_lite_cpu.so")
        if os.path.exists(built) and not os.path.exists(os.path.join(build_dir, "lock")):
            # A finished build of these very sources and flags (the folder's name says so):
            # cpp_extension.load would import setuptools and run ninja to learn that, a part
            # of every start, and rebuild a source whose text is the same but whose mtime moved.
            torch.ops.load_library(built)
        else:
            from torch.utils import cpp_extension

            _ninja_on_path()
            os.makedirs(build_dir, exist_ok=True)
            cpp_extension.load(
                name="srt_lite_cpu", sources=SOURCES, build_directory=build_dir,
                extra_cflags=_cflags(level), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
            )
    except Exception as e:  # no compiler or ninja: the torch ops path is always there
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning("C++ CPU kernels unavailable, using torch ops (%s)", reason)
        return False
    # The one kernel that picks its instructions in C++ (the cascade's shared prefix) hears
    # what SRT_LITE_CPU_CAPS leaves it.
    caps = cpu_caps.get()
    torch.ops.srt_lite_cpu.allow_prefix_kernels(caps.amx_bf16, caps.avx512_bf16)
    torch.ops.srt_lite_cpu.gguf_allow_vnni(caps.avx512_vnni)
    logger.info("C++ CPU kernels (%s) loaded in %.1f s", level, time.perf_counter() - t0)
    return True


@functools.cache
def bf16_dots_available() -> bool:
    """Whether the ops' AVX512-BF16 dot products run here: in the CPU (not capped by
    SRT_LITE_CPU_CAPS) and in this build of the ops (checked by the op itself)."""
    return cpu_caps.get().avx512_bf16 and load() and torch.ops.srt_lite_cpu.bf16_gemv_supported()


def _cflags(level: str) -> list[str]:
    # -ffp-contract=off: the elementwise ops round each product as the torch ops they replace
    # do; a fused multiply-add would skip a rounding (the vector kernels call their FMAs
    # explicitly).
    return ["-O3", "-fopenmp", "-ffp-contract=off", *VEC_FLAGS.get(level, [])]


def build_tag() -> str:
    """Names this build of the ops: torch version, CPU level and a hash of the flags, the
    sources and their folder."""
    import hashlib

    digest = hashlib.sha256(_CSRC.encode())
    digest.update(" ".join(_cflags(cpu_caps.get().level)).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"torch{torch.__version__}-{cpu_caps.get().level}-{digest.hexdigest()[:12]}"


def use_private_inductor_cache() -> None:
    """Points inductor's cache at a folder of this build of the ops (unless the user chose
    one with TORCHINDUCTOR_CACHE_DIR). A compiled graph calls the ops by name from generated
    C++, and inductor's cache keys know nothing of the ops' build: a graph compiled against
    another build (another version of srt_lite, another CPU level) must not be loaded.
    Importing inductor sets the variable to its default, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root(), "inductor", build_tag())


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's binary is in the venv, which
    is not on PATH when the server is started as .venv/bin/python."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def eager_cpu(x: torch.Tensor) -> bool:
    """Whether an eager op on x can take a C++ elementwise op: a CPU tensor outside a traced
    graph (inductor fuses the torch ops there itself), with the ops built."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and load()
