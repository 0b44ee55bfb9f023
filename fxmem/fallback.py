"""What fxmem does where it cannot do what its configuration asks: warn once, or, in strict mode, raise.

A fallback (a pass that failed and had its stage rolled back, a region compiled unplanned, a rewritten graph run
as aten ops, a planned rewrite left undone, a loss block run eagerly) and an unsupported pattern (one an enabled
technique targets, left as torch runs it, e.g. a LoRA linear with dropout under ``lora_reorder``) would otherwise
show in the report alone: a user who does not read it trains believing otherwise. Strict mode makes each an
error: ``Config(strict=True)`` for one backend, ``FXMEM_STRICT=1`` in the environment for every one.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxmem.config import Config

STRICT_ENV = "FXMEM_STRICT"
_STRICT_VALUES = ("0", "1")


class FallbackError(RuntimeError):
    """Strict mode: fxmem would have fallen back, or left an unsupported pattern as torch runs it."""


class FallbackWarning(UserWarning):
    """fxmem fell back: what it did instead is in the message and the report."""


def strict(config: Config | None = None) -> bool:
    """Strict mode: ``config.strict``, or ``FXMEM_STRICT=1`` (which turns it on for every config)."""
    value = os.environ.get(STRICT_ENV, "")
    if value not in ("", *_STRICT_VALUES):
        raise ValueError(f"{STRICT_ENV} must be one of {', '.join(_STRICT_VALUES)} (or unset); got {value!r}")
    return value == "1" or (config is not None and config.strict)


def fall_back(message: str, config: Config | None = None, *, warn: bool = True, stacklevel: int = 2) -> None:
    """Raise FallbackError in strict mode; otherwise warn (``warn=False``: the report alone says it, as for an
    unsupported pattern a pass summary names)."""
    if strict(config):
        raise FallbackError(f"{message} [strict mode: Config(strict=True) or {STRICT_ENV}=1 makes this an error]")
    if warn:
        warnings.warn(message, FallbackWarning, stacklevel=stacklevel + 1)


def unsupported(message: str, config: Config | None = None) -> None:
    """A pattern an enabled technique targets, left as torch runs it: the pass's summary says so, and strict mode
    raises."""
    fall_back(message, config, warn=False)
