"""The package's one-way arrows, read from the source (no imports run).

kernels  <- model  <- engine  <- serve
   ^          ^         ^
   +----------+---------+------- lab (references, baselines, benchmarks, report writers)

- ``kernels`` imports nothing of pageserve (Triton kernels and their PyTorch references only);
- ``model`` never imports ``engine``, ``serve`` or ``lab``;
- ``engine`` never imports ``serve`` or ``lab``;
- nothing inside ``pageserve/`` imports ``lab`` except ``lab`` itself and the CLI.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pageserve"
WINGS = ("engine", "model", "kernels", "serve", "lab")
FORBIDDEN = {
    "kernels": {"engine", "model", "serve", "lab", "cli", "<top>"},
    "model": {"engine", "serve", "lab", "cli"},
    "engine": {"serve", "lab", "cli"},
    "serve": {"lab"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the pageserve modules ``path`` imports (lazy imports inside functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    pkg = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pageserve"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "pageserve":
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # "from pageserve.lab import x"
    return found


def wing_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "<top>"
    return parts[1] if parts[1] in WINGS or parts[1] == "cli" else "<top>"


def edges() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        src = module_name(path)
        for dst in imported_modules(path):
            out.append((src, dst, f"{path.relative_to(PKG.parent)}"))
    return out


def test_every_module_lives_in_a_wing():
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py", "cli.py"))
    assert not loose, f"modules outside engine/ model/ kernels/ serve/ lab/: {loose}"
    for wing in WINGS:
        assert (PKG / wing / "__init__.py").is_file(), wing


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_wing_imports_only_what_the_arrows_allow(wing):
    bad = []
    for src, dst, where in edges():
        if wing_of(src) != wing:
            continue
        target = wing_of(dst)
        if target in FORBIDDEN[wing] and target != wing:
            bad.append(f"{where}: imports {dst}")
    assert not bad, "\n".join(bad)


def test_only_lab_and_the_cli_import_lab():
    bad = [f"{where}: imports {dst}" for src, dst, where in edges()
           if wing_of(dst) == "lab" and wing_of(src) not in ("lab", "cli")]
    assert not bad, "\n".join(bad)


def test_the_import_reader_sees_relative_lazy_and_absolute_imports(tmp_path, monkeypatch):
    # the checker itself must be able to fail: a fake package with one of each kind of edge
    fake = tmp_path / "pageserve"
    (fake / "model").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "model" / "__init__.py").write_text("")
    (fake / "model" / "x.py").write_text(
        "from ..engine.llm import LLM\n"
        "def f():\n    from pageserve.lab import bench\n"
        "import pageserve.serve.api\n"
    )
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    got = imported_modules(fake / "model" / "x.py")
    assert {"pageserve.engine.llm", "pageserve.lab.bench", "pageserve.serve.api"} <= got
    assert {wing_of(m) for m in got} >= {"engine", "lab", "serve"}


SCRIPTS = sorted((PKG.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_gpu_script_parses_and_finds_the_pageserve_names_it_imports(script):
    # most scripts run only on the H200, where a renamed function costs a device call to find out
    import importlib
    import importlib.util

    tree = ast.parse(script.read_text(), filename=str(script))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pageserve":
            mod = importlib.import_module(node.module)
            is_package = hasattr(mod, "__path__")
            for alias in node.names:
                found = hasattr(mod, alias.name) or (
                    is_package and importlib.util.find_spec(f"{node.module}.{alias.name}") is not None)
                assert found, f"{script.name}: from {node.module} import {alias.name}"
