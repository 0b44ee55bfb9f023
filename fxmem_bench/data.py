"""Real text that exists on every machine: the Python standard library's own source."""

from __future__ import annotations

import ast
import functools
import pathlib
import sysconfig
from collections.abc import Iterator

import torch

# Vendored or generated trees whose text is not representative library code.
_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"})


@functools.cache
def stdlib_files() -> tuple[pathlib.Path, ...]:
    """The standard library's .py files, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIPPED_DIRS & set(p.relative_to(root).parts[:-1])]
    if not files:
        raise RuntimeError(f"no Python standard library sources under {root}")
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_bytes(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's source, files concatenated in order."""
    chunks, total = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return b"".join(chunks)[:limit]


def byte_windows(texts: list[bytes], seq: int, separator: bytes = b"") -> torch.Tensor:
    """[n, seq] byte tokens (0..255): the texts joined by ``separator``, cut into windows."""
    tokens = torch.frombuffer(bytearray(separator.join(texts)), dtype=torch.uint8).long()
    return tokens[: (tokens.numel() // seq) * seq].view(-1, seq)


def byte_token_batches(batch: int, seq: int, *, seed: int = 0, corpus_bytes: int = 8 << 20
                       ) -> Iterator[torch.Tensor]:
    """Endless [batch, seq] windows of the standard library's first ``corpus_bytes`` bytes, shuffled."""
    return shuffled_batches(byte_windows([stdlib_bytes(corpus_bytes)], seq), batch, seed)


def shuffled_batches(windows: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq] batches of ``windows``, reshuffled every epoch by a seeded generator."""
    if windows.shape[0] < batch:
        raise ValueError(f"{windows.shape[0]} windows of {windows.shape[1]} bytes: fewer than a batch of {batch}")
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(windows.shape[0], generator=generator)
        for start in range(0, order.numel() - batch + 1, batch):
            yield windows[order[start:start + batch]]


def _parsed_stdlib() -> Iterator[tuple[str, ast.Module]]:
    """(source, syntax tree) of each standard-library file that parses, in stdlib_files' order."""
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            yield source, ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue


@functools.cache
def docstring_code_pairs(max_pairs: int = 4096) -> tuple[tuple[str, str], ...]:
    """(docstring, source without the docstring) of standard-library functions: a code-search task."""
    pairs = []
    for source, tree in _parsed_stdlib():
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docstring = node.body[0]  # get_docstring found one, so it is the first statement
                    code = lines[node.lineno - 1:docstring.lineno - 1] + lines[docstring.end_lineno:node.end_lineno]
                    pairs.append((doc, "\n".join(code)))
                    if len(pairs) == max_pairs:
                        return tuple(pairs)
    return tuple(pairs)


def _docstring_nodes(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.Expr]]:
    """(module, class or function; its docstring statement) for every documented one in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node, clean=False) is not None:
            yield node, node.body[0]


@functools.cache
def stdlib_split_by_docstrings() -> tuple[tuple[bytes, bytes], ...]:
    """Per standard-library file, in stdlib_files' order: (its source without any docstring, its docstrings,
    cleaned and separated by blank lines). Code and prose: a model pretrained on the first has never read the
    second."""
    split = []
    for source, tree in _parsed_stdlib():
        lines = source.splitlines(keepends=True)
        dropped: set[int] = set()
        docstrings = []
        for node, statement in sorted(_docstring_nodes(tree), key=lambda pair: pair[1].lineno):
            docstrings.append(ast.get_docstring(node))
            # A docstring on its def's own line goes with the def's text; the line stays.
            if isinstance(node, ast.Module) or statement.lineno > node.lineno:
                dropped.update(range(statement.lineno - 1, statement.end_lineno))
        code = "".join(line for i, line in enumerate(lines) if i not in dropped)
        split.append((code.encode(), "\n\n".join(docstrings).encode()))
    return tuple(split)


def held_out(index: int, every: int) -> bool:
    """Whether file ``index`` (in stdlib_files' order) is held out for evaluation: one file in ``every``."""
    return index % every == every - 1


def split_windows(part: int, seq: int, *, every: int, evaluation: bool, separator: bytes = b"") -> torch.Tensor:
    """[n, seq] byte windows of one side of stdlib_split_by_docstrings (0: the code, 1: the docstrings), of the
    training files or of the held-out ones (one in ``every``), their non-empty texts joined by ``separator``."""
    texts = [pair[part] for i, pair in enumerate(stdlib_split_by_docstrings())
             if pair[part] and held_out(i, every) == evaluation]
    return byte_windows(texts, seq, separator)
