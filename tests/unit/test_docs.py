"""The documentation cannot rot: its code runs, its reference is complete, its tables
match the code.

* **Every Python block** of ``README.md`` and ``docs/**/*.md`` is a test (a small
  collector, here, rather than a pytest plugin: it runs under the README's test command
  with nothing but the ``[test]`` extra, on every Python CI covers).  A block runs as a
  script, in this process, as a fresh module.  The line right above its fence may
  mark it (an HTML comment, invisible on the site):

  ``<!-- docs-test: skip (REASON) -->``
      a fragment, or a block that needs processes, another host, a GPU or a port: it is
      compiled (top-level ``await`` allowed), so its syntax is still checked, and
      skipped with REASON;
  ``<!-- docs-test: needs torch -->`` (or any modules, comma-separated)
      runs where they can be imported, skips (naming the missing one) where not.

  Any other ``docs-test`` comment is an error, and so is a skip without a reason.
* **The reference** (``docs/reference/``) documents every name of ``ringwire.__all__``,
  ``ringwire.runtime.__all__``, ``ringwire.metrics.__all__`` and ``ringwire.wire.__all__``.
* **The wire-format page**'s Ext table has one row per ``ringwire.wire.ExtCode``.

The site itself is built by ``mkdocs build --strict`` in CI (``.ci/run``), which fails
on a broken link, a missing reference target or any warning.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest

import ringwire
from ringwire import metrics, runtime, wire
from tests.support.extras import NO_TORCH, torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<what>.*?)\s*-->")


class Block(NamedTuple):
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    mark: str  # "" (run), "skip (reason)" or "needs torch"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```` ```python ```` blocks of one Markdown file (fences may be indented, as in
    a tab or a list item: the block is dedented by the fence's indent)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = m.group("indent")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path}:{start + 1}: a ```python block is never closed")
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = _MARK.search(prev)
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", mark.group("what") if mark else ""))
        i += 1
    return blocks


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


BLOCKS = [b for f in _markdown_files() for b in python_blocks(f)]


def test_the_collector_finds_the_blocks_and_their_marks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip (needs a GPU) -->\n"
        "```python\nawait y\n```\n\n=== \"tab\"\n\n    <!-- docs-test: needs torch -->\n"
        "    ```python\n    import torch\n    if True:\n        z = 2\n    ```\n"
    )
    got = [(b.line, b.code, b.mark) for b in python_blocks(page)]
    assert got == [
        (3, "x = 1\n", ""),
        (8, "await y\n", "skip (needs a GPU)"),
        (15, "import torch\nif True:\n    z = 2\n", "needs torch"),
    ]
    assert len(BLOCKS) >= 20  # the README's and the guide's: a broken collector finds none
    assert any(b.path.name == "README.md" for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_python_block(block: Block) -> None:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code = compile(block.code, block.name, "exec", flags=flags)  # syntax, always
    if block.mark.startswith("skip"):
        reason = re.fullmatch(r"skip \((.+)\)", block.mark)
        assert reason, f"{block.name}: a skipped block says why: <!-- docs-test: skip (WHY) -->"
        pytest.skip(f"{block.name}: {reason.group(1)}")
    if block.mark.startswith("needs "):
        for module in (m.strip() for m in block.mark[len("needs ") :].split(",")):
            if module == "torch" and torch is None:
                pytest.skip(NO_TORCH)
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{block.name}: needs {module}, which is not installed")
    elif block.mark:
        raise AssertionError(f"{block.name}: unknown mark <!-- docs-test: {block.mark} -->")
    assert not code.co_flags & inspect.CO_COROUTINE, (
        f"{block.name}: a top-level await cannot run as a script: wrap it in anyio.run, "
        "or mark the block <!-- docs-test: skip (WHY) -->"
    )
    # a module of its own, registered while it runs: msgspec (a Record's annotations)
    # and dataclasses resolve names through sys.modules[cls.__module__]
    module = types.ModuleType(f"_docs_block_{block.line}")
    module.__file__ = str(block.path)
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _documented() -> set[str]:
    """Every ``::: dotted.name`` of the reference pages, and the names its errors page
    lists by hand (anyio's exceptions, which ringwire re-exports)."""
    names: set[str] = set()
    for page in (DOCS / "reference").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        names |= set(re.findall(r"^::: ([\w.]+)$", text, re.M))
        names |= {f"ringwire.{n}" for n in re.findall(r"^\| `ringwire\.(\w+)` \|", text, re.M)}
    # runtime/ is documented under the name griffe finds it by (the folder of the
    # repository); it installs as ringwire.runtime
    return {n.replace("runtime.", "ringwire.runtime.", 1) if n.startswith("runtime.") else n for n in names}


@pytest.mark.parametrize(
    "module", [ringwire, runtime, metrics, wire], ids=lambda m: m.__name__
)
def test_the_reference_documents_every_public_name(module: object) -> None:
    documented = _documented()
    missing = [
        name
        for name in module.__all__  # type: ignore[attr-defined]
        if f"{module.__name__}.{name}" not in documented  # type: ignore[attr-defined]
    ]
    assert not missing, f"not in docs/reference/*.md (add a '::: {module.__name__}.NAME' line): {missing}"  # type: ignore[attr-defined]


def test_the_wire_format_page_lists_every_ext_code() -> None:
    text = (DOCS / "design" / "wire-format.md").read_text(encoding="utf-8")
    rows = {int(n) for n in re.findall(r"^\| (\d+) \|", text, re.M)}
    codes = {int(c) for c in wire.ExtCode}
    assert rows == codes, f"Ext table rows {sorted(rows)} != ExtCode {sorted(codes)}"
