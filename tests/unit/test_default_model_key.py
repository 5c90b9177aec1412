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


def two_copies(tmp_path, monkeypatch, data: bytes) -> tuple[str, str]:
    """`data` as model.gguf in two folders, with the conversion cache under tmp_path."""
    monkeypatch.setenv("SRT_LITE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return write(tmp_path / "a" / "model.gguf", data), write(tmp_path / "b" / "model.gguf", data)


def test_a_copy_elsewhere_shares_the_conversion_and_a_change_does_not(tmp_path, monkeypatch):
    data = random.Random(0).randbytes(5 << 20)
    first, copy = two_copies(tmp_path, monkeypatch, data)
    os.utime(copy, (1_000_000, 1_000_000))
    assert default_model.converted_dir(first) == default_model.converted_dir(copy)
    tail = bytearray(data)
    tail[-1] ^= 1  # the last piece is always read
    assert default_model.converted_dir(write(tmp_path / "b" / "model.gguf", bytes(tail))) != default_model.converted_dir(first)
    assert default_model.converted_dir(write(tmp_path / "b" / "model.gguf", data + b"\0")) != default_model.converted_dir(first)
    middle = bytearray(data)
    middle[len(data) // 2] ^= 1  # the start of the 9th of 16 pieces
    assert default_model.converted_dir(write(tmp_path / "b" / "model.gguf", bytes(middle))) != default_model.converted_dir(first)


def test_the_conversion_reads_the_copy_it_was_last_asked_for(tmp_path, monkeypatch):
    """A conversion shared by two installs records the file of the one that used it last, so
    removing the other install never leaves it without its source."""
    first, second = two_copies(tmp_path, monkeypatch, random.Random(1).randbytes(1 << 20))
    out = default_model.converted_dir(first)
    os.makedirs(out)
    write(os.path.join(out, "config.json"), b"{}")  # as if converted from the first copy
    default_model.write_source(out, first)
    assert default_model.convert_gguf(second) == out
    assert default_model.source_gguf(out) == second
    os.remove(second)
    assert default_model.convert_gguf(first) == out and default_model.source_gguf(out) == first
