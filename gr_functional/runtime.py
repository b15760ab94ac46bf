"""The backend a config asks for (``make_backend``): its ops, compile, determinism, device."""
from __future__ import annotations

from backends import backend_class, get_backend, ops

from .config import Config


def prepare_process(cfg: Config) -> None:
    """The process-wide settings ``cfg`` asks of its backend, before the backend (or anything that
    asks the array library about its devices) starts: ``Backend.prepare_process``. Idempotent."""
    backend_class(cfg.backend.name).prepare_process(cfg)


def make_backend(cfg: Config, device: str | None = None):
    """The backend of ``cfg.backend``; ``device`` overrides ``backend.device`` (a rank's device)."""
    options = {"device": device or cfg.backend.device or None, "dtype": cfg.backend.dtype}
    chosen = {op: name for op, name in ops.choices(cfg).items() if name != "default"}
    if chosen:
        options["ops"] = chosen
    if cfg.backend.compile:
        options["compile"] = True
    prepare_process(cfg)
    B = get_backend(cfg.backend.name, **options)
    if cfg.backend.attention_recompute:
        B = B.with_attention_recompute(True)
    B.set_deterministic(cfg.backend.deterministic)
    return B
