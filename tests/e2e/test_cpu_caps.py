"""srt_lite.cpu_caps: what a CPU can do, the SRT_LITE_CPU_CAPS cap, and the rules that read
it (the linear path and `--dtype auto`), for every CPU class from synthetic flags; and that a
capped process really runs the lower paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from srt_lite import cpu_caps
from srt_lite.layers.cpu_linear.paths import (
    PATH_BF16_KERNEL, PATH_F32_PANELS, PATH_PACKED, PATH_PANELS, PATH_TORCH, PATH_WIDE_PANELS, cpu_linear_path,
)

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}
ZEN4 = AVX512 | {"avx512_bf16"}


def caps(flags: set[str], arch: str = "x86_64", forced: str | None = None, onednn: bool = True) -> cpu_caps.CpuCaps:
    return cpu_caps.detect(flags=flags, arch=arch, forced=forced, onednn_bf16=onednn)


# (name, caps, kernels built) -> (bf16 linear path, auto dtype is bf16, fp32 linear path). The
# measured classes are in docs/benchmarks.md ("The dtype rule"); the others follow what runs.
CLASSES = [
    ("AVX-512 with BF16/AMX", caps(SAPPHIRE_RAPIDS), True, PATH_PANELS, True, PATH_F32_PANELS),
    ("the same, no compiler", caps(SAPPHIRE_RAPIDS), False, PATH_PACKED, True, PATH_TORCH),
    ("AVX-512 with BF16, no AMX", caps(ZEN4), True, PATH_PANELS, True, PATH_F32_PANELS),
    ("the same, no compiler", caps(ZEN4), False, PATH_PACKED, True, PATH_TORCH),
    ("AVX-512 with BF16 capped at AVX-512", caps(ZEN4, forced="avx512"), True, PATH_WIDE_PANELS, True, PATH_F32_PANELS),
    ("AVX-512 without BF16", caps(AVX512), True, PATH_WIDE_PANELS, True, PATH_F32_PANELS),
    ("AVX-512 without BF16, no compiler", caps(AVX512), False, PATH_PACKED, False, PATH_TORCH),
    ("AVX2 (oneDNN refuses bf16)", caps(AVX2, onednn=False), True, PATH_WIDE_PANELS, True, PATH_F32_PANELS),
    ("AVX2, no compiler", caps(AVX2, onednn=False), False, PATH_TORCH, False, PATH_TORCH),
    ("AMX machine capped at AVX2", caps(SAPPHIRE_RAPIDS, forced="avx2"), True, PATH_WIDE_PANELS, True, PATH_F32_PANELS),
    ("AMX machine capped at AVX-512", caps(SAPPHIRE_RAPIDS, forced="avx512"), True, PATH_WIDE_PANELS, True, PATH_F32_PANELS),
    ("ARM with BF16", caps({"fp", "asimd", "bf16", "sve"}, arch="aarch64"), True, PATH_PACKED, True, PATH_TORCH),
    ("ARM without BF16", caps({"fp", "asimd"}, arch="aarch64", onednn=False), True, PATH_BF16_KERNEL, False, PATH_TORCH),
    ("x86 before AVX2", caps({"sse4_2", "avx"}, onednn=False), True, PATH_BF16_KERNEL, False, PATH_TORCH),
]


@pytest.mark.parametrize("name,c,built,path,bf16,fp32_path", CLASSES, ids=[c[0] for c in CLASSES])
def test_linear_path_and_auto_dtype_per_cpu_class(name, c, built, path, bf16, fp32_path):
    """auto for a large model (1.2B parameters, or not known); small models below."""
    assert cpu_linear_path(torch.bfloat16, caps=c, kernels_built=built) == path
    assert cpu_caps.bf16_is_faster(c, built) == bf16
    assert cpu_caps.bf16_is_faster(c, built, 1_200_000_000) == bf16
    # fp32 takes the fp32 panels where the ops are built for AVX2 or AVX-512; fp16 weights,
    # or packing switched off, always take F.linear.
    assert cpu_linear_path(torch.float32, caps=c, kernels_built=built) == fp32_path
    assert cpu_linear_path(torch.float16, caps=c, kernels_built=built) == PATH_TORCH
    for dtype in (torch.bfloat16, torch.float32):
        assert cpu_linear_path(dtype, disable_packing=True, caps=c, kernels_built=built) == PATH_TORCH


def test_amx_cpu_without_the_amx_op_keeps_onednn():
    """An AMX CPU whose build of the ops lacks the AMX panel op (or whose OS does not grant
    the tiles) keeps oneDNN's AMX kernels rather than the AVX-512 panels."""
    c = caps(SAPPHIRE_RAPIDS)
    assert cpu_linear_path(torch.bfloat16, caps=c, kernels_built=True, amx_built=False) == PATH_PACKED
    assert cpu_linear_path(torch.bfloat16, caps=c, kernels_built=True, amx_built=True) == PATH_PANELS
    assert cpu_linear_path(torch.bfloat16, caps=caps(ZEN4), kernels_built=True, amx_built=False) == PATH_PANELS


