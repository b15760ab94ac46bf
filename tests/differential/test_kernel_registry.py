"""The attention-kernel registry (backends/kernels.py) from a user's side: a kernel registered
outside the package is selected by ``ops.attention``, picked up by the differential suite
and trained with by ``grf train``; kernels refuse options they do not support, by name."""
from __future__ import annotations

import json

import pytest

from backends import get_backend, kernels
from backends.kernels import register_kernel, unregister_kernel
from gr_functional.cli import main
from gr_functional.configure import load_config
from gr_functional.errors import ConfigError

from .common import LAYOUT_CASES, check_attention_kernel, kernel_backend, kernel_pairs
from .test_model import check_model_kernel

CALLS = {"loop": 0}


def loop_attention(B, q, k, v, layout, norm_len, bias):
    """One sequence at a time (torch): dense causal scores of each sequence plus its slice of
    the dense bias ``B.relative_bias``. q[T, H, dqk], k[T, H, dqk], v[T, H, dv] -> [T, H, dv]."""
    import torch
    import torch.nn.functional as F

    CALLS["loop"] += 1
    rab = B.relative_bias(layout, norm_len, bias)                  # [B_cap | 1, L, L] or None
    offsets = [int(x) for x in layout.offsets.tolist()]
    pieces = []
    for b, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        n = e - s
        if n == 0:
            continue
        scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e])       # [H, n, n]
        if rab is not None:
            scores = scores + rab[b if rab.shape[0] > 1 else 0, :n, :n]
        causal = torch.tril(torch.ones(n, n, dtype=scores.dtype, device=scores.device))
        pieces.append(torch.einsum("hij,jhd->ihd", F.silu(scores) * causal / norm_len, v[s:e]))
    pad = v.new_zeros((v.shape[0] - offsets[-1],) + tuple(v.shape[1:]))  # padding rows
    return torch.cat(pieces + [pad], dim=0)


@pytest.fixture
def loop_kernel():
    """"loop" registered as a user would (one call, outside the package) for the test's duration."""
    register_kernel("loop", loop_attention, backends=("torch",), precisions=("fp32",))
    yield "loop"
    unregister_kernel("loop")


@pytest.mark.slow
def test_a_registered_kernel_is_picked_up_by_the_differential_suite(loop_kernel):
    assert ("torch", "loop") in kernel_pairs()
    B = kernel_backend("torch", "loop")
    assert B.hstu_kernel == "loop"
    before = CALLS["loop"]
    for case in LAYOUT_CASES:
        check_attention_kernel(B, case, with_bias=True)
    for case in ("mixed", "empty_slots"):
        check_model_kernel(B, case)
    assert CALLS["loop"] > before  # the comparison ran this kernel, not a default


def test_the_suite_catches_a_wrong_kernel():
    """The comparison is not vacuous: a kernel off by one normaliser step fails it."""
    def wrong(B, q, k, v, layout, norm_len, bias):
        return B.hstu_attention_padded(q, k, v, layout, norm_len + 1, bias)

    register_kernel("wrong", wrong, backends=("torch",))
    try:
        with pytest.raises(AssertionError, match="wrong forward"):
            check_attention_kernel(get_backend("torch", ops={"attention": "wrong"}), "mixed", with_bias=True)
    finally:
        unregister_kernel("wrong")


TINY = ["data.synthetic_users=60", "data.synthetic_items=100", "data.synthetic_max_events=20", "model.max_len=16",
        "model.embed_dim=16", "model.dqk=8", "model.dv=8", "loss.num_negatives=8", "train.epochs=1",
        "train.batch_size=32", "eval.batch_size=64"]


def _sets(items):
    return [arg for item in items for arg in ("--set", item)]


def test_grf_train_runs_with_a_registered_kernel(loop_kernel, tmp_path):
    before = CALLS["loop"]
    out = tmp_path / "run"
    args = ["train", "--config", "quickstart", "--quiet", "--out", str(out), "--set", "ops.attention=loop"]
    assert main(args + _sets(TINY)) == 0
    assert CALLS["loop"] > before
    assert 'attention = "loop"' in (out / "config.toml").read_text()
    assert 0.0 <= json.loads((out / "eval.json").read_text())["hr@10"] <= 1.0


PLUGIN = '''
from backends.kernels import register_kernel


@register_kernel("plugin_padded", backends=("torch", "jax"))
def plugin_padded(B, q, k, v, layout, norm_len, bias):
    """The padded reference under another name, registered by a plugin file."""
    return B.hstu_attention_padded(q, k, v, layout, norm_len, bias)
'''


