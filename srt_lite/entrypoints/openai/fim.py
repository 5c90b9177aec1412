"""Fill-in-the-middle: /v1/completions with `suffix` asks for the text between `prompt` and
`suffix`, which code models are trained to write when both are framed by their FIM tokens.

A template is three tokens and where the middle token goes (SGLang's `--completion-template`
names and JSON layout): prefix-suffix-middle (`fim_position` END: begin, prefix, end, suffix,
middle; StarCoder, Qwen2.5-Coder) or prefix-middle-suffix (MIDDLE: begin, prefix, middle,
suffix, end; DeepSeek-Coder). Without the flag the template is detected from the tokenizer:
the first built-in one whose three tokens it has.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FimTemplate:
    name: str
    begin: str
    middle: str
    end: str
    middle_last: bool  # fim_position END: the middle token closes the prompt

    def render(self, prefix: str, suffix: str) -> str:
        if self.middle_last:
            return f"{self.begin}{prefix}{self.end}{suffix}{self.middle}"
        return f"{self.begin}{prefix}{self.middle}{suffix}{self.end}"


BUILTIN = {
    "qwen_coder": FimTemplate("qwen_coder", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", True),
    "star_coder": FimTemplate("star_coder", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", True),
    "deepseek_coder": FimTemplate("deepseek_coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", False),
}


def load_template(arg: str) -> FimTemplate:
    """A built-in name, or a JSON file with `fim_begin_token`, `fim_middle_token`,
    `fim_end_token` and `fim_position` ("END" or "MIDDLE")."""
    if arg in BUILTIN:
        return BUILTIN[arg]
    if not os.path.isfile(arg):
        raise ValueError(f"--completion-template {arg!r} is neither a built-in template ({', '.join(BUILTIN)}) nor a file")
    with open(arg) as f:
        spec: dict[str, Any] = json.load(f)
    try:
        position = str(spec.get("fim_position", "END")).upper()
        if position not in ("END", "MIDDLE"):
            raise ValueError(f'fim_position must be "END" or "MIDDLE", got {position!r}')
        return FimTemplate(spec.get("name", os.path.basename(arg)), spec["fim_begin_token"], spec["fim_middle_token"],
                           spec["fim_end_token"], position == "END")
    except KeyError as e:
        raise ValueError(f"--completion-template {arg}: missing {e.args[0]}") from None


def single_tokens(tokenizer: Any, template: FimTemplate) -> bool:
    """Whether the tokenizer reads each of the template's tokens as one token of its own."""
    return all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in (template.begin, template.middle, template.end))


def resolve_template(tokenizer: Any, arg: str | None) -> FimTemplate | None:
    """The server's FIM template: the flag's (its tokens must be the tokenizer's), else the
    first built-in one the tokenizer has, else None (suffix is then refused)."""
    if arg is not None:
        template = load_template(arg)
        if not single_tokens(tokenizer, template):
            raise ValueError(f"--completion-template {arg}: the tokenizer does not have "
                             f"{template.begin!r}, {template.middle!r} and {template.end!r} as tokens of their own")
        return template
    vocab = tokenizer.get_vocab()
    for template in BUILTIN.values():
        if all(t in vocab for t in (template.begin, template.middle, template.end)) and single_tokens(tokenizer, template):
            return template
    return None
