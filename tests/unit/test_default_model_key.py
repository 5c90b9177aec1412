"""The converted default model's cache key (model_loader/default_model.py) follows the GGUF
file's contents: a copy elsewhere, with another mtime (a new venv), finds the same conversion;
a file that differs anywhere in its sampled pieces or its size does not."""

from __future__ import annotations

import os
import random

from srt_lite.model_loader import default_model


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_a_copy_elsewhere_shares_the_conversion_and_a_change_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("SRT_LITE_CACHE", str(tmp_path / "cache"))
    data = random.Random(0).randbytes(5 << 20)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write(tmp_path / "a" / "model.gguf", data)
    copy = write(tmp_path / "b" / "model.gguf", data)
    os.utime(copy, (1_000_000, 1_000_000))
    assert default_model.converted_dir(first) == default_model.converted_dir(copy)
    tail = bytearray(data)
    tail[-1] ^= 1  # the last piece is always read
    assert default_model.converted_dir(write(tmp_path / "b" / "model.gguf", bytes(tail))) != default_model.converted_dir(first)
    assert default_model.converted_dir(write(tmp_path / "b" / "model.gguf", data + b"\0")) != default_model.converted_dir(first)
    middle = bytearray(data)
    middle[len(data) // 2] ^= 1  # the start of the 9th of 16 pieces
    assert default_model.converted_dir(write(tmp_path / "b" / "model.gguf", bytes(middle))) != default_model.converted_dir(first)
