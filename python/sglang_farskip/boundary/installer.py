"""Puts the table's installed rows in place (hooks, replacements, registry entries) and tells
what is not in place; the one module that writes into SGLang.

The plugin installs "every" and, on CPU, "cpu" at plugin load (SGLang's `load_plugins()` then
applies the hooks); the launcher installs "http" in its HTTP process before serving and applies
them itself. `missing()` compares what is in place with the table, so that a hook SGLang failed
to apply (it logs the error and goes on) stops the launcher instead of serving without it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil

from sglang_farskip.boundary.table import HOOK_KINDS, INSTALLED, ROWS, Row

logger = logging.getLogger("sglang_farskip.boundary")

_installed: set[str] = set()
_originals: dict[str, object] = {}  # hook and replace targets: what SGLang had before us


def owned(spec: str):
    """Our object named "module:attribute" (the module itself without ":attribute"; "name()"
    calls a factory)."""
    module, _, attribute = spec.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        call = part.endswith("()")  # a class built on first use: "module:factory()"
        obj = getattr(obj, part.removesuffix("()"))
        obj = obj() if call else obj
    return obj


def split(target: str) -> tuple[object, str]:
    """(the object holding the attribute, the attribute's name) of an SGLang dotted path."""
    holder, _, attribute = target.rpartition(".")
    return pkgutil.resolve_name(holder), attribute


def raw(holder: object, attribute: str):
    """The attribute as stored (a classmethod object, not the bound method), or a sentinel."""
    if inspect.isclass(holder):
        for klass in holder.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute]
        return _ABSENT
    return getattr(holder, attribute, _ABSENT)


_ABSENT = object()


def rows(group: str) -> list[Row]:
    return [r for r in ROWS if r.processes == group and r.kind in INSTALLED]


def _wanted(row: Row) -> bool:
    return not row.only_if or bool(owned(row.only_if)())


def install(group: str) -> None:
    """Register the hooks and put the replacements and registry entries of `group` in place.
    Idempotent per process."""
    if group in _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for row in rows(group):
        if not _wanted(row):
            continue
        value = owned(row.owner)
        if row.kind in HOOK_KINDS:
            _originals[row.target] = raw(*split(row.target))
            HookRegistry.register(row.target, value, HookType[row.kind.upper()])
        elif row.kind == "replace":
            holder, attribute = split(row.target)
            _originals[row.target] = original = getattr(holder, attribute)
            setattr(holder, attribute, value(original))  # the owner wraps upstream's object
        else:
            _register(row, value)
    _installed.add(group)


def _register(row: Row, value) -> None:
    registry = pkgutil.resolve_name(row.target)
    if row.how == "item":
        registry[row.key] = value
    elif row.how == "call":
        registry(row.key, value)
    elif row.how == "decorator":
        registry(row.key)(value)
    elif row.how == "name":
        registry(row.key)
    elif row.how == "middleware":  # app.add_middleware(cls): before the app first serves
        registry(value)
    else:
        raise ValueError(f"boundary row {row.target}: unknown registry style {row.how!r}")


def apply() -> None:
    """Apply the registered hooks now (the launcher's HTTP group; plugin hooks are applied by
    SGLang's load_plugins)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


def missing(group: str) -> list[str]:
    """The rows of an installed `group` that are not in place, as "kind target (owner)"."""
    out = []
    for row in rows(group):
        if not _wanted(row):
            continue
        if not _in_place(row):
            out.append(f"{row.kind} {row.target} ({row.owner})")
    return out


def _in_place(row: Row) -> bool:
    if row.kind in HOOK_KINDS or row.kind == "replace":
        original = _originals.get(row.target, _ABSENT)
        return original is not _ABSENT and raw(*split(row.target)) is not original
    value = owned(row.owner)
    if row.how == "item":
        return pkgutil.resolve_name(row.target).get(row.key) is value
    return _registered(row, value)


def _registered(row: Row, value) -> bool:
    """Registry rows reached through a function: read back where each function writes."""
    if row.how == "call":  # AttentionBackendRegistry.register(name, handler)
        holder, _ = split(row.target)
        return holder.get_handler(row.key) is value
    if row.how == "middleware":  # app.add_middleware(cls)
        app, _ = split(row.target)
        return any(m.cls is value for m in app.user_middleware)
    if row.how == "decorator":  # register_attention_backend(name)(factory)
        holder = importlib.import_module(row.target.rpartition(".")[0])
        return holder.ATTENTION_BACKENDS.get(row.key) is value
    from sglang.srt.arg_groups import choices  # add_chunked_prefix_cache_attention_backend(name)

    return row.key in choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS


def swap_class(obj, cls) -> None:
    """Give `obj` (an SGLang object) the class `cls` of ours, as a class-swap row of the table
    allows: `obj` must be exactly that row's SGLang class and `cls` a subclass of it."""
    owner = f"{cls.__module__}:{cls.__qualname__}"
    row = next((r for r in ROWS if r.kind == "class-swap" and r.owner == owner), None)
    if row is None:
        raise RuntimeError(f"{owner} is not a class-swap of sglang_farskip/boundary/table.csv")
    base = pkgutil.resolve_name(row.target)
    if type(obj) is not base or not issubclass(cls, base):
        raise RuntimeError(f"class swap {row.target} -> {owner}: the object is a {type(obj).__qualname__}")
    obj.__class__ = cls
