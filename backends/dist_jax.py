"""Data-parallel JAX: one process drives a 1-D mesh "data" of its devices, one rank per device
(docs/guides/distributed.md "JAX devices").

``grf train --backend jax --devices N`` (``dist.devices = N``) trains every global batch as N
ranks: each device takes the share of the batch ``dist.balance`` gives its rank (the torch
ranks' shares, ``TrainLoader.rank_batches``), padded to one capacity so the shares stack into
``[N, ...]`` arrays; one ``shard_map``-ed program computes each rank's loss scaled by its tokens
over the global count (``step.rank_scales``), ``psum``-s the gradients over "data" (the torch
ranks' SUM all-reduce) and applies the same guarded update on every device. N devices therefore
compute the one-device update up to the order of the sums, as N torch ranks do.

On CPU the devices are XLA host devices: ``join`` asks for N of them
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) when JAX has not started yet; they
share the host's cores, so on CPU this measures the overhead of the mesh, not a speed-up.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from gr_functional.comm import LocalComm
from gr_functional.errors import ConfigError
from gr_functional.tree import tree_map

FORCE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def _jax_started() -> bool:
    try:  # a private probe; without it, assume started (then the flag is only checked, not set)
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def force_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU host devices (``XLA_FLAGS``) unless the user set the flag or JAX has
    started (it reads the flag once, when its CPU client starts). Harmless on GPU/TPU hosts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and FORCE_DEVICES_FLAG not in flags and not _jax_started():
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_DEVICES_FLAG}={n}".strip()


def mesh_devices(n: int, platform: str | None = None) -> list:
    """The first ``n`` devices of ``platform`` (default JAX's default), or a ``ConfigError`` that
    says how many there are and how to get more."""
    import jax

    devices = jax.devices(platform) if platform else jax.devices()
    if n > len(devices):
        kind = devices[0].platform
        how = (f"on CPU grf asks XLA for N host devices when JAX has not started yet; this process started JAX "
               f"first or XLA_FLAGS already sets {FORCE_DEVICES_FLAG}: set XLA_FLAGS={FORCE_DEVICES_FLAG}={n} "
               f"before Python starts" if kind == "cpu" else "use a host with more devices or lower dist.devices")
        raise ConfigError(f"dist.devices={n} (--devices): JAX sees {len(devices)} {kind} device(s); {how}")
    return devices[:n]


# ----------------------------------------------------------------------------- the step
def stack_rank_batches(rank_batches: list) -> Any:
    """``[R]`` numpy HSTUBatches of equal capacities (``TrainLoader.rank_batches(...,
    capacity="common")``) -> one HSTUBatch whose every leaf has a leading rank axis ``[R, ...]``."""
    def caps_of(b):
        tiles = b.tokens.tiles
        return (b.tokens.t_cap, b.tokens.b_cap) + ((None, None) if tiles is None else
                                                   (int(np.shape(tiles.pair_q)[0]), tiles.nc_cap))

    caps = {caps_of(b) for b in rank_batches}
    if len(caps) != 1:
        raise ValueError(f"rank batches must share one capacity to stack, got (t_cap, b_cap, p_cap, nc_cap) "
                         f"{sorted(caps, key=str)}; build them with TrainLoader.rank_batches(capacity='common')")
    return tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), rank_batches[0], *rank_batches[1:])


def make_sharded_train_step(B, cfg, devices=None):
    """The data-parallel step of one process, one rank per jax device.

    Returns ``step(params, opt_state, micro, scales, global_tokens) -> (params, opt_state, metrics)``:
    micro: list of stacked micro-batches (``stack_rank_batches``; leaves ``[R, ...]``, sharded
    along a 1-D mesh axis "data" of ``devices``, default all); scales ``[R, k]`` float32: rank r's
    weight ``n_ri / G`` of micro-batch i (``gr_functional.step.rank_scales``); global_tokens:
    G. Under ``shard_map`` each device computes ``step.rank_grads`` on its own sequences, the
    gradients and loss parts are ``psum``-med over "data" (the torch collective's SUM
    all-reduce), and every device applies the same guarded update to replicated params: the
    math of ``step.make_dist_train_step``. With a hash table's ``lookup`` (the same on every
    rank: each maps the global step's ids), the rows' gradients are summed the same way.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gr_functional.step import apply_update, local_params, rank_grads

    devices = list(devices or jax.devices())
    mesh = Mesh(np.array(devices), ("data",))

    def per_rank(params, opt_state, micro, scales, global_tokens):
        local = [jax.tree_util.tree_map(lambda x: x[0], mb) for mb in micro]   # drop the rank axis
        lookup = local[0].lookup
        view = params if lookup is None else local_params(B, params, lookup)
        loss_part, grads = rank_grads(B, view, opt_state, local, [scales[0, i] for i in range(len(local))], cfg)
        grads = jax.lax.psum(grads, "data")
        loss = jax.lax.psum(loss_part, "data")
        return apply_update(B, params, opt_state, loss, global_tokens, grads, cfg, lookup=lookup, view=view)

    # check_vma=False: per-device gradients of the replicated params stay per-device (with the
    # check on, JAX would insert the psum itself when transposing the implicit broadcast of
    # params, and the explicit psum above would double them); the psum is then ours, as the
    # torch collective's all-reduce, and the outputs are replicated because it ran.
    sharded = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P()),
                                    out_specs=P(), check_vma=False))
    data_sharding = NamedSharding(mesh, P("data"))

    def step(params, opt_state, micro, scales, global_tokens):
        micro = B.device_put(micro, data_sharding)   # rank r's slice straight to device r
        scales = B.device_put(np.asarray(scales, dtype=np.float32), data_sharding)
        return sharded(params, opt_state, micro, scales, np.float32(global_tokens))

    step.mesh = mesh
    return step


