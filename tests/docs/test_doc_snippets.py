"""The shell and Python examples of README.md and docs/ run as written, or say why they cannot.

Every fenced block whose language is bash, sh, shell, console or python carries a marker on the
line right before its opening fence (docs/testing.md, "Runnable examples in the docs"):

- ``<!-- run -->``: run here. A page's run blocks share one temporary directory, in order; shell
  blocks run in ``bash -euo pipefail`` with this virtualenv's ``bin`` first on ``PATH`` (a console
  block: its ``$ `` lines), Python blocks in this process, one namespace per page, with that
  directory as the working directory.
- ``<!-- not-run: REASON -->``: not run; the reason says what it needs (a server, a GPU, vLLM) or
  why it is not a whole program.

An unmarked block, an empty reason or a marker without a block fails the test, and so does a run
block that fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LANGUAGES = {"bash", "sh", "shell", "console", "python"}
SHELLS = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^\s*<!--\s*(run|not-run)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "run", "not-run" or None
    reason: str


def parse(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page in the languages above, and the problems of its markers."""
    lines = text.split("\n")
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        marker = MARKER.match(lines[i])
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            problems.append(f"{page}:{i + 1}: a marker that is not right before a fence")
        if not m:
            i += 1
            continue
        indent, fence, language = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        if language not in LANGUAGES:
            continue
        previous = MARKER.match(lines[start - 1]) if start > 0 else None
        kind, reason = (previous.group(1), (previous.group(2) or "").strip()) if previous else (None, "")
        if kind == "not-run" and not reason:
            problems.append(f"{page}:{start + 1}: `not-run` without a reason")
        blocks.append(Block(page, start + 1, language, "\n".join(body) + "\n", kind, reason))
    return blocks, problems


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in pages():
        b, p = parse(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
        blocks += b
        problems += p
    return blocks, problems


def run_block(block: Block, workdir: Path, namespace: dict) -> None:
    """Run one block in ``workdir``; raise AssertionError naming the block if it fails."""
    where = f"{block.page}:{block.line}"
    if block.language in SHELLS:
        code = block.code
        if block.language == "console":
            code = "\n".join(line[2:] for line in code.split("\n") if line.startswith("$ ")) + "\n"
        env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
        env.pop("DCR_ORCHESTRATOR", None)
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=workdir, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{where}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        return
    old = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(block.code, where, "exec"), namespace)  # the docs' own examples
    except Exception as exc:  # re-raised as this block's failure
        raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc
    finally:
        os.chdir(old)


BLOCKS, PROBLEMS = all_blocks()
RUN_PAGES = sorted({b.page for b in BLOCKS if b.marker == "run"})


def test_every_block_is_run_or_marked_not_run():
    unmarked = [f"{b.page}:{b.line}: a {b.language} block with no marker (<!-- run --> or <!-- not-run: REASON -->)"
                for b in BLOCKS if b.marker is None]
    assert not unmarked + PROBLEMS, "\n".join(unmarked + PROBLEMS)
    # the README's quickstart and the Python API in one process are among what runs
    assert "README.md" in RUN_PAGES and "docs/getting-started/quickstart.md" in RUN_PAGES


def _left_behind(page: str):
    """What a page's run blocks leave, checked after them: a check of the working directory, or None."""
    if page == "docs/guides/vllm-fleets.md":  # the model directory its servers start on
        from tests.docs.test_server_command import check_model_directory

        return lambda workdir: check_model_directory(str(workdir / "serve"))
    return None


@pytest.mark.parametrize("page", RUN_PAGES)
def test_run_blocks_of_page(page, tmp_path):
    namespace = {"__name__": "__doc_snippet__"}
    for block in (b for b in BLOCKS if b.page == page and b.marker == "run"):
        run_block(block, tmp_path, namespace)
    check = _left_behind(page)
    if check is not None:
        check(tmp_path)


def test_the_checks_fail_on_an_unmarked_block_and_on_a_failing_block(tmp_path):
    page = "\n".join([
        "```bash", "echo unmarked", "```",
        "<!-- not-run: -->", "```python", "pass", "```",
        "<!-- run -->", "text, not a fence",
        "<!-- run -->", "```sh", "false", "```",
        "<!-- not-run: needs a GPU -->", "```console", "$ nvidia-smi", "```",
        "```toml", "a = 1", "```",
    ])
    blocks, problems = parse(page, "x.md")
    assert [(b.language, b.marker) for b in blocks] == [("bash", None), ("python", "not-run"), ("sh", "run"),
                                                        ("console", "not-run")]
    assert problems == ["x.md:5: `not-run` without a reason", "x.md:8: a marker that is not right before a fence"]
    with pytest.raises(AssertionError, match="x.md:11: exit 1"):
        run_block(blocks[2], tmp_path, {})
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_block(Block("x.md", 1, "python", "1 / 0\n", "run", ""), tmp_path, {})
