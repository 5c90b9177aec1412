"""The command line of launch_server: ServerArgs' fields as argparse flags, grouped in the
order below, and back."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from srt_lite.server_args import ServerArgs

GROUP_ORDER = [
    "Model", "HTTP server", "Structured outputs", "Memory and scheduling", "Speculative decoding", "Runtime",
    "Multi-node", "Logging",
]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field, in its help group, with its default and choices."""
    groups: dict[str, argparse._ArgumentGroup] = {
        name: parser.add_argument_group(name) for name in GROUP_ORDER
    }
    for f in dataclasses.fields(ServerArgs):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        group = groups[meta["group"]]
        if f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", help=meta["help"])
            continue
        kind = _parse_type(f.type)
        group.add_argument(
            flag,
            type=kind,
            default=f.default,
            choices=meta.get("choices"),
            help=meta["help"] + ("" if f.default is None else " (default: %(default)s)"),
        )


def from_cli_args(args: argparse.Namespace) -> ServerArgs:
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    return ServerArgs(**{n: getattr(args, n) for n in names})


def _parse_type(annotation: Any):
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(
        prog="python -m srt_lite.launch_server",
        description="Serve a model with an SGLang-compatible and OpenAI-compatible HTTP API.",
    )
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return from_cli_args(args)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
