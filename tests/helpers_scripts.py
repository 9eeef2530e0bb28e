"""Load a scripts/*.py file as a module (the scripts are not a package), for tests of their functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py, executed as the module `name`."""
    spec = importlib.util.spec_from_file_location(Path(name).name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
