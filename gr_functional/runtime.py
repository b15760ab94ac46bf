"""The backend a config asks for (``make_backend``): kernels, compile, determinism, device."""
from __future__ import annotations

from backends import backend_class, get_backend

from .config import Config


def make_backend(cfg: Config, device: str | None = None):
    """The backend of ``cfg.backend``; ``device`` overrides ``backend.device`` (a rank's device)."""
    options = {"device": device or cfg.backend.device or None, "dtype": cfg.backend.dtype}
    if cfg.backend.hstu_kernel != "default":
        options["hstu_kernel"] = cfg.backend.hstu_kernel
    if cfg.backend.row_kernel != "default":
        options["row_kernel"] = cfg.backend.row_kernel
    if cfg.backend.compile:
        options["compile"] = True
    if not cfg.backend.cpu_fused:
        options["cpu_fused"] = False
    backend_class(cfg.backend.name).prepare_process(attention_recompute=cfg.backend.attention_recompute)
    B = get_backend(cfg.backend.name, **options)
    if cfg.backend.attention_recompute:
        B = B.with_attention_recompute(True)
    B.set_deterministic(cfg.backend.deterministic)
    return B
