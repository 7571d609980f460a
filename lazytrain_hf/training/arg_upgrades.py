"""The maintained combinations of a `TrainingArguments` subclass with `LazyTrainingArguments`, by class name.

`lazytrain_hf.args.upgraded_class` gives the registered class instead of making one: trl's `SFTConfig` becomes
`lazytrain_hf.trl.LazySFTConfig`, with its own defaults and checks. The registry lives below the trainer floor so that
the package's ``__init__`` registers trl's combination at import (as a function: ``import lazytrain_hf`` never imports
trl) while `args` reads it without importing `lazytrain_hf.trl`, which imports `args`. A leaf module: it imports
nothing of the package.
"""

from __future__ import annotations

from collections.abc import Callable

# (qualified-name prefix, class name) of a TrainingArguments subclass -> a function returning its maintained class
MAINTAINED_UPGRADES: dict[tuple[str, str], Callable[[], type]] = {}


def register_upgrade(prefix: str, name: str, maintained_class: Callable[[], type]) -> None:
    """Make `upgraded_class` give ``maintained_class()`` for a class named ``name`` whose qualified name starts with
    ``prefix`` (where it derives from the requested `LazyTrainingArguments` class), instead of making one."""
    MAINTAINED_UPGRADES[(prefix, name)] = maintained_class


def maintained_upgrade(base: type) -> type | None:
    """The maintained class registered for ``base`` (its qualified name and class name), or None."""
    for (prefix, name), maintained_class in MAINTAINED_UPGRADES.items():
        if f"{base.__module__}.{base.__qualname__}".startswith(prefix) and base.__name__ == name:
            return maintained_class()
    return None
