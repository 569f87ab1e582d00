"""The classes of attnbook of one kind, found in the package's sources instead
of listed by hand, so that a test parametrised over them takes a new class
without being edited: the KV caches (tests/test_cache_protocol.py) and the
subclasses of a layer (tests/test_torch_attention.py).

Only the modules that define a class found are imported (never, say, the Triton
kernels).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import attnbook

PACKAGE = Path(attnbook.__file__).resolve().parent


def defined_classes():
    """``(module name, ast.ClassDef)`` of every class defined at the top level
    of a package module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("attnbook",) + path.relative_to(PACKAGE).with_suffix("").parts
        module = ".".join(parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                yield module, node


def base_names(node: ast.ClassDef) -> set[str]:
    """The names of a class's bases, without their modules:
    ``{"MultiHeadAttention", "Protocol"}``."""
    return {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}


def load(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def cache_classes() -> list[type]:
    """Every KV cache of the package: a class named ``...Cache``, or one that
    defines ``update`` and ``reset``; not the protocol they follow (a class
    derived from ``typing.Protocol``)."""
    found = []
    for module, node in defined_classes():
        methods = {
            item.name
            for item in node.body
            if isinstance(item, ast.FunctionDef)
        }
        if "Protocol" in base_names(node):
            continue
        if node.name.endswith("Cache") or {"update", "reset"} <= methods:
            found.append(load(module, node.name))
    return found


def subclasses(base: type) -> list[type]:
    """``base`` and every class of the package derived from it, directly or
    through another one."""
    found, names, grown = [base], {base.__name__}, True
    # a class may derive from one found in the previous round
    while grown:
        grown = False
        for module, node in defined_classes():
            if node.name not in names and base_names(node) & names:
                cls = load(module, node.name)
                if issubclass(cls, base):
                    found.append(cls)
                    names.add(node.name)
                    grown = True
    return found


def required_arguments(cls: type, known) -> list[str]:
    """The arguments that ``cls``'s constructor requires (no default) and that
    are not in ``known``."""
    return [
        name
        for name, p in inspect.signature(cls).parameters.items()
        if name not in known
        and p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
