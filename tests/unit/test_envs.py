"""Every environment variable srt_lite reads is declared in srt_lite/envs.py and documented."""

from __future__ import annotations

import re
from pathlib import Path

from srt_lite import envs

ROOT = Path(__file__).resolve().parents[2]


def test_only_envs_py_names_srt_lite_variables():
    named = {}
    for path in (ROOT / "srt_lite").rglob("*.py"):
        if path.name != "envs.py":
            found = set(re.findall(r"SRT_LITE_[A-Z0-9_]+", path.read_text()))
            if found:
                named[str(path.relative_to(ROOT))] = found
    # Comments and messages may mention a variable; reading one goes through envs.
    reads = {
        p: [line for line in (ROOT / p).read_text().splitlines() if "environ" in line and "SRT_LITE_" in line]
        for p in named
    }
    assert {p: r for p, r in reads.items() if r} == {}


def test_every_variable_is_documented_and_unique():
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names))
    dev = (ROOT / "docs" / "development.md").read_text()
    assert [n for n in names if f"`{n}" not in dev] == []


def test_accessors(monkeypatch):
    monkeypatch.setenv(envs.TEST_CRASH_AT_STEP.name, "7")
    assert envs.TEST_CRASH_AT_STEP.get_int() == 7
    monkeypatch.setenv(envs.TEST_CRASH_AT_STEP.name, "")
    assert envs.TEST_CRASH_AT_STEP.get_int() == 0
    monkeypatch.setenv(envs.DISABLE_CPU_KERNELS.name, "0")
    assert not envs.DISABLE_CPU_KERNELS.is_set()
    monkeypatch.setenv(envs.DISABLE_CPU_KERNELS.name, "1")
    assert envs.DISABLE_CPU_KERNELS.is_set()
    monkeypatch.delenv(envs.DISABLE_CPU_KERNELS.name)
    assert not envs.DISABLE_CPU_KERNELS.is_set()
