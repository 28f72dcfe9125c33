"""Every directory of the package is a regular package: setuptools' package
discovery skips directories without `__init__.py`, so a plain (non-editable)
install would silently lack them."""

from __future__ import annotations

from pathlib import Path

import hicache


def test_every_package_directory_has_an_init():
    root = Path(hicache.__file__).resolve().parent
    dirs = [d for d in [root, *root.rglob("*")] if d.is_dir() and d.name != "__pycache__"
            and any(d.glob("*.py"))]
    assert dirs, "found no package directories"
    missing = [str(d.relative_to(root.parent)) for d in dirs if not (d / "__init__.py").is_file()]
    assert not missing, f"directories without __init__.py: {missing}"
