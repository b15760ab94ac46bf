"""``backend.compile``: the torch.compile'd training loss against the eager one (the oracle).

Provenance: torch on CPU (inductor's C++ kernels). Two batches of different lengths, so the second
call recompiles with dynamic shapes; loss and every gradient within float32 rounding, and the
compiled function is built once per backend."""
from __future__ import annotations

import numpy as np
import pytest

import gr_functional as grf
from gr_functional.errors import ConfigError
from gr_functional.step import init_opt_state, micro_grads
from gr_functional.tree import tree_items


@pytest.mark.slow
def test_compiled_loss_and_grads_equal_eager():
    runs = {}
    for comp in ("false", "true"):
        exp = grf.prepare("quickstart", [f"backend.compile={comp}", "train.batch_size=16", "model.num_blocks=1"])
        B = exp.backend()
        params = B.asarray_tree(exp.init_params())
        opt_state = init_opt_state(B, params, exp.cfg)
        out = []
        for i, batch in enumerate(exp.batches(0)):
            if i == 2:
                break
            loss, _, grads = micro_grads(B, params, opt_state, B.asarray_tree(batch), exp.cfg)
            out.append((float(loss), B.to_numpy_tree(grads)))
        runs[comp] = out
        assert B.compile == (comp == "true")
    assert len(B.__dict__.get("_compiled", {})) == 1
    for (l_e, g_e), (l_c, g_c) in zip(runs["false"], runs["true"]):
        assert abs(l_c - l_e) <= 1e-5 * abs(l_e)
        compiled = dict(tree_items(g_c))
        for path, e in tree_items(g_e):
            np.testing.assert_allclose(compiled[path], e, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(e).max())),
                                       err_msg=str(path))


@pytest.mark.parametrize("backend, match", [("jax", "JAX always jit-compiles"), ("npu", "not verified")])
def test_compile_is_refused_off_torch(backend, match):
    with pytest.raises(ConfigError, match=match):
        grf.prepare("quickstart", ["backend.compile=true", f"backend.name={backend}"])
