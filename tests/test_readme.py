"""The README says what the code does: its settings table is the settings class's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from service.api.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def test_the_settings_table_is_current() -> None:
    spec = importlib.util.spec_from_file_location("settings_table", ROOT / "scripts" / "settings_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    assert module.replace_table(readme) == readme, "run scripts/settings_table.py"
    for name in Settings.model_fields:
        assert f"| `HOIST_{name.upper()}` |" in readme
