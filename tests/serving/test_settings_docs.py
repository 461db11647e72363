"""docs/configuration.md names every server setting (a new field without a line there fails here)."""
from __future__ import annotations

from pathlib import Path

from serving.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_server_setting_has_its_variable_in_configuration_md():
    text = DOC.read_text()
    missing = [f"SLC_{name.upper()}" for name in Settings.model_fields if f"`SLC_{name.upper()}`" not in text]
    assert not missing, f"undocumented settings: {missing}"
