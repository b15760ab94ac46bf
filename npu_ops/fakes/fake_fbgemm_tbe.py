"""A FAKE of fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` (TBE), written from its documented
semantics: only what npu_ops/fbgemm_tbe.py uses. Tests only.

Semantics modelled (fbgemm_gpu ``codegen/genscript/optimizers.py`` ``rowwise_adagrad``, the
training module's docstrings, fbgemm-ascend's README and C++ checks):

- one table of ``rows x D`` fp32 weights and one fp32 accumulator per row (``momentum1``),
  readable and writable through ``split_embedding_weights()[0]`` and
  ``split_optimizer_states()[0][0]`` (views of the storage, as fbgemm's are);
- ``forward(indices, offsets)`` with pooling NONE returns ``weights[indices]`` (``[len(indices), D]``);
  empty ``indices`` raise (fbgemm-ascend: "indices can not be empty tensor");
- backward sums the output gradient per distinct index (all fbgemm implementations aggregate
  duplicates before the update), then per distinct row, EXACT_ROWWISE_ADAGRAD::

      g' = g + wd * w  (L2 mode; g' = g when weight_decay_mode is NONE)
      acc += sum(g'^2) / D;  w -= lr / (sqrt(acc) + eps) * g'

  in place; rows not indexed are untouched. No gradient flows to anything else.

Refused (NotImplementedError) rather than guessed: other optimizers and pooling modes, several
tables, weight-decay modes other than NONE and L2, stochastic rounding. What it proves: that the
adapter's use of the public API (row placement, indices/offsets, masked gradients, read-back)
reproduces our reference update under the documented semantics; tests/npu_ops also checks it
against fbgemm's own CPU implementation. It proves nothing about fbgemm-ascend's NPU kernels.
"""
from __future__ import annotations

import enum

import torch

from npu_ops.fbgemm_tbe import FbgemmApi


class EmbeddingLocation(enum.IntEnum):
    DEVICE = 0
    MANAGED = 1
    MANAGED_CACHING = 2
    HOST = 3


class ComputeDevice(enum.IntEnum):
    CPU = 0
    CUDA = 1


class OptimType(enum.Enum):
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"


class PoolingMode(enum.IntEnum):
    SUM = 0
    MEAN = 1
    NONE = 2


class WeightDecayMode(enum.IntEnum):
    NONE = 0
    L2 = 1
    DECOUPLE = 2


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, tbe, indices):
        ctx.tbe, ctx.indices = tbe, indices
        return tbe.weights[indices].clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.tbe._apply(ctx.indices, grad)
        return None, None, None


class FakeTBE:
    """fbgemm's TBE module as documented, for one table, EXACT_ROWWISE_ADAGRAD, pooling NONE."""

    def __init__(self, embedding_specs, *, optimizer, pooling_mode, learning_rate=0.01, eps=1e-8,
                 weight_decay=0.0, weight_decay_mode=WeightDecayMode.NONE, stochastic_rounding=True,
                 device=None):
        if len(embedding_specs) != 1:
            raise NotImplementedError("fake TBE: one table only")
        if optimizer is not OptimType.EXACT_ROWWISE_ADAGRAD or pooling_mode is not PoolingMode.NONE:
            raise NotImplementedError("fake TBE: EXACT_ROWWISE_ADAGRAD with pooling NONE only")
        if weight_decay_mode not in (WeightDecayMode.NONE, WeightDecayMode.L2) or stochastic_rounding:
            raise NotImplementedError("fake TBE: weight_decay_mode NONE or L2, no stochastic rounding")
        rows, dim, location, compute = embedding_specs[0]
        device = torch.device(device or "cpu")
        if (compute is ComputeDevice.CPU) != (device.type == "cpu") or \
                (location is EmbeddingLocation.HOST) != (compute is ComputeDevice.CPU):
            raise ValueError(f"fake TBE: spec {location!r}/{compute!r} does not match device {device}")
        self.weights = torch.empty(rows, dim, dtype=torch.float32, device=device).uniform_(-0.01, 0.01)
        self.momentum1 = torch.zeros(rows, dtype=torch.float32, device=device)
        self.lr, self.eps = float(learning_rate), float(eps)
        self.weight_decay = float(weight_decay) if weight_decay_mode is WeightDecayMode.L2 else 0.0
        self._placeholder = torch.zeros(0, requires_grad=True, device=device)

    def split_embedding_weights(self):
        return [self.weights]

    def split_optimizer_states(self):
        return [[self.momentum1]]

    def set_learning_rate(self, lr: float) -> None:
        self.lr = float(lr)

    def __call__(self, indices, offsets):
        if indices.numel() == 0:
            raise RuntimeError("indices can not be empty tensor")
        if offsets.numel() < 1 or int(offsets[-1]) != indices.numel():
            raise ValueError("fake TBE: offsets must end at len(indices)")
        if int(indices.min()) < 0 or int(indices.max()) >= self.weights.shape[0]:
            raise IndexError("fake TBE: index out of the table")
        return _Lookup.apply(self._placeholder, self, indices)

    @torch.no_grad()
    def _apply(self, indices, grad):
        rows, inverse = torch.unique(indices, return_inverse=True)
        g = torch.zeros(rows.shape[0], grad.shape[1], dtype=grad.dtype, device=grad.device).index_add_(0, inverse, grad)
        w = self.weights[rows]
        g = g + self.weight_decay * w
        acc = self.momentum1[rows] + (g * g).sum(dim=1) / g.shape[1]
        self.momentum1[rows] = acc
        self.weights[rows] = w - (self.lr / (acc.sqrt() + self.eps)).unsqueeze(1) * g


def fake_api() -> FbgemmApi:
    """The fake behind the adapter's ``FbgemmApi``."""
    return FbgemmApi(FakeTBE, EmbeddingLocation, ComputeDevice, OptimType, PoolingMode, WeightDecayMode,
                     origin="fake_fbgemm_tbe")


__all__ = ["FakeTBE", "fake_api"]
