"""fbgemm's table-batched embedding (TBE) as the row-wise Adagrad update of a step's rows.

The sparse step (gr_functional/embedding/) gathers the U distinct rows a step names into
``values[U, D]``, the model's backward gives their gradient ``grads[U, D]`` already summed per row,
and the row-sparse optimizer updates the U rows and their accumulators (``rowopt.row_update``).
This adapter runs that update through fbgemm's fused TBE backward, the op the vendors ship for it:

- Ascend NPU: fbgemm-ascend (``import fbgemm_ascend``: it imports fbgemm_gpu for the schemas and
  Python modules, then loads its NPU kernels under the same ``torch.ops.fbgemm`` names);
- CUDA: fbgemm_gpu; CPU: fbgemm-gpu-cpu (pinned to the torch minor: 1.8.0 for torch 2.13).

Users of all three drive TBE through fbgemm_gpu's public module
``SplitTableBatchedEmbeddingBagsCodegen`` (fbgemm-ascend's own tests do, with pooling NONE and
EXACT_ROWWISE_ADAGRAD), so that is the surface used here, never the raw ``*_pt2`` op, whose
argument packing changes between fbgemm releases. How the call maps our update:

    a TBE of S >= U rows (cached; S a power of two) holds values in rows 0..U-1 and the
    accumulators in its momentum1; indices 0..U-1, offsets 0..U, pooling NONE (one row per index:
    the output IS the rows); backward with where(touched, grads, 0) applies
    EXACT_ROWWISE_ADAGRAD to rows 0..U-1 in place; the new rows and accumulators are read back.

EXACT_ROWWISE_ADAGRAD (fbgemm ``codegen/genscript/optimizers.py``; L2 weight-decay mode), per row
with g its summed gradient: ``g' = g + wd w; acc += mean_D(g'^2); w -= lr g' / (sqrt(acc) + eps)``,
which is ``rowopt``'s rowwise_adagrad. Untouched slots are restored afterwards (with wd > 0 a zero
gradient still moves a row in fbgemm), so the result equals the reference slot for slot.

Documented limits the adapter refuses by name before calling (``problem``): fp32 rows only
(fbgemm-ascend: fp32 weights/gradients/output), D a multiple of 8 on the NPU and of 4 elsewhere
(fbgemm-ascend's check and CUDA TBE's vector width), and on the NPU ``weight_decay == 0``:
fbgemm-ascend's row-wise Adagrad kernel accepts weight_decay / weight_decay_mode and never
passes them to the kernel (``v220/op_kernel/optimizers/rowwise_adagrad_optimizer.h``), so a
decayed run would silently train without decay. An empty step (U = 0) never reaches the op
(fbgemm-ascend: "indices can not be empty tensor"). The learning rate is a Python float
(``set_learning_rate``): one host sync per step, as fbgemm-ascend's ``.item()`` does anyway.

Sources for every claim above, with commits: docs/design/ascend_sparse_ops.md.

Verified on CPU (tests/npu_ops/test_fbgemm_tbe.py): against the reference formulas through a FAKE
written from the documented semantics (npu_ops/fakes/fake_fbgemm_tbe.py) and through fbgemm's own
CPU implementation (fbgemm-gpu-cpu), and the fake against that implementation. Not verified:
anything on an NPU or a GPU (device placement, fbgemm-ascend's numerics), nor speed.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from ._errors import UnsupportedOnBackend


@dataclasses.dataclass(frozen=True)
class FbgemmApi:
    """The pieces of fbgemm_gpu's TBE API the adapter uses (a fake supplies the same)."""

    tbe_class: Any             # SplitTableBatchedEmbeddingBagsCodegen
    location: Any              # EmbeddingLocation (HOST, DEVICE)
    compute_device: Any        # ComputeDevice (CPU, CUDA)
    optim_type: Any            # EmbOptimType / OptimType (EXACT_ROWWISE_ADAGRAD)
    pooling_mode: Any          # PoolingMode (NONE)
    weight_decay_mode: Any     # WeightDecayMode (NONE, L2)
    origin: str                # where it came from, for messages


