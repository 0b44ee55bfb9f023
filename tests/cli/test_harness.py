"""`fxmem bench` reaches the harness (fxmem_bench) where it lives, beside the fxmem package in a clone, even where the
repository is not on sys.path (an editable install's console script); with no harness, it says where it lives."""

import pathlib
import subprocess
import sys

import fxmem

# Run in a fresh interpreter in an empty directory: fxmem imported first, then every sys.path entry that holds the
# harness dropped, as where the `fxmem` console script of an editable install runs.
PROLOGUE = """
import pathlib, sys
import fxmem.cli
sys.path[:] = [p for p in sys.path if not (pathlib.Path(p or '.').resolve() / 'fxmem_bench').is_dir()]
"""


def run(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROLOGUE + code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def test_bench_finds_the_harness_beside_the_package_when_it_is_not_on_sys_path(tmp_path):
    code = """
try:
    import fxmem_bench
except ModuleNotFoundError:
    print("not importable")
try:
    fxmem.cli.main(["bench", "plans", "--help"])
except SystemExit as done:
    print("exit", done.code)
print(sys.modules["fxmem_bench.cli.plans"].__file__)
"""
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    checkout = pathlib.Path(fxmem.__file__).resolve().parents[1]
    assert done.stdout.splitlines()[0] == "not importable"  # the harness is not on sys.path to begin with
    assert "usage: fxmem bench plans" in done.stdout and "exit 0" in done.stdout
    assert done.stdout.splitlines()[-1] == str(checkout / "fxmem_bench" / "cli" / "plans.py")


def test_without_the_harness_bench_says_where_it_lives_and_the_other_commands_run(tmp_path):
    code = f"""
import fxmem.cli.harness
fxmem.cli.harness.CHECKOUT = pathlib.Path({str(tmp_path)!r})  # no fxmem_bench beside the package: an installed wheel
parser = fxmem.cli.command_parser()
assert "bench" in parser.format_help()
assert parser.parse_args(["inspect", "config.json"]).model == "config.json"
assert fxmem.cli.harness.workload_names() == []
fxmem.cli.main(["bench", "compare", "--steps", "3"])
"""
    done = run(code, tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    message = " ".join(done.stderr.split())
    assert ("fxmem bench: the benchmark harness (fxmem_bench) lives in fxmem's repository, not in the installed "
            "package; run it from a clone of the repository: `make demo`, or `python -m fxmem bench ...` in the "
            "clone's root") in message
    assert "Traceback" not in done.stderr
