"""The python examples in ``docs/*.md`` and ``README.md`` run as written.

Each file's python code blocks run in order in one namespace, in a temporary working directory. A block whose
first lines carry a marker comment is treated specially:

* ``# remat-docs: skip (reason)``: never run here (e.g. it needs ``torchrun`` or a GPU);
* ``# remat-docs: needs MODULE``: run only where ``MODULE`` can be imported, skipped with that reason otherwise.

``docs/make_figures.py`` is run on a tiny model to check that it still produces its figure.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
MARKER = re.compile(r"^\s*#\s*remat-docs:\s*(skip|needs)\b\s*(.*)$", re.MULTILINE)


def code_blocks(path: Path) -> list[tuple[str, str | None]]:
    """``(code, reason to skip it or None)`` for each python block of ``path``."""
    found = []
    for match in FENCE.finditer(path.read_text()):
        code = match.group(1)
        head = "\n".join(code.splitlines()[:3])
        marker = MARKER.search(head)
        reason = None
        if marker is not None:
            kind, rest = marker.group(1), marker.group(2).strip()
            if kind == "skip":
                reason = f"marked skip {rest}".strip()
            else:
                module = rest.split()[0] if rest else ""
                if not module:
                    raise ValueError(f"{path.name}: '# remat-docs: needs' must name a module")
                if importlib.util.find_spec(module) is None:
                    reason = f"needs {module}, not installed"
        found.append((code, reason))
    return found


DOC_FILES = [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]

# Docs whose examples are not yet written to run as they are (signature sketches, fragments); each entry says
# why. Remove the entry once the file's blocks run or carry a marker.
NOT_YET_RUNNABLE: dict[str, str] = {}


def test_docs_have_examples() -> None:
    names = {p.name for p in DOC_FILES}
    for expected in ("hf.md", "distributed.md", "deepspeed.md", "compile.md", "lightning.md", "strategies.md"):
        assert expected in names
    for path in DOC_FILES:
        assert code_blocks(path), f"{path.name} has no python example"


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_doc_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if path.name in NOT_YET_RUNNABLE:
        pytest.skip(f"{path.name}: {NOT_YET_RUNNABLE[path.name]}")
    blocks = code_blocks(path)
    runnable = [(i, code) for i, (code, reason) in enumerate(blocks) if reason is None]
    if not runnable:
        pytest.skip("; ".join(reason for _, reason in blocks if reason))
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs.{path.stem}"}
    environment = dict(os.environ)
    try:
        for i, code in runnable:
            exec(compile(code, f"{path.name} (python block {i + 1})", "exec"), namespace)
    finally:
        # What a file's examples set for their own process (LOCAL_RANK for DeepSpeed) must not reach the next
        # file's, where launchers read it (Hugging Face's Trainer, Lightning).
        os.environ.clear()
        os.environ.update(environment)
        if "compile" in path.stem:
            torch._dynamo.reset()  # compiled code of the examples is not kept for other tests


def test_make_figures_script(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.measure_strategies(layers=2, hidden=32, seq_len=16, batch_size=2, budget=0.9)
    assert [r["label"].split(":")[0] for r in rows] == ["none", "full", "sqrt", "memory_poor", "optimal"]
    none, full = rows[0], rows[1]
    assert full["activation_bytes"] < none["activation_bytes"] and full["recomputed_layers"] == 2
    assert all(len(r["timeline"]) > 10 for r in rows)
    out = tmp_path / "timeline.png"
    module.plot(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