def test_auto_dtype_for_a_small_model_on_avx2_is_fp32():
    """On AVX2 a 135M model is bound by arithmetic, where fp32 was faster; every other
    class decides as for a large model."""
    small = 135_000_000
    assert not cpu_caps.bf16_is_faster(caps(AVX2, onednn=False), True, small)
    assert cpu_caps.bf16_is_faster(caps(AVX2, onednn=False), True, cpu_caps.AVX2_BF16_MIN_PARAMS)
    assert cpu_caps.bf16_is_faster(caps(AVX512), True, small)
    assert cpu_caps.bf16_is_faster(caps(SAPPHIRE_RAPIDS), True, small)


def test_levels_from_flags_and_the_cap():
    assert caps(SAPPHIRE_RAPIDS).level == "avx512" and caps(SAPPHIRE_RAPIDS).native_bf16
    assert caps(AVX512).level == "avx512" and not caps(AVX512).native_bf16
    assert caps(AVX2).level == "avx2" and not caps(AVX2).avx512
    assert caps(AVX2 - {"fma"}).level == "default"  # AVX2 without FMA is not ATen's AVX2
    arm = caps({"fp", "asimd", "bf16"}, arch="aarch64")
    assert arm.level == "default" and arm.is_arm and not arm.avx2 and arm.native_bf16
    capped = caps(SAPPHIRE_RAPIDS, forced="avx2")
    assert capped.level == "avx2" and not capped.avx512 and not capped.native_bf16 and not capped.onednn_bf16
    assert "capped by SRT_LITE_CPU_CAPS=avx2" in capped.describe()
    assert caps(SAPPHIRE_RAPIDS, forced="default").level == "default"
    no_bf16 = caps(SAPPHIRE_RAPIDS, forced="avx512")
    assert no_bf16.level == "avx512" and no_bf16.avx512 and not no_bf16.native_bf16
    assert caps(AVX2, onednn=False, forced="avx512").level == "avx2"  # a cap never raises the level
    assert caps(set()).describe() == "x86_64 default (no vector extensions)"


def test_a_bad_cap_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_caps.FORCE_ENV, "avx9000")
    with pytest.raises(ValueError, match="choose one of default, avx2, avx512"):
        cpu_caps.forced_level()


@pytest.mark.cpu_caps
def test_this_machine_matches_its_cpuinfo():
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    got = cpu_caps.get()
    forced = cpu_caps.forced_level()
    want = cpu_caps.detect(flags=flags, forced=forced, onednn_bf16=got.onednn_bf16)
    assert got == want
    if forced in ("avx2", "default"):
        assert not got.onednn_bf16 and got.level in ("avx2", "default")


def test_the_cap_reaches_torch_and_onednn_in_a_child_process():
    """SRT_LITE_CPU_CAPS=avx2 on any CPU: importing srt_lite sets ATen's and oneDNN's caps
    before torch runs a kernel, so ATen reports AVX2 (or less) and oneDNN takes no bf16
    weights, as on a real AVX2 machine."""
    code = (
        "import srt_lite, torch\n"
        "from srt_lite import cpu_caps\n"
        "print(torch.backends.cpu.get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported(), "
        "cpu_caps.get().level)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env[cpu_caps.FORCE_ENV] = "avx2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    aten, onednn_bf16, level = out.stdout.split()
    assert aten in ("AVX2", "DEFAULT") and onednn_bf16 == "False" and level in ("avx2", "default")
