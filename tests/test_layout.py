"""The package's layout (CPU, `ast` only): no import circle between its modules; in measure/ and gpu/tp/ every import at
the top of its file unless a comment on that line or the line above says why; no file over 500 lines."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "atomflow_bench"
MAX_LINES = 500
TOP_ONLY = ("measure", "gpu/tp")  # where an import inside a function needs a comment
NOT_YET_CUT: set = set()


def module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, pkg: Path = PKG) -> set[str]:
    """The package's modules `path` imports (absolute names), wherever in the file; `from . import x` names module x
    when x is one."""
    me = module_name(path, pkg)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    root = pkg.parent
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith(pkg.name):
                continue
            for a in node.names:
                cand = f"{mod}.{a.name}"
                as_path = root / cand.replace(".", "/")
                out.add(cand if as_path.with_suffix(".py").is_file() or as_path.is_dir() else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(pkg.name)}
    return out - {me}


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the modules it imports; importing a.b.c also runs a/__init__ and a/b/__init__."""
    graph = {}
    for f in pkg.rglob("*.py"):
        deps = set()
        for d in imports_of(f, pkg):
            deps.add(d)
        graph[module_name(f, pkg)] = deps
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    done, stack, on = set(), [], set()

    def visit(n):
        if n in on:
            return stack[stack.index(n):] + [n]
        if n in done:
            return None
        stack.append(n)
        on.add(n)
        for d in sorted(graph.get(n, ())):
            found = visit(d)
            if found:
                return found
        stack.pop()
        on.discard(n)
        done.add(n)
        return None

    for n in sorted(graph):
        found = visit(n)
        if found:
            return found
    return None


def uncommented_inner_imports(path: Path) -> list[int]:
    """Line numbers of imports inside a function with no comment on that line or on the line above."""
    lines = path.read_text().splitlines()
    out = set()
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    line, above = lines[n.lineno - 1], lines[n.lineno - 2] if n.lineno > 1 else ""
                    if "#" not in line and not above.strip().startswith("#"):
                        out.add(n.lineno)
    return sorted(out)


def test_no_import_circle_between_modules():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_imports_inside_functions_say_why_in_measure_and_the_tp_wing():
    bad = [f"{f.relative_to(PKG.parent)}:{n}" for part in TOP_ONLY for f in sorted((PKG / part).rglob("*.py"))
           for n in uncommented_inner_imports(f)]
    assert bad == [], "imports inside functions without a comment: " + ", ".join(bad)


def test_no_file_over_500_lines():
    long = {str(f.relative_to(PKG.parent)): n for f in PKG.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_LINES and str(f.relative_to(PKG.parent)) not in NOT_YET_CUT}
    assert long == {}, long


def test_the_checks_can_fail(tmp_path):
    pkg = tmp_path / "atomflow_bench"
    (pkg / "m").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "m" / "__init__.py").write_text("")
    (pkg / "m" / "a.py").write_text("from . import b\n")
    (pkg / "m" / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (pkg / "m" / "c.py").write_text("def f():\n    # optional extra\n    import cupy\n    import torch  # why\n")
    graph = import_graph(pkg)
    assert graph["atomflow_bench.m.a"] == {"atomflow_bench.m.b"}
    assert find_circle(graph) in (["atomflow_bench.m.a", "atomflow_bench.m.b", "atomflow_bench.m.a"],
                                  ["atomflow_bench.m.b", "atomflow_bench.m.a", "atomflow_bench.m.b"])
    assert uncommented_inner_imports(pkg / "m" / "b.py") == [2]
    assert uncommented_inner_imports(pkg / "m" / "c.py") == []
    (pkg / "m" / "b.py").write_text("x = 1\n")
    assert find_circle(import_graph(pkg)) is None
