"""The full HSTU loss and every gradient with the Triton attention kernel (CPU interpreter) on the
torch backend, against the JAX reference backend: the kernel is exercised inside the model."""
from __future__ import annotations

from backends import get_backend
from gr_functional import model
from gr_functional.tree import tree_items

from .common import FWD_TOL, GRAD_TOL, rel_err
from .test_model import CFG, make_train_batch


def test_model_with_triton_attention_matches_jax():
    batch = make_train_batch("mixed")
    params = model.init_params(CFG, seed=3)

    def run(B):
        loss, g = B.value_and_grad(lambda p, b: model.loss_fn(B, p, b, CFG))(
            B.asarray_tree(params), B.asarray_tree(batch))
        return float(loss), {k: B.to_numpy(v) for k, v in tree_items(g)}

    ref = run(get_backend("jax"))
    got = run(get_backend("torch", hstu_kernel="triton"))
    assert rel_err(got[0], ref[0]) <= FWD_TOL
    for key, g in ref[1].items():
        assert rel_err(got[1][key], g) <= GRAD_TOL, key
