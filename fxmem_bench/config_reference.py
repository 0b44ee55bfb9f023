"""docs/config.md: every ``fxmem.Config`` field with its type, default, presets' values and description, from the
code (``Config``'s fields and docstring, ``PRESETS``, ``PUBLISHED_MIN_COSINE``), so that the reference cannot drift."""

from __future__ import annotations

import dataclasses
import inspect
import re

from fxmem.config import PRESETS, PUBLISHED_MIN_COSINE, Config

_FIELD_START = re.compile(r"^    (\w+): (.*)$")


def field_descriptions() -> dict[str, str]:
    """Each field's paragraph of ``Config``'s docstring (``name: text``, continued on more-indented lines), as one
    line. Raises ValueError where a field has none or the docstring describes a name that is no field."""
    descriptions: dict[str, list[str]] = {}
    current = None
    for line in inspect.getdoc(Config).splitlines():
        match = _FIELD_START.match("    " + line) if not line.startswith(" ") else None
        if match:
            current = match[1]
            descriptions[current] = [match[2]]
        elif current is not None and line.startswith("    "):
            descriptions[current].append(line.strip())
        else:
            current = None
    fields = [f.name for f in dataclasses.fields(Config)]
    missing, unknown = sorted(set(fields) - set(descriptions)), sorted(set(descriptions) - set(fields))
    if missing or unknown:
        raise ValueError(f"Config's docstring: no description for {', '.join(missing) or 'no field'}; "
                         f"describes what is no field: {', '.join(unknown) or 'nothing'}")
    # the docstring's double backticks (reStructuredText's literals) as markdown's
    return {name: " ".join(descriptions[name]).replace("``", "`") for name in fields}


def config_reference() -> str:
    """The markdown of docs/config.md."""
    defaults = PRESETS["exact"]
    presets = list(PRESETS)
    lines = ["# Configuration reference", "",
             ("Written by `fxmem bench report` from `fxmem.Config` (its fields and docstring) and its presets: do "
              "not edit by hand. `fxmem.Config.from_preset(name, **overrides)` takes a preset and changes fields; "
              "`fxmem.backend(preset, **overrides)` and `fxmem.compile_(model, preset, **overrides)` take the same."),
             "", "## Presets", "",
             ("The fields a preset sets apart from `exact` (the defaults), and the worst LoRA-gradient cosine "
              "against eager each is published at."), "",
             "| field | " + " | ".join(presets) + " |", "|---|" + "---|" * len(presets)]
    changed = [f.name for f in dataclasses.fields(Config)
               if any(getattr(PRESETS[p], f.name) != getattr(defaults, f.name) for p in presets)]
    for name in changed:
        lines.append(f"| `{name}` | " + " | ".join(f"`{getattr(PRESETS[p], name)!r}`" for p in presets) + " |")
    lines.append("| published worst cosine | " + " | ".join(str(PUBLISHED_MIN_COSINE[p]) for p in presets) + " |")
    lines += ["", "## Fields", ""]
    for field, description in zip(dataclasses.fields(Config), field_descriptions().values(), strict=True):
        lines += [f"### `{field.name}`", "",
                  f"`{field.type}`, default `{getattr(defaults, field.name)!r}`. {description}", ""]
    return "\n".join(lines)