def test_grf_train_imports_a_kernel_plugin(tmp_path):
    """``--plugin FILE`` registers the kernel before the config (and its ops.attention) is checked."""
    plugin = tmp_path / "my_kernel.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "run"
    try:
        assert main(["train", "--config", "quickstart", "--quiet", "--out", str(out), "--plugin", str(plugin),
                     "--set", "ops.attention=plugin_padded"] + _sets(TINY)) == 0
        assert kernels.get_kernel("plugin_padded").runs_on("jax")
    finally:
        unregister_kernel("plugin_padded")
    assert 'attention = "plugin_padded"' in (out / "config.toml").read_text()


def test_default_resolves_per_backend():
    assert kernels.default_kernel("torch") == "best"  # cpu_fused on CPU where it builds, else jagged
    assert kernels.default_kernel("jax") == "best"  # the same C++ tiles, as an XLA FFI custom call
    assert kernels.default_kernel("npu") == "auto"
    assert get_backend("torch").hstu_kernel == "best"
    assert get_backend("torch", ops={"attention": "default"}).hstu_kernel == "best"
    assert get_backend("jax", ops={"attention": "default"}).hstu_kernel == "best"


@pytest.mark.parametrize("overrides, refused", [
    (["ops.attention=triton", "backend.dtype=float64"], "kernel 'triton' does not support backend.dtype='float64'"),
    (["ops.attention=triton", "backend.precision=fp16"], "kernel 'triton' does not support backend.precision='fp16'"),
    (["backend.name=npu", "ops.attention=mxrec"], "kernel 'mxrec' does not support the model's shapes: model.dqk=50"),
])
def test_shipped_kernels_refuse_unsupported_options_by_name(overrides, refused):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    msg = str(info.value)
    kernel_set = next(o for o in overrides if o.startswith("ops.attention="))
    assert msg.startswith(f"--set {kernel_set}: ops.attention=") and refused in msg
    assert "that support it: 'jagged', 'tiled', 'reference'" in msg  # the alternatives


def test_refused_when_the_backend_is_built_too():
    """Code that builds a backend without a config gets the same refusal."""
    with pytest.raises(ConfigError, match="kernel 'triton' does not support backend.dtype='float64'"):
        get_backend("torch", dtype="float64", ops={"attention": "triton"})


def test_a_registered_kernel_refuses_what_it_does_not_declare(tmp_path, capsys):
    def no_time(B, q, k, v, layout, norm_len, bias):
        return B.hstu_attention_padded(q, k, v, layout, norm_len, B.AttentionBias(pos_w=bias.pos_w))

    register_kernel("no_time", no_time, backends=("torch",), time_bias=False, precisions=("fp32",),
                    tile_plan="required")
    try:
        with pytest.raises(ConfigError, match=r"kernel 'no_time' does not support model.time_bias=true: it has no "
                                              r"relative time bias; kernels for torch that support it: 'jagged'"):
            load_config(None, ["ops.attention=no_time"])
        with pytest.raises(ConfigError, match="kernel 'no_time' does not support model.attention_tile=0"):
            load_config(None, ["ops.attention=no_time", "model.time_bias=false", "model.attention_tile=0"])
        cfg = load_config(None, ["ops.attention=no_time", "model.time_bias=false"])
        assert cfg.ops.attention == "no_time"
        # precision is checked where a backend is given one, too
        with pytest.raises(ConfigError, match="kernel 'no_time' does not support backend.precision='bf16'"):
            get_backend("torch", ops={"attention": "no_time"}).with_precision("bf16")
        # and grf reports it as a user error (exit 2) naming the kernel and the option
        assert main(["train", "--config", "quickstart", "--quiet", "--out", str(tmp_path / "x"),
                     "--set", "ops.attention=no_time"] + _sets(TINY)) == 2
        assert "kernel 'no_time' does not support model.time_bias=true" in capsys.readouterr().err
    finally:
        unregister_kernel("no_time")


def test_registry_rules():
    with pytest.raises(ValueError, match="already registered"):
        register_kernel("jagged", lambda B, *a: None)
    with pytest.raises(ValueError, match="'default' is not an implementation name"):
        register_kernel("default", lambda B, *a: None)
    with pytest.raises(ValueError, match="unknown dtype"):
        register_kernel("x", lambda B, *a: None, dtypes=("int8",))
    # the same function again (a module imported twice) is allowed
    register_kernel("jagged", kernels.get_kernel("jagged").source, tile_plan="used")
    with pytest.raises(ConfigError, match=r"the torch backend has no such kernel \(did you mean 'tiled'\?\)"):
        get_backend("torch", ops={"attention": "tiles"})


def test_unknown_kernel_names_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["ops.attention=flash"])
    assert "valid for torch: 'default', 'jagged', 'tiled', 'reference', 'cpu_fused', 'best', 'triton'" in str(info.value)
