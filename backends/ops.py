"""The op registry: every fused op of the model sits here beside its reference, each implementation
declaring what it supports, and a config's ``[ops]`` section picks one implementation per op, once,
when the backend is built (``Backend.use_ops``).

    op                  contract (fn(B, ...) -> ...)                                   module
    attention           HSTU attention of a jagged batch                               kernels.py
    ranking_attention   target-aware (STU) attention of the ranking model              kernels.py
    sampled_logits      <user_t, items[ids[t, r]]>, optionally 16-bit negatives        loss_ops.py
    shared_logsumexp    logsumexp over a position's logit and a shared negative pool   loss_ops.py
    row_update          the row-sparse optimizer update of the looked-up rows          row_kernels.py

An implementation declares the backends that run it (None: written on ``B.xp``, every backend), the
``backend.dtype`` values, ``backend.precision`` values and device kinds it runs, and optionally
``limits(cfg)``: limits a whole config can violate (model shapes, a table width). Asked for anything
else, it is refused by name when the config is checked (``config_problems``) and again when a backend
is built (``build``: the device kind is known then), never silently replaced. ``"default"`` means the
backend's own choice (``Backend.default_ops``). Each op's "reference" runs everywhere and is the
oracle its other implementations are differential-tested against (tests/differential).

A new implementation is one ``register`` call from any module (an experiment, a ``--plugin``)::

    @ops.register("sampled_logits", "mine", backends=("torch",))
    def mine(B, user, items, ids, scale=None, precision=None): ...

and ``--set ops.sampled_logits=mine`` selects it. Attention kernels have their own front
(``backends.kernels.register_kernel``), which adds the attention's model options.

This module imports no array library and no backend module: the config check runs without them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from gr_functional.errors import ConfigError, UnsupportedOnBackend
from gr_functional.registry import Registry, did_you_mean

from .catalog import BackendUnavailable, backend_class

DTYPES = ("float32", "float64")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One registered implementation of op ``op`` (module docstring): ``factory(B) -> fn`` runs
    once when a backend selecting it is built, raising ``npu_ops.UnsupportedOnBackend`` /
    ``ImportError`` / ``BackendUnavailable`` with the reason when it cannot run here."""

    op: str
    name: str
    factory: Callable[[Any], Callable]
    backends: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] = DTYPES
    precisions: tuple[str, ...] = PRECISIONS
    devices: tuple[str, ...] | None = None
    check: Callable[[Any], tuple[str, str] | None] | None = None
    doc: str = ""
    source: Any = dataclasses.field(default=None, compare=False, repr=False)  # the registered fn or factory

    def runs_on(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends

    def limits(self, cfg) -> tuple[str, str] | None:
        """``(option, why)`` of a config this implementation cannot serve, or None."""
        return self.check(cfg) if self.check is not None else None

    def unsupported(self, *, dtype: str | None = None, precision: str | None = None, device: str | None = None,
                    cfg: Any = None) -> tuple[str, str] | None:
        """``(option, what it supports)`` of the first option given that this implementation
        lacks, or None. ``cfg``: a whole ``Config`` (``limits``)."""
        if dtype is not None and dtype not in self.dtypes:
            return f"backend.dtype={dtype!r}", f"it runs {', '.join(self.dtypes)}"
        if precision is not None and precision not in self.precisions:
            return f"backend.precision={precision!r}", f"it runs {', '.join(self.precisions)}"
        if device is not None and self.devices is not None and device not in self.devices:
            return f"device {device!r}", f"it runs on {', '.join(self.devices)}"
        return self.limits(cfg) if cfg is not None else None


@dataclasses.dataclass(frozen=True)
class Op:
    """An op the model calls through the backend (``B.hstu_attention``, ``B.sampled_logits``, ...),
    its one-line contract and its registered implementations."""

    name: str
    contract: str
    impls: Registry[Impl]

    @property
    def config_key(self) -> str:
        return f"ops.{self.name}"


OPS: dict[str, Op] = {}


def define_op(name: str, contract: str, kind: str = "implementation") -> Op:
    """Declare op ``name`` (the project's model code calls it; ``[ops] name`` selects it)."""
    if name in OPS:
        raise ValueError(f"op {name!r} is defined already")
    how = (f"Register one with @backends.ops.register({name!r}, NAME, ...) in a module passed to grf train --plugin"
           if kind == "implementation" else
           "Register one with @backends.kernels.register_kernel(NAME, ...) in a module passed to grf train --plugin")
    OPS[name] = Op(name, contract, Registry(f"{name} {kind}", config_key=f"ops.{name}", how=how))
    return OPS[name]


define_op("attention", "fn(B, q[T, H, dqk], k[T, H, dqk], v[T, H, dv], layout, norm_len, bias) -> [T, H, dv] "
                       "(backends/kernels.py)", kind="kernel")
define_op("ranking_attention", "fn(B, q, k, v, layout, num_targets[B] int32, norm_len, alpha) -> [T, H, dv]: "
                               "target-aware attention of the ranking model")
define_op("sampled_logits", "fn(B, user[T, D], items[N, D], ids[T, R] int32, scale[T] | None, precision | None) "
                            "-> [T, R]; scale given: 16-bit negatives (Backend.sampled_logits_16bit)")
define_op("shared_logsumexp", "fn(B, user[T, D], neg_items[R, D], neg_ids[R], targets[T], pos[T], neg_bias[R], "
                              "scale, masked_logit) -> lse[T]")
define_op("row_update", "fn(B, optimizer, values[U, D], grads[U, D], state_rows, touched[U], lr, cfg) -> "
                        "(values, state_rows): the row-sparse embedding update (backends/row_kernels.py)")


def get_op(op: str) -> Op:
    try:
        return OPS[op]
    except KeyError:
        raise KeyError(f"no op named {op!r}{did_you_mean(op, OPS)}; ops: {', '.join(OPS)}") from None


def register(op: str, name: str, fn: Callable | None = None, *, factory: Callable[[Any], Callable] | None = None,
             backends: tuple[str, ...] | None = None, dtypes: tuple[str, ...] = DTYPES,
             precisions: tuple[str, ...] = PRECISIONS, devices: tuple[str, ...] | None = None,
             check: Callable[[Any], tuple[str, str] | None] | None = None, doc: str = "", replace: bool = False,
             impl_class: type = Impl, **extra):
    """Register implementation ``name`` of ``op``: ``fn`` (``@register(op, name, ...)`` works as a
    decorator) or ``factory(B) -> fn``. The other arguments declare what it supports (``Impl``;
    ``impl_class`` and ``extra``: an op's own declaration, as attention kernels have). A taken name
    raises unless ``replace=True`` or it is the same function again (a module imported twice)."""
    spec = get_op(op)
    if name == "default":
        raise ValueError("'default' is not an implementation name: it means the backend's own choice")
    if fn is not None and factory is not None:
        raise ValueError(f"register({op!r}, {name!r}): pass fn or factory, not both")
    bad = [d for d in dtypes if d not in DTYPES] + [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise ValueError(f"register({op!r}, {name!r}): unknown dtype/precision {bad!r}; dtypes: {DTYPES}, "
                         f"precisions: {PRECISIONS}")

    def add(impl_fn: Callable | None, impl_factory: Callable | None):
        made = impl_factory if impl_factory is not None else (lambda B: impl_fn)
        source = impl_fn if impl_fn is not None else impl_factory
        text = doc or (source.__doc__ or "").strip().split("\n")[0]
        impl = impl_class(op, name, made, tuple(backends) if backends is not None else None, tuple(dtypes),
                          tuple(precisions), tuple(devices) if devices is not None else None, check, text, source,
                          **extra)
        spec.impls.add(name, impl, origin_of=source, replace=replace)
        return source

    if fn is None and factory is None:
        return lambda f: add(f, None)
    return add(fn, factory)


def unregister(op: str, name: str) -> None:
    """Remove implementation ``name`` of ``op`` (tests, plugins); unknown names are ignored."""
    get_op(op).impls.remove(name)


def impl_names(op: str, backend: str | None = None) -> tuple[str, ...]:
    """Registered implementations of ``op`` (those that run on ``backend`` when given)."""
    return tuple(i.name for i in get_op(op).impls.values() if backend is None or i.runs_on(backend))


def valid_names(op: str, backend: str) -> tuple[str, ...]:
    """The ``ops.<op>`` values ``backend`` accepts: "default" and its implementations."""
    return ("default",) + impl_names(op, backend)


def get_impl(op: str, name: str) -> Impl:
    """The registered implementation ``name`` (not "default"), or ConfigError naming the registered ones."""
    return get_op(op).impls.get_or(name, lambda message: ConfigError(f"ops.{op}={name!r}: {message}"))


def default_impl(op: str, backend: str) -> str:
    """What ``"default"`` means for ``op`` on ``backend`` (its class's ``default_ops``)."""
    return backend_class(backend).default_ops[op]


def resolve(op: str, name: str, backend: str) -> str:
    return default_impl(op, backend) if name == "default" else name


def _quoted(names) -> str:
    return ", ".join(repr(n) for n in names)


def problem(op: str, name: str, backend: str, *, dtype: str | None = None, precision: str | None = None,
            device: str | None = None, cfg: Any = None) -> str | None:
    """Why ``ops.<op> = name`` cannot run on ``backend`` with these options (each None is not
    checked), or None when it can. The reason names the implementation, the option and the
    implementations of ``backend`` that support it."""
    spec = get_op(op)
    word = spec.impls.kind.split(" ", 1)[1]
    resolved = resolve(op, name, backend)
    impl = spec.impls.find(resolved)
    if impl is None:
        return (f"the {backend} backend has no such {word}{did_you_mean(resolved, valid_names(op, backend))}; "
                f"valid for {backend}: {_quoted(valid_names(op, backend))}")
    if not impl.runs_on(backend):
        return (f"{word} {resolved!r} does not run on the {backend} backend (it runs on "
                f"{', '.join(impl.backends or ())}); valid for {backend}: {_quoted(valid_names(op, backend))}")
    options = dict(dtype=dtype, precision=precision, device=device, cfg=cfg)
    lacking = impl.unsupported(**options)
    if lacking is None:
        return None
    option, supported = lacking
    others = [i.name for i in spec.impls.values() if i.runs_on(backend) and i.unsupported(**options) is None]
    label = f"{word} {resolved!r}" + (f" (the {backend} default)" if name == "default" else "")
    alternatives = (f"{word}s for {backend} that support it: {_quoted(others)}" if others
                    else f"no {word} for {backend} supports it")
    return f"{label} does not support {option}: {supported}; {alternatives}"


def check(op: str, name: str, backend: str, **options) -> Impl:
    """The implementation ``name`` resolves to on ``backend``, or ConfigError with ``problem``'s reason."""
    reason = problem(op, name, backend, **options)
    if reason is not None:
        raise ConfigError(f"ops.{op}={name!r}: {reason}")
    return get_op(op).impls.get(resolve(op, name, backend))


def choices(cfg) -> dict[str, str]:
    """``{op: name}`` of a Config's ``[ops]`` section."""
    return {op: getattr(cfg.ops, op) for op in OPS}


def config_problems(cfg) -> list[tuple[str, str, str]]:
    """``(section, key, reason)`` of every ``[ops]`` choice that cannot run with ``cfg`` (backend,
    dtype, precision, limits; the device is checked when the backend is built, where its kind is
    known)."""
    b = cfg.backend
    found = []
    for op, name in choices(cfg).items():
        reason = problem(op, name, b.name, dtype=b.dtype, precision=b.precision, cfg=cfg)
        if reason:
            found.append(("ops", op, reason))
    return found


def portable(chosen: dict[str, str], backend: str) -> dict[str, str]:
    """``chosen`` ({op: name}) on another backend: each choice that exists there kept, the others
    "default" (a run's kernels may not exist where it is evaluated or cross-checked)."""
    return {op: name if name in valid_names(op, backend) else "default" for op, name in chosen.items()}


def build(B, op: str, name: str) -> tuple[Impl, Callable]:
    """``(impl, fn)`` for backend ``B``: resolve ``name`` ("default": B's own choice), check B's
    backend, dtype and device against the declaration (ConfigError naming the option), then run the
    factory (BackendUnavailable with the reason when the implementation cannot run here)."""
    impl = check(op, name, B.name, dtype=B.dtype_name, device=B.device_kind)
    try:
        fn = impl.factory(B)
    except (UnsupportedOnBackend, ImportError) as exc:
        raise BackendUnavailable(f"backend {B.name!r}: ops.{op}={impl.name!r} cannot run here: {exc}. Choose "
                                 f"another with ops.{op} (valid for {B.name}: "
                                 f"{_quoted(valid_names(op, B.name))})") from exc
    return impl, fn


__all__ = ["DTYPES", "Impl", "OPS", "Op", "PRECISIONS", "build", "check", "choices", "config_problems",
           "default_impl", "define_op", "get_impl", "get_op", "impl_names", "portable", "problem", "register",
           "resolve", "unregister", "valid_names"]