def make_sharded_scorer(B, cfg, devices):
    """``scorer(params, batch) -> scores[n, N+1]`` (``step.score`` of the batch's n histories, in
    their order) with the histories split over the devices of a 1-D mesh "data" in contiguous
    near-equal parts (``batching.split_for_ranks``), each device scoring its part: evaluation
    sharded as training is, the same scores as one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gr_functional.data.batching import split_for_ranks
    from gr_functional.step import score

    mesh = Mesh(np.array(devices), ("data",))

    def per_rank(params, batch):
        return score(B, params, jax.tree_util.tree_map(lambda x: x[0], batch), cfg)[None]

    sharded = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
                                    check_vma=False))
    data_sharding = NamedSharding(mesh, P("data"))

    def scorer(params, batch):
        batch = B.to_numpy_tree(batch)
        n = int(np.count_nonzero(np.asarray(batch.tokens.lengths)))  # every history has >= 1 event
        parts = split_for_ranks(batch, n, len(devices))
        scores = sharded(params, B.device_put(stack_rank_batches(parts), data_sharding))   # [R, b, N+1]
        return jnp.concatenate([scores[r, :int(np.count_nonzero(np.asarray(p.tokens.lengths)))]
                                for r, p in enumerate(parts)])

    return scorer


class MeshComm(LocalComm):
    """The collective of a JAX run over a mesh of one process's devices: ``world_size`` ranks,
    all computed here (``ranks_here``); rank 0 of the host side, which writes OUT. Host-side
    exchanges are the identity (one process); the gradient all-reduce is inside the step."""

    backend = "jax-mesh"
    concurrent_groups = False

    def __init__(self, devices: list):
        super().__init__()
        self.devices = list(devices)
        self.world_size = self.ranks_here = len(self.devices)

    def all_reduce_sum(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def gather(self, obj: Any) -> list:
        return [obj]

    def scorer(self, B, cfg):
        """The evaluation scorer: ``make_sharded_scorer`` over the mesh."""
        return make_sharded_scorer(B, cfg, self.devices)

    def train_step(self, B, cfg):
        """``step(params, opt_state, micro, scales, global_tokens)``: micro is a list of
        micro-batches, each the ``world_size`` ranks' numpy batches of one capacity."""
        sharded = make_sharded_train_step(B, cfg, self.devices)

        def step(params, opt_state, micro, scales, global_tokens):
            return sharded(params, opt_state, [stack_rank_batches(parts) for parts in micro], scales, global_tokens)

        step.mesh = sharded.mesh
        return step


def join(cfg) -> MeshComm:
    """The mesh of ``cfg.dist.devices`` devices of ``backend.device``'s platform (default JAX's)."""
    force_host_devices(cfg.dist.devices)
    return MeshComm(mesh_devices(cfg.dist.devices, cfg.backend.device or None))


# ----------------------------------------------------------------------------- row-sharded tables
def make_sharded_table_ops(B, optimizer: str, opt_cfg, devices=None):
    """The JAX reference of a row-sharded table's exchange (gr_functional/embedding/sharding.py):
    one process, one shard per device of a 1-D mesh "data" (forced host devices on CPU).

    Requests have a fixed capacity C per (rank, owner) pair: ``req[R, R, C]`` int32, ``req[r, o]``
    the rows of shard o that rank r asks for (0 = none: the zero padding row). Returns
    ``lookup(values[R, N, D], req) -> rows[R, R, C, D]`` (``rows[r, o]`` answers ``req[r, o]``:
    the requests travel to their owners and the rows back by ``jax.lax.all_to_all``) and
    ``push(values, state, req, grads[R, R, C, D], lr) -> (values, state)`` (gradients to the
    owners, summed per row with ``segment_sum``, the row-sparse optimizer on the requested rows):
    the same math as the torch exchange's ``all_to_all_single`` hops."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from gr_functional.embedding import rowopt

    mesh = Mesh(np.array(list(devices or jax.devices())), ("data",))

    def lookup_local(values, req):
        asked = jax.lax.all_to_all(req[0], "data", 0, 0)             # [R, C]: what each rank asks of me
        answer = jnp.take(values[0], asked, axis=0)                 # [R, C, D]
        return jax.lax.all_to_all(answer, "data", 0, 0)[None]       # [1, R, C, D]: from each owner

    def push_local(values, state, req, grads, lr):
        asked = jax.lax.all_to_all(req[0], "data", 0, 0).reshape(-1)
        g = jax.lax.all_to_all(grads[0], "data", 0, 0)
        n, d = values.shape[1], values.shape[2]
        summed = jax.ops.segment_sum(g.reshape(-1, d), asked, num_segments=n)
        touched = jnp.zeros(n, bool).at[asked].set(True).at[0].set(False)
        new, new_state = rowopt.row_update(B, optimizer, values[0], summed, {k: v[0] for k, v in state.items()},
                                           touched, lr, opt_cfg)
        return new[None], {k: v[None] for k, v in new_state.items()}

    lookup = jax.jit(jax.shard_map(lookup_local, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
    push = jax.jit(jax.shard_map(push_local, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P("data"), P()),
                                 out_specs=(P("data"), P("data"))))
    return lookup, push
