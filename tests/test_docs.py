"""The README and the guides as a newcomer reads them: short, every link resolving, the quick start running, the
presets' bounds the code's. The README's figure and tables are checked against the results by
tests/bench/test_report.py (`fxmem bench report --check`)."""

import pathlib
import re

import pytest

from fxmem.config import PRESETS, PUBLISHED_MIN_COSINE

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *GUIDES, *sorted((ROOT / "docs/history").glob("*.md")), ROOT / "benchmarks/results/README.md"]
README_LIMIT, GUIDE_LIMIT = 200, 300  # lines
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_the_readme_and_each_guide_are_short():
    assert README.read_text().count("\n") <= README_LIMIT
    long = {page.name: n for page in GUIDES if (n := page.read_text().count("\n")) > GUIDE_LIMIT}
    assert not long, f"guides over {GUIDE_LIMIT} lines (move lab notes to docs/history/): {long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    broken = []
    for link in links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (fragment and target.suffix == ".md" and fragment not in anchors(target)):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: links that resolve to nothing: {broken}"


def test_no_page_or_module_points_outside_the_repository():
    files = [*PAGES, *ROOT.glob("fxmem/**/*.py"), *ROOT.glob("fxmem_bench/**/*.py"), *ROOT.glob("tests/**/*.py"),
             ROOT / "Makefile"]
    outside = [str(f.relative_to(ROOT)) for f in files if f != pathlib.Path(__file__)
               and re.search(r"\.\./shared|shared/(BENCHMARKS|DESIGN|STYLE|TORCH_NOTES|seeds)", f.read_text())]
    assert not outside


def test_the_readme_publishes_each_preset_at_the_codes_bound():
    rows = re.findall(r"^\| `([\w-]+)`(?: \(default\))? \| .* \| ([\d.]+) \|$", README.read_text(), flags=re.MULTILINE)
    assert {name: float(bound) for name, bound in rows} == PUBLISHED_MIN_COSINE
    assert list(PUBLISHED_MIN_COSINE) == list(PRESETS)


def test_the_readme_quick_start_runs_as_pasted(capsys):
    """A fresh clone's first minute: the quick start, pasted into Python, trains a step and says what it saved."""
    quick_start = README.read_text().split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", quick_start, flags=re.DOTALL).group(1)
    assert len(code.strip().splitlines()) <= 6  # the import and five lines
    exec(compile(code, "README quick start", "exec"), {})  # noqa: S102 (the README's own code, as a user pastes it)
    printed = capsys.readouterr().out
    assert re.search(r"saved activations: .* after the plan \([\d.]+x smaller\)", printed)
    assert "guard at forward 1 (first forward)" in printed
