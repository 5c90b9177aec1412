"""No function in srt_lite/csrc/ runs over MAX_LINES lines: a kernel that long mixes
checking, planning and the loops themselves, and is hard to read or change safely.

Read from the source with a small brace matcher (no compiler needed): comments, string and
character literals are blanked, of each preprocessor conditional only the first branch is
kept (a function's other branches repeat its braces), and every `{` at namespace or class
scope is classified by the text before it: `namespace` / `extern "C"` and class bodies are
scopes to look into, enums and `= {` initialisers are skipped, and anything else with a
parameter list is a function definition (templates, attributes, multi-line signatures and
macros such as TORCH_LIBRARY included). A function's length runs from the first line of
its declaration to its closing brace.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
CSRC = ROOT / "srt_lite" / "csrc"
MAX_LINES = 80


class Function(NamedTuple):
    name: str
    first: int  # 1-based line of the declaration's start
    last: int  # line of the closing brace

    @property
    def lines(self) -> int:
        return self.last - self.first + 1


def blank_literals(src: str) -> str:
    """Comments, strings and character literals become spaces (newlines kept, so line
    numbers stay)."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a: int, b: int) -> None:
        for j in range(a, b):
            if out[j] != "\n":
                out[j] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif (m := re.compile(r'R"([^()\s]{0,16})\(').match(src, i)) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = src.find(")" + m.group(1) + '"', m.end())
            j = n if end < 0 else end + len(m.group(1)) + 2
            blank(i, j)
            i = j
        elif c in "\"'":
            # A quote inside a number is a digit separator (1'000, 0xff'ff), not a literal.
            if c == "'" and _in_number(src, i):
                i += 1
                continue
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            blank(i, min(j + 1, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _in_number(src: str, i: int) -> bool:
    start = i
    while start > 0 and (src[start - 1].isalnum() or src[start - 1] in "_'"):
        start -= 1
    return start < i and src[start].isdigit()


def first_branches(src: str) -> str:
    """Preprocessor lines become blank, and so do the #elif / #else branches of every
    conditional (continued lines included)."""
    lines = src.split("\n")
    skipping: list[bool] = []  # per open conditional: whether its current branch is dropped
    continued = False
    for k, line in enumerate(lines):
        stripped = line.strip()
        if continued or stripped.startswith("#"):
            directive = re.match(r"#\s*(\w+)", stripped)
            word = directive.group(1) if directive and not continued else ""
            if word in ("if", "ifdef", "ifndef"):
                skipping.append(False)
            elif word in ("elif", "else", "elifdef", "elifndef") and skipping:
                skipping[-1] = True
            elif word == "endif" and skipping:
                skipping.pop()
            continued = line.rstrip().endswith("\\")
            lines[k] = ""
        elif any(skipping):
            lines[k] = ""
    return "\n".join(lines)


def _depth0(text: str, chars: str) -> bool:
    """Whether one of `chars` occurs in text outside parentheses and angle-free brackets."""
    depth = 0
    for c in text:
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c in chars:
            return True
    return False


def functions(src: str) -> list[Function]:
    """The function definitions of one C++ source, at any namespace or class depth."""
    text = first_branches(blank_literals(src))
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line_of(pos: int) -> int:
        lo, hi = 0, len(line_starts)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if line_starts[mid] <= pos:
                lo = mid
            else:
                hi = mid
        return lo + 1

    found: list[Function] = []
    # Scopes whose direct contents are declarations: each holds where its current declaration
    # began (after the last `;`, `{` or `}` at that scope).
    decl_start = [0]
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == ";":
            decl_start[-1] = i + 1
        elif c == "}":
            decl_start.pop()
            if not decl_start:
                raise ValueError(f"unbalanced '}}' on line {line_of(i)}")
            decl_start[-1] = i + 1
        elif c == "{":
            header = text[decl_start[-1] : i]
            head = re.sub(r"^\s*template\s*<[^{;]*?>\s*", "", header)  # the template's own <...> may hold ( )
            head = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", head, flags=re.S)
            if re.match(r"\s*(namespace\b|extern\s*$)", head) or re.match(r"\s*(typedef\s+)?(struct|class|union)\b", head):
                decl_start.append(i + 1)  # look inside
            elif re.search(r"\)[^;]*?(?<!:):(?!:).*\w\s*$", head, flags=re.S) and "(" in head:
                i = _matching_brace(text, i)  # a braced member initialiser: the body comes after it
            else:
                close = _matching_brace(text, i)
                is_function = "(" in head and not re.match(r"\s*enum\b", head) and not _depth0(head, "=")
                if is_function:
                    start = decl_start[-1] + len(header) - len(header.lstrip())
                    name = re.findall(r"([~\w:]+)\s*\(", head.split("(")[0] + "(")
                    found.append(Function(name[-1] if name else head.strip()[:40], line_of(start), line_of(close)))
                decl_start[-1] = close + 1
                i = close
        i += 1
    if len(decl_start) != 1:
        raise ValueError("unbalanced '{': a scope is never closed")
    return found


def _matching_brace(text: str, i: int) -> int:
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced '{'")


SOURCES = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_long_functions(path: Path):
    long = [f"{path.name}:{f.first} {f.name} ({f.lines} lines)" for f in functions(path.read_text()) if f.lines > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines: " + ", ".join(long)


def test_sources_found():
    assert SOURCES and all(functions(p.read_text()) for p in SOURCES if p.suffix == ".cpp")


# ---- the checker itself ---------------------------------------------------------------------

SAMPLE = """\
#include <x.h>
namespace outer {
namespace {
// a { in a comment
constexpr int kTable[] = {1, 2, 3};
enum class Kind { kA, kB };
struct S {
  S(int a) : a_(a), b_{a} {}
  int get() const { return 1'000; }
  int a_, b_;
};
template <int N, typename = std::enable_if_t<(N > 0)>>
__attribute__((target("avx512f"))) void kernel(
    const float* x,
    int n) {
  const char* s = "}{";
  char c = '{';
  auto f = [&](int i) { return i; };
#if defined(FAST)
  for (int i = 0; i < n; ++i) {
#else
  for (int i = n - 1; i >= 0; --i) {
#endif
    f(i);
  }
}
}  // namespace
int after(int a) { return a; }
}  // namespace outer
TORCH_LIBRARY(lib, m) {
  m.def("f() -> ()");
}
"""


def test_checker_finds_definitions():
    found = {f.name: (f.first, f.last) for f in functions(SAMPLE)}
    assert found == {"S": (8, 8), "get": (9, 9), "kernel": (12, 26), "after": (28, 28), "TORCH_LIBRARY": (30, 32)}


def test_checker_counts_long_function():
    body = "\n".join(f"  x += {k};" for k in range(MAX_LINES))
    long = functions("namespace a {\nint f(int x,\n      int y) {\n" + body + "\n  return x;\n}\n}\n")
    assert [(f.name, f.lines) for f in long] == [("f", MAX_LINES + 4)]
