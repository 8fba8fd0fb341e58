"""docs/ARCHITECTURE.md's table of pipelines is the code's: every step table under flows/, its steps
in order (``tools/docs/step_tables.py`` generates it; run it after changing a table)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("step_tables", REPO / "tools" / "docs" / "step_tables.py")
step_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_tables)


def test_the_architecture_pages_step_tables_are_the_codes():
    page = step_tables.page_block(step_tables.PAGE.read_text())
    assert page == step_tables.render(), "docs/ARCHITECTURE.md: run python tools/docs/step_tables.py"


def test_the_generator_finds_every_table_and_its_steps_in_order():
    tables = step_tables.step_tables()
    assert len(tables) == len(step_tables.PIPELINES) >= 9
    assert tables["flows.maintenance.gc.GcSteps"] == ["plan-gc", "collect"]
    assert tables["flows.receive.vllm_refit.EngineSteps"][-1] == "await-receiver-commit"


def test_a_table_without_a_line_in_pipelines_or_a_line_without_a_table_is_an_error(tmp_path):
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "extra.py").write_text("class T(StepTable):\n    a = Step(a)\n    b_c = Step(b_c)\n")
    assert step_tables.step_tables(tmp_path) == {"flows.extra.T": ["a", "b-c"]}
    with pytest.raises(ValueError, match=r"lacks \['flows.extra.T'\]"):
        step_tables.render(tmp_path)
