"""Load user-supplied algorithm hooks from a ``module:function`` spec.

Where it fits: config validation resolves ``--custom-advantage-function-path``
and ``--custom-loss-function-path`` with :func:`load_function`, passing the
built-in it replaces as ``expected`` (``compute_advantages`` /
``policy_loss``), so a hook with the wrong shape fails at start-up with one
clear line instead of deep inside the first training step.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_FORM = "expected 'module.path:function' or 'path/to/file.py:function'"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# Keyword-only parameters the loop passes only to a hook that names them (the rollout
# manager probes for ``valid``); every other keyword-only one is passed on every call.
OPTIONAL_KEYWORDS = frozenset({"valid"})


def load_function(spec: str, *, expected: Callable | None = None) -> Callable:
    """Return the callable named by ``spec`` = ``<module>:<attr>``.

    ``<module>`` is an importable dotted name, or a path to a ``.py`` file
    (anything ending in ``.py`` or containing ``/``), relative to the current
    directory or absolute. ``<attr>`` may be dotted (``Class.method``).

    With ``expected`` given, the function must accept the positional
    parameters of ``expected`` by the same names in the same order (a
    ``*args`` covers any beyond its named ones) and its keyword-only ones
    (``OPTIONAL_KEYWORDS`` aside) by name or ``**kwargs``; parameters it adds
    must have defaults. Every failure is a ``ValueError`` with a one-line message.
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"bad function spec {spec!r}: {_FORM}")
    module_part, _, attr_part = spec.rpartition(":")
    if not module_part or not attr_part or not all(a.isidentifier() for a in attr_part.split(".")):
        raise ValueError(f"bad function spec {spec!r}: {_FORM}")

    module = import_module_spec(module_part)
    obj: object = module
    for i, name in enumerate(attr_part.split(".")):
        if not hasattr(obj, name):
            owner = ".".join([module_part, *attr_part.split(".")[:i]])
            raise ValueError(f"{spec!r}: module {owner!r} has no attribute {name!r}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {attr_part!r} is a {type(obj).__name__}, not callable")
    if expected is not None:
        _check_signature(spec, obj, expected)
    return obj


def import_module_spec(module_part: str) -> ModuleType:
    """The module of a spec's ``<module>`` part: a dotted name, or a ``.py`` file path
    (anything ending in ``.py`` or containing ``/``); a one-line ``ValueError`` if not."""
    if module_part.endswith(".py") or "/" in module_part:
        return _import_file(Path(module_part))
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as e:
        # Only "not found" when the missing module is the one asked for (or a
        # parent of it); a missing dependency inside it is a different error.
        if e.name is not None and (module_part == e.name or module_part.startswith(e.name + ".")):
            raise ValueError(f"module {module_part!r} not found (not importable)") from e
        raise ValueError(f"importing module {module_part!r} failed: {e}") from e
    except Exception as e:
        raise ValueError(f"importing module {module_part!r} failed: {type(e).__name__}: {e}") from e


def _import_file(path: Path) -> ModuleType:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"module file {str(path)!r} not found")
    # A unique name per file, so two hooks both called `hooks.py` don't collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_vime_custom_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered before exec, as a normal import does
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"importing {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module


def _check_signature(spec: str, fn: Callable, expected: Callable) -> None:
    want = [
        p.name for p in inspect.signature(expected).parameters.values() if p.kind in _POSITIONAL
    ]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    got = [p.name for p in params if p.kind in _POSITIONAL]

    # Expected parameter i must be the function's parameter i (callers pass
    # them positionally); past the function's named ones only *args can take it.
    missing = [w for i, w in enumerate(want) if (got[i] != w if i < len(got) else not has_varargs)]
    # Keyword-only parameters of ``expected`` are passed by name: the function must
    # take each by that name, or take any keyword (**kwargs).
    by_name = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    has_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    missing += [
        p.name
        for p in inspect.signature(expected).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.name not in OPTIONAL_KEYWORDS | by_name
        and not has_varkw
    ]
    extra = [
        p.name
        for p in params
        if p.name not in want
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing or misplaced {missing}")
        if extra:
            parts.append(f"extra required {extra}")
        raise ValueError(
            f"{spec!r}: signature {inspect.signature(fn)} does not match "
            f"{getattr(expected, '__name__', 'expected')}{inspect.signature(expected)}: "
            + "; ".join(parts)
        )
