"""The layering of docs/architecture.md, checked on every import statement of the package (lazy ones included)."""

import ast
import pathlib
import subprocess
import sys

import fxmem

PACKAGE = pathlib.Path(fxmem.__file__).parent

# What each part of fxmem may import of fxmem, besides itself. A part is a subpackage or a top-level module;
# the longest matching prefix decides.
ALLOWED = {
    "fxmem.choices": set(),
    "fxmem.fallback": {"fxmem.config"},  # for its type only
    "fxmem.kernels": {"fxmem.choices", "fxmem.fallback"},
    "fxmem.timing": set(),
    "fxmem.fitting": set(),
    "fxmem.analysis": set(),
    "fxmem.config": {"fxmem.choices"},
    "fxmem.measure": {"fxmem.timing"},
    "fxmem.cost_model": {"fxmem.analysis", "fxmem.choices", "fxmem.config", "fxmem.kernels", "fxmem.timing"},
    "fxmem.passes": {"fxmem.analysis", "fxmem.config", "fxmem.cost_model", "fxmem.fallback", "fxmem.kernels"},
    "fxmem.techniques": {"fxmem.config", "fxmem.cost_model", "fxmem.passes"},
    "fxmem.train": {"fxmem.choices", "fxmem.kernels", "fxmem.measure", "fxmem.timing"},
}
HARNESS = ("fxmem.bench", "fxmem.cli")  # nothing else imports these
ENTRY = {"fxmem.cli", "fxmem.__main__"}  # may import everything


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(name: str, parts) -> str | None:
    matches = [p for p in parts if name == p or name.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def fxmem_imports(path: pathlib.Path) -> set[str]:
    """Every fxmem module ``path`` imports, anywhere in the file, relative imports resolved (``from fxmem import x``
    counts as fxmem.x)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "fxmem"}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            if base.split(".")[0] == "fxmem":
                found |= {f"{base}.{alias.name}" if base == "fxmem" or not node.module else base
                          for alias in node.names}
    return found


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        own = part_of(name, ALLOWED) or name
        for imported in sorted(fxmem_imports(path)):
            target = part_of(imported, [*ALLOWED, *HARNESS]) or imported
            if target == own or part_of(name, ENTRY) or (part_of(name, ["fxmem.bench"]) and target != "fxmem.cli"):
                continue
            if target in HARNESS or (own in ALLOWED and target not in ALLOWED[own]):
                found.append(f"{name} imports {imported}")
    return found


def test_every_import_keeps_the_layering():
    assert violations() == []


def test_the_rules_catch_a_kernel_that_imports_the_config(tmp_path, monkeypatch):
    fake = tmp_path / "fxmem"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "bad.py").write_text("from fxmem.config import Config\nimport fxmem.kernels.quantize\n"
                                             "from ..cost_model import planner\nfrom . import quantize\n")
    (fake / "models.py").write_text("def f():\n    from fxmem.bench.workloads import WORKLOADS\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations() == ["fxmem.kernels.bad imports fxmem.config", "fxmem.kernels.bad imports fxmem.cost_model",
                            "fxmem.models imports fxmem.bench.workloads"]


def test_the_backend_loads_no_harness():
    code = ("import sys, fxmem.backend; "
            "print(sorted(m for m in sys.modules if m.startswith(('fxmem.bench', 'fxmem.cli'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
