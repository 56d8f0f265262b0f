"""Every product package folder is declared in pyproject.toml: an editable install finds
undeclared folders through the repository path, a wheel would silently leave them out."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("constrained", "engine", "kernels", "server")


def test_every_package_folder_is_declared() -> None:
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "espalier." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in PRODUCT
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - declared == set()