def load_api(device_kind: str) -> FbgemmApi:
    """fbgemm_gpu's TBE API, after ``import fbgemm_ascend`` when ``device_kind == "npu"`` (which
    loads the NPU kernels). Raises UnsupportedOnBackend with the import error and the fix."""
    vendor = "fbgemm_ascend" if device_kind == "npu" else "fbgemm_gpu"
    hint = ("pip install fbgemm-ascend matching your torch_npu and CANN (README of npu_ops)" if device_kind == "npu"
            else "pip install fbgemm-gpu-cpu==1.8.0 (CPU) or the fbgemm-gpu build matching your torch and CUDA")
    try:
        importlib.import_module(vendor)
        training = importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_training")
        common = importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_common")
    except Exception as exc:  # noqa: BLE001 - ABI mismatches raise OSError/RuntimeError, not only ImportError
        raise UnsupportedOnBackend(f"row kernel 'fbgemm' needs {vendor}: import failed ({type(exc).__name__}: "
                                   f"{exc}); {hint}") from exc
    decay = getattr(training, "WeightDecayMode", None)
    if decay is None:  # moved between releases
        decay = importlib.import_module("fbgemm_gpu.split_embedding_configs").WeightDecayMode
    return FbgemmApi(training.SplitTableBatchedEmbeddingBagsCodegen, common.EmbeddingLocation,
                     training.ComputeDevice, training.OptimType, common.PoolingMode, decay, origin=vendor)


def problem(device_kind: str, dtype: str, dim: int, weight_decay: float) -> str | None:
    """Why fbgemm's TBE cannot run this update (a documented limit, named), or None."""
    if dtype != "float32":
        return f"fbgemm TBE rows must be float32 (fbgemm-ascend: fp32 only), got {dtype}"
    multiple = 8 if device_kind == "npu" else 4
    if dim % multiple:
        return (f"the embedding width {dim} is not a multiple of {multiple} "
                f"({'fbgemm-ascend' if device_kind == 'npu' else 'fbgemm TBE'} requires it)")
    if device_kind == "npu" and weight_decay:
        return ("weight_decay must be 0: fbgemm-ascend's row-wise Adagrad kernel ignores weight_decay "
                "(accepted, never passed to the kernel), so the run would train without it")
    return None


class FbgemmRowwiseAdagrad:
    """``update(values, grads, acc, touched, lr, eps, weight_decay) -> (new_values, new_acc)``
    through fbgemm's TBE (module docstring). ``api``: ``load_api(...)`` or a fake's."""

    def __init__(self, api: FbgemmApi):
        self.api = api
        self._tables: dict[tuple, Any] = {}

    def _table(self, device, slots: int, dim: int, eps: float, weight_decay: float):
        key = (str(device), slots, dim, eps, weight_decay)
        tbe = self._tables.get(key)
        if tbe is None:
            api = self.api
            on_cpu = device.type == "cpu"
            # fbgemm takes its device path for any non-CPU ComputeDevice (fbgemm-ascend's tests pass
            # torchrec_npu's NPU value; CUDA's behaves the same there)
            spec = (slots, dim, api.location.HOST if on_cpu else api.location.DEVICE,
                    api.compute_device.CPU if on_cpu else api.compute_device.CUDA)
            decay = api.weight_decay_mode.L2 if weight_decay else api.weight_decay_mode.NONE
            tbe = api.tbe_class([spec], optimizer=api.optim_type.EXACT_ROWWISE_ADAGRAD,
                                pooling_mode=api.pooling_mode.NONE, learning_rate=0.0, eps=eps,
                                weight_decay=weight_decay, weight_decay_mode=decay, stochastic_rounding=False,
                                device=device)
            # one table per (device, width, eps, decay): a bigger one replaces a smaller one
            self._tables = {k: v for k, v in self._tables.items() if k[0] != key[0] or k[2:] != key[2:]}
            self._tables[key] = tbe
        return tbe

    def update(self, values, grads, acc, touched, lr, eps: float, weight_decay: float):
        """values[U, D] fp32, grads[U, D], acc[U], touched[U] bool, lr (float or 0-d tensor) ->
        (new_values[U, D], new_acc[U]); untouched slots bit-identical."""
        import torch

        u, dim = values.shape
        reason = problem(values.device.type, str(values.dtype).replace("torch.", ""), dim, weight_decay)
        if reason:
            raise UnsupportedOnBackend(f"row kernel 'fbgemm': {reason}")
        if u == 0:
            return values, acc
        slots = max(64, 1 << (u - 1).bit_length())
        tbe = self._table(values.device, slots, dim, float(eps), float(weight_decay))
        weights = tbe.split_embedding_weights()[0]
        momentum = tbe.split_optimizer_states()[0][0]
        with torch.no_grad():
            weights[:u].copy_(values)
            momentum[:u].copy_(acc)
        tbe.set_learning_rate(float(lr))
        keep = touched.reshape(-1, 1)
        index = torch.arange(u, dtype=torch.int64, device=values.device)
        with torch.enable_grad():
            out = tbe(index, torch.arange(u + 1, dtype=torch.int64, device=values.device))
            out.backward(torch.where(keep, grads, torch.zeros_like(grads)))
        with torch.no_grad():
            new_values = torch.where(keep, weights[:u], values)
            new_acc = torch.where(touched, momentum[:u], acc)
        return new_values, new_acc
