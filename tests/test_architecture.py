"""The layering of docs/architecture.md, checked on every import statement of the package (lazy ones included), with no
module but the command's importing the package's own __init__ (an arrow back up), and
the experiment harness (fxmem_bench) kept apart: no module of fxmem and no test outside tests/bench imports it, and the
core starting up loads none of it."""

import ast
import pathlib
import subprocess
import sys

import fxmem

PACKAGE = pathlib.Path(fxmem.__file__).parent
ROOT = PACKAGE.parent  # the repository
HARNESS_PACKAGE = ROOT / "fxmem_bench"
TESTS = ROOT / "tests"

# What each part of fxmem may import of fxmem, besides itself. A part is a subpackage or a top-level module;
# the longest matching prefix decides.
ALLOWED = {
    "fxmem.choices": set(),
    "fxmem.version": set(),
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
COMMAND = "fxmem.cli"  # nothing of fxmem imports it, nor the harness but for its own command line (fxmem_bench.cli)
ENTRY = {"fxmem.cli", "fxmem.__main__"}  # may import everything of fxmem
HARNESS = "fxmem_bench"  # in the repository, not installed: nothing of fxmem imports it (fxmem.cli.harness finds it)


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(name: str, parts) -> str | None:
    matches = [p for p in parts if name == p or name.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def imports(path: pathlib.Path, root: pathlib.Path, tops: tuple[str, ...]) -> set[str]:
    """Every module of the packages ``tops`` that ``path`` (a module under ``root``) imports, anywhere in the file,
    relative imports resolved (``from fxmem import x`` counts as fxmem.x)."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in tops}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            if base.split(".")[0] in tops:
                found |= {f"{base}.{alias.name}" if base in tops or not node.module else base
                          for alias in node.names}
    return found


def _from_package_init(name: str) -> bool:
    """Whether ``name`` is fxmem itself or a name its __init__ exports (fxmem.x where x is no module of it)."""
    parts = name.split(".")
    if parts[0] != "fxmem" or len(parts) > 2:
        return False
    path = PACKAGE.joinpath(*parts[1:])
    return len(parts) == 1 or not (path.with_suffix(".py").exists() or (path / "__init__.py").exists())


def violations() -> list[str]:
    """Each import of fxmem that breaks ALLOWED, imports the command, or imports the harness; and each import of the
    harness, outside its command line, of fxmem's command."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path, PACKAGE.parent)
        own = part_of(name, ALLOWED) or name
        for imported in sorted(imports(path, PACKAGE.parent, ("fxmem", HARNESS))):
            target = part_of(imported, [*ALLOWED, COMMAND, HARNESS]) or imported
            if target == HARNESS or (_from_package_init(imported) and not part_of(name, ENTRY)):
                found.append(f"{name} imports {imported}")  # the harness; or the package's __init__: an arrow back up
            elif target == own or part_of(name, ENTRY):
                continue
            elif target == COMMAND or (own in ALLOWED and target not in ALLOWED[own]):
                found.append(f"{name} imports {imported}")
    for path in sorted(HARNESS_PACKAGE.rglob("*.py")):
        name = module_name(path, HARNESS_PACKAGE.parent)
        if not part_of(name, [f"{HARNESS}.cli"]):
            imported = imports(path, HARNESS_PACKAGE.parent, ("fxmem",))
            found += [f"{name} imports {module}" for module in sorted(imported) if part_of(module, [COMMAND])]
    return found


def core_tests_importing_the_harness() -> list[str]:
    """Each import of the harness, or of its tests (tests.bench, which import it), by a test outside tests/bench."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.is_relative_to(TESTS / "bench"):
            continue
        name = module_name(path, TESTS.parent)
        found += [f"{name} imports {imported}" for imported in sorted(imports(path, TESTS.parent, (HARNESS, "tests")))
                  if imported.split(".")[0] == HARNESS or part_of(imported, ["tests.bench"])]
    return found


def test_every_import_keeps_the_layering():
    assert violations() == []


def test_the_rules_catch_each_import_they_forbid(tmp_path, monkeypatch):
    fake = tmp_path / "fxmem"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "bad.py").write_text("from fxmem.config import Config\nimport fxmem.kernels.quantize\n"
                                             "from ..cost_model import planner\nfrom . import quantize\n")
    (fake / "models.py").write_text("def f():\n    from fxmem.cli.common import console\n")
    (fake / "whatif.py").write_text("def f():\n    from fxmem_bench.workloads import WORKLOADS\n")
    (fake / "report.py").write_text("from fxmem import __version__\nimport fxmem\n")
    harness = tmp_path / "fxmem_bench"
    (harness / "cli").mkdir(parents=True)
    (harness / "compare.py").write_text("from fxmem.cli import common\nfrom fxmem.measure import format_bytes\n")
    (harness / "cli" / "compare.py").write_text("from fxmem.cli.common import console\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "HARNESS_PACKAGE", harness)
    assert violations() == ["fxmem.kernels.bad imports fxmem.config", "fxmem.kernels.bad imports fxmem.cost_model",
                            "fxmem.models imports fxmem.cli.common", "fxmem.report imports fxmem",
                            "fxmem.report imports fxmem.__version__", "fxmem.whatif imports fxmem_bench.workloads",
                            "fxmem_bench.compare imports fxmem.cli"]


def test_no_test_outside_tests_bench_imports_the_harness():
    assert core_tests_importing_the_harness() == []


def test_the_rule_catches_a_core_test_that_imports_the_harness(tmp_path, monkeypatch):
    tests = tmp_path / "tests"
    (tests / "bench").mkdir(parents=True)
    (tests / "test_model.py").write_text("import fxmem_bench.workloads\nfrom fxmem.models import hf_config\n")
    (tests / "test_fidelity.py").write_text("def test():\n    from tests.bench.test_fidelity import TINY_BF16\n")
    (tests / "bench" / "test_workloads.py").write_text("from fxmem_bench.workloads import WORKLOADS\n")
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tests)
    assert core_tests_importing_the_harness() == ["tests.test_fidelity imports tests.bench.test_fidelity",
                                                  "tests.test_model imports fxmem_bench.workloads"]


def loaded(statements: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules under ``prefixes`` that a fresh interpreter has loaded after ``statements``."""
    code = f"import sys\n{statements}\nprint(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    return ast.literal_eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)


def test_the_core_starting_up_loads_no_harness():
    # the backend loads neither the command nor the harness; the command loads the harness only to build a parser
    assert loaded("import fxmem.backend", (COMMAND, HARNESS)) == []
    assert loaded("import fxmem, fxmem.cli", (HARNESS,)) == []
    # the probe sees a harness module that is loaded
    assert loaded("import fxmem.backend, fxmem_bench.choices", (COMMAND, HARNESS)) == [HARNESS, f"{HARNESS}.choices"]
