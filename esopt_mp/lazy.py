"""A package's names loaded on first use (PEP 562), so importing one light submodule (a section's config) does not
import the package's heavy ones (torch)."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` of ``package``: attribute ``name`` imports ``package.<exports[name]>`` on first
    access and stays in the package's ``namespace``; an unknown name is the usual AttributeError."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(namespace.get("__all__", exports)))

    return __getattr__, __dir__


def moved_names(module: str, moved: dict[str, str]):
    """``__getattr__`` of ``module`` for names that moved to another module (``moved``: name -> its new module): the
    name, with a one-line notice of where it lives now; the old spelling is kept one release."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        import warnings

        warnings.warn(f"{module}.{name} is now {moved[name]}.{name}: import it from there (the old name goes in the "
                      f"next release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__
