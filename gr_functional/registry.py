"""One registry for every extension point: names -> entries, with one rule for a name registered twice
and one did-you-mean message. Losses, datasets, tasks, kernels/ops, hooks, optimizers and backends
each hold a ``Registry``; the entry type is theirs.

    LOSSES = Registry("loss", config_key="loss.name",
                      how="@gr_functional.losses.register(NAME) in a module passed to grf train --plugin")
    LOSSES.add("bce", entry, origin=fn)          # or @LOSSES.decorator(lambda name, fn: Loss(name, fn))
    LOSSES.get("bce")                            # the entry, or KeyError with the message below
    LOSSES.unknown_message("bcee")               # "no loss named 'bcee' is registered (did you mean 'bce'?); ..."

A name registered again is refused unless ``replace=True`` or the new entry comes from the same
definition (same file and qualified name: a plugin module imported once as a script and once by name
registers "the same" thing twice, which is allowed). Leaf module: imports nothing of the project.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


def origin(obj: Any) -> tuple:
    """Where ``obj`` (a function or class) was defined: (file, qualified name); entries with equal
    origins are the same definition imported twice."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        where = code.co_filename
    else:
        try:
            where = inspect.getsourcefile(obj)
        except TypeError:
            where = None
        where = where or getattr(obj, "__module__", None)
    return where, getattr(obj, "__qualname__", repr(obj))


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"


def did_you_mean(name: Any, known) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``known``, or ``""``."""
    near = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


class Registry(Generic[T]):
    """Named entries of one kind (``kind``: "loss", "dataset", ...), in registration order.

    ``config_key``: the config key that names an entry (for messages); ``how``: how a user registers
    one of their own (ends the unknown-name message; ``NAME`` in it becomes the name asked for); ``load``: called once before the first lookup
    (imports the modules that register the shipped entries); ``order``: a sort key ``(name, entry)``
    for listing (stable; default registration order), so that shipped entries list in a fixed order
    however their modules happened to be imported."""

    def __init__(self, kind: str, *, config_key: str = "", how: str = "", load: Callable[[], None] | None = None,
                 order: Callable[[str, T], Any] | None = None):
        self.kind = kind
        self.config_key = config_key
        self.how = how
        self._entries: dict[str, T] = {}
        self._origins: dict[str, tuple] = {}
        self._load = load
        self._loading = False
        self._order = order

    # ------------------------------------------------------------------ registering
    def add(self, name: str, entry: T, *, origin_of: Any = None, replace: bool = False) -> T:
        """Register ``entry`` as ``name``. ``origin_of``: the function or class that defines it (the
        entry itself by default), compared to decide whether a taken name is the same definition."""
        self._ensure_loaded()
        source = entry if origin_of is None else origin_of
        old = self._entries.get(name)
        if old is not None and not replace:
            old_source = self._origins[name][0]
            if not (old_source is source or self._origins[name][1] == origin(source)):
                raise ValueError(f"a {self.kind} named {name!r} is already registered ({_describe(old_source)}); "
                                 f"pick another name or pass replace=True")
        self._entries[name] = entry
        self._origins[name] = (source, origin(source))
        return entry

    def source(self, name: str) -> Any:
        """The function or class that defines entry ``name`` (its module is where it was registered)."""
        self._ensure_loaded()
        return self._origins[name][0]

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)
        self._origins.pop(name, None)

    @contextlib.contextmanager
    def scoped(self):
        """Registrations made inside the block are undone after it (tests; a notebook trying a
        plugin)."""
        self._ensure_loaded()
        entries, origins = dict(self._entries), dict(self._origins)
        try:
            yield self
        finally:
            self._entries, self._origins = entries, origins

    # ------------------------------------------------------------------ looking up
    def _ensure_loaded(self) -> None:
        if self._load is not None and not self._loading:
            self._loading = True          # first: the loaded modules register here, re-entering
            load, self._load = self._load, None
            try:
                load()
            finally:
                self._loading = False

    def items(self) -> Iterator[tuple[str, T]]:
        self._ensure_loaded()
        pairs = list(self._entries.items())
        if self._order is not None:
            pairs.sort(key=lambda pair: self._order(*pair))
        return iter(pairs)

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.items())

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._entries)

    def unknown_message(self, name: Any, among=None) -> str:
        """Why ``name`` is not usable: nearest registered name, the registered ones, how to add one.
        ``among``: the names that would be accepted here (default: all registered)."""
        known = list(self.names() if among is None else among)
        text = (f"no {self.kind} named {name!r} is registered{did_you_mean(name, known)}; registered: "
                f"{', '.join(map(repr, known)) or 'none'}")
        return f"{text}. {self.how.replace('NAME', repr(name))}" if self.how else text

    def find(self, name: str) -> T | None:
        """The entry ``name``, or None."""
        self._ensure_loaded()
        return self._entries.get(name)

    def values(self) -> list[T]:
        return [entry for _, entry in self.items()]

    def get(self, name: str) -> T:
        """The entry ``name``, or ``KeyError(unknown_message(name))``."""
        self._ensure_loaded()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown_message(name)) from None

    def get_or(self, name: str, error: Callable[[str], Exception]) -> T:
        """The entry ``name``, or raise ``error(unknown_message(name))`` (e.g. ConfigError)."""
        self._ensure_loaded()
        if name not in self._entries:
            raise error(self.unknown_message(name))
        return self._entries[name]
