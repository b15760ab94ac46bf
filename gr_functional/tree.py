"""Pytree utilities shared by every backend.

A tree is built from dicts, lists, tuples, None and frozen dataclasses; anything else is a
leaf. Dataclass fields whose metadata says ``static=True`` are carried unchanged (they are
shapes and flags, not arrays). JAX registers the same dataclasses as native pytrees
(backends/jax.py), so a batch crosses ``jax.jit`` as arguments, never as closure constants.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

STATIC = {"static": True}


def static_field(**kwargs):
    """A dataclass field that is metadata (a shape, a flag), not an array leaf."""
    return dataclasses.field(metadata=STATIC, **kwargs)


def is_static(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("static", False))


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn`` leaf-wise over one or more trees of the same structure."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {k: tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {}
        for f in dataclasses.fields(tree):
            if is_static(f):
                continue
            changes[f.name] = tree_map(fn, getattr(tree, f.name), *(getattr(r, f.name) for r in rest))
        return dataclasses.replace(tree, **changes)
    return fn(tree, *rest)


def tree_items(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` in a deterministic order; paths look like ``blocks.0.w_uvqk``.

    Dict keys are visited in sorted order so two backends (JAX sorts dict keys, torch keeps
    insertion order) always pair the same leaves.
    """
    def join(name):
        return f"{prefix}.{name}" if prefix else str(name)

    if tree is None:
        return
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from tree_items(tree[k], join(k))
    elif isinstance(tree, (list, tuple)):
        for i, t in enumerate(tree):
            yield from tree_items(t, join(i))
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            if not is_static(f):
                yield from tree_items(getattr(tree, f.name), join(f.name))
    else:
        yield prefix, tree


def tree_leaves(tree: Any) -> list:
    return [leaf for _, leaf in tree_items(tree)]


def tree_from_items(items: dict[str, Any]) -> dict:
    """Inverse of ``tree_items`` for nested dicts/lists of leaves (checkpoint loading).

    Integer path components become list indices.
    """
    root: dict = {}
    for path, leaf in items.items():
        node = root
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    return _lists_from_int_keys(root)


def _lists_from_int_keys(node):
    if not isinstance(node, dict):
        return node
    node = {k: _lists_from_int_keys(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node):
        return [node[str(i)] for i in range(len(node))]
    return node


def tree_map_with_path(fn: Callable[[str, Any], Any], tree: Any, prefix: str = "") -> Any:
    """Like ``tree_map`` but ``fn(path, leaf)``; paths match ``tree_items``."""
    def join(name):
        return f"{prefix}.{name}" if prefix else str(name)

    if tree is None:
        return None
    if isinstance(tree, dict):
        return {k: tree_map_with_path(fn, v, join(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(tree_map_with_path(fn, t, join(i)) for i, t in enumerate(tree))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {f.name: tree_map_with_path(fn, getattr(tree, f.name), join(f.name))
                   for f in dataclasses.fields(tree) if not is_static(f)}
        return dataclasses.replace(tree, **changes)
    return fn(prefix, tree)
