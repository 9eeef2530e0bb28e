"""The lab apart from the product (CPU): lab/local.py refuses a bad `name/tpN` model spec in one line before anything
touches a GPU, and no module of the product (atomflow_bench/, scripts/) imports the lab."""
import ast
from pathlib import Path

import pytest

from atomflow_bench.errors import AtomflowError
from lab.local import lab_engine

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec", ["llama-9b/tp4", "llama-3.1-70b/tpx", "llama-3.1-70b/tp0", "llama-3.1-70b/tp"])
def test_bad_rank_spec_is_refused(spec):
    with pytest.raises(AtomflowError, match=r"<catalog model>/tp<N>") as e:
        lab_engine(spec, "fp8", 16)
    assert "\n" not in str(e.value)


def lab_imports(source: str) -> list[str]:
    """The modules of the lab (`lab`, `lab.*`) that `source` imports, at any depth; a relative import stays inside
    its own package and is not one."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name == "lab" or a.name.startswith("lab.")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "lab" or node.module.startswith("lab."):
                out.append(node.module)
    return out


def test_the_check_can_fail():
    src = "import os\nfrom lab import timeline\ndef f():\n    import lab.probe\n    from .lab import x\n    import labx\n"
    assert sorted(lab_imports(src)) == ["lab", "lab.probe"]


def test_the_product_never_imports_the_lab():
    files = sorted((ROOT / "atomflow_bench").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    assert len(files) > 50
    found = {f.relative_to(ROOT).as_posix(): lab_imports(f.read_text()) for f in files}
    assert {f: m for f, m in found.items() if m} == {}
    assert not (ROOT / "atomflow_bench" / "lab").exists() and not (ROOT / "kernels_cu" / "lab").exists()
