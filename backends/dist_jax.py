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
import sys
from typing import Any

import numpy as np

from gr_functional.comm import LocalComm
from gr_functional.data.batching import split_for_ranks
from gr_functional.embedding import rowopt
from gr_functional.embedding.hashtable import hashed_init
from gr_functional.embedding.sharding import make_sharded, owners
from gr_functional.errors import ConfigError, DistributedError
from gr_functional.jagged import round_up_capacity
from gr_functional.optimizers import all_finite
from gr_functional.optimizers.schedules import learning_rate
from gr_functional.step import TABLE, apply_update, local_params, rank_grads, score
from gr_functional.tree import tree_map

from .dist_torch import limits

FORCE_DEVICES_FLAG = "--xla_force_host_platform_device_count"
COORDINATOR_ENV = "GRF_JAX_COORDINATOR"


def jax_started() -> bool:
    """Has JAX started its backends (after which XLA_FLAGS and jax.distributed are fixed)?"""
    try:  # a private probe; without it, assume started (then a flag is only checked, not set)
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def force_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU host devices (``XLA_FLAGS``) unless the user set the flag or JAX has
    started (it reads the flag once, when its CPU client starts). Harmless on GPU/TPU hosts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and FORCE_DEVICES_FLAG not in flags and not jax_started():
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
        """micro / scales: this process's ranks' rows (all of them in one process)."""
        micro = B.device_put(micro, data_sharding)   # rank r's slice straight to device r
        scales = B.device_put(np.asarray(scales, dtype=np.float32), data_sharding)
        params, opt_state, metrics = sharded(params, opt_state, micro, scales, np.float32(global_tokens))
        return params, opt_state, local_copy(metrics)  # the host reads them: this process's copy

    return step


def make_sharded_scorer(B, cfg, devices, params_of=None):
    """``scorer(params, batch) -> scores[n, N+1]`` (``step.score`` of the batch's n histories, in
    their order) with the histories split over the devices of a 1-D mesh "data" in contiguous
    near-equal parts (``batching.split_for_ranks``), each device scoring its part: evaluation
    sharded as training is, the same scores as one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(devices), ("data",))

    def per_rank(params, batch):
        return score(B, params, jax.tree_util.tree_map(lambda x: x[0], batch), cfg)[None]

    sharded = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
                                    check_vma=False))
    data_sharding = NamedSharding(mesh, P("data"))

    replicated, placed = NamedSharding(mesh, P()), {}

    def scorer(params, batch):
        if params_of is not None:  # params of a bigger mesh: this process's copy, on these devices
            if placed.get("of") is not params:
                placed.update(of=params, on=jax.device_put(params_of(params), replicated))
            params = placed["on"]
        batch = B.to_numpy_tree(batch)
        n = int(np.count_nonzero(np.asarray(batch.tokens.lengths)))  # every history has >= 1 event
        parts = split_for_ranks(batch, n, len(devices))
        scores = sharded(params, B.device_put(stack_rank_batches(parts), data_sharding))   # [R, b, N+1]
        return jnp.concatenate([scores[r, :int(np.count_nonzero(np.asarray(p.tokens.lengths)))]
                                for r, p in enumerate(parts)])

    return scorer


def local_copy(tree):
    """``tree`` with every array replicated over processes (not addressable here as a whole)
    replaced by this process's copy of it; others unchanged."""
    import jax

    return jax.tree_util.tree_map(
        lambda x: x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable else x, tree)


class MeshComm(LocalComm):
    """The collective of a JAX run whose ranks are the devices of a mesh: ``devices`` (process-major),
    ``local_ranks`` the positions of this process's. One process: host-side exchanges are the
    identity. Several (``jax.distributed``): ``process`` is this one's index (0 writes OUT and
    evaluates), objects and tags go through the coordination service's key-value store, and a
    process's fatal error is published there for the others' waits. The gradient all-reduce is
    inside the step (``make_sharded_train_step``)."""

    backend = "jax-mesh"
    concurrent_groups = False
    mesh = True

    def __init__(self, devices: list, process: int = 0, processes: int = 1, client=None):
        super().__init__()
        self.devices = list(devices)
        self.world_size = len(self.devices)
        per = self.world_size // processes
        self.local_ranks = range(process * per, (process + 1) * per)
        self.local_devices = self.devices[process * per:(process + 1) * per]
        self.rank, self.processes, self.is_main = process, processes, process == 0
        self._client = client

    # ---- host-side exchanges between processes (the coordination service's store)
    def _failed(self) -> str | None:
        try:
            return self._client.key_value_try_get("grf/failed")
        except Exception:  # noqa: BLE001 - NOT_FOUND: nobody failed
            return None

    def _get(self, key: str, what: str) -> bytes:
        """The value of ``key``, waited for in 1 s slices so that a peer's published failure ends
        the wait (a dead peer is the coordination service's heartbeat to find)."""

        while True:
            failed = self._failed()
            if failed:
                raise DistributedError(f"process {self.rank}: stopping: {failed}")
            try:
                return self._client.blocking_key_value_get_bytes(key, 1000)
            except Exception as exc:  # noqa: BLE001 - this slice timed out: check for failures, wait again
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise DistributedError(f"process {self.rank}: the JAX coordination service failed while "
                                           f"waiting for {what}: {exc}") from None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of process ``src`` on every process, pickled through the devices' collectives
        (a checkpoint is too big for the coordination service's store). Collective."""
        if self.processes == 1:
            return obj
        import pickle

        from jax.experimental import multihost_utils

        mine = self.rank == src
        data = np.frombuffer(pickle.dumps(obj), np.uint8) if mine else np.zeros(0, np.uint8)
        n = int(multihost_utils.broadcast_one_to_all(np.int64(len(data)), is_source=mine))
        got = multihost_utils.broadcast_one_to_all(data if mine else np.zeros(n, np.uint8), is_source=mine)
        return obj if mine else pickle.loads(np.asarray(got).tobytes())

    def post(self, tag: str) -> None:
        if self.processes > 1:
            self._client.key_value_set(f"grf/posted/{tag}", "1")

    def wait_for(self, tag: str) -> None:
        if self.processes > 1:
            self._get(f"grf/posted/{tag}", f"process 0 to finish {tag}")

    def fail(self, message: str) -> None:
        if self.processes > 1:
            try:
                if not self._failed():
                    self._client.key_value_set("grf/failed", f"process {self.rank} failed: {message}")
            except Exception:  # noqa: BLE001 - the service may be gone already; the error is raised anyway
                pass

    def shutdown(self) -> None:
        if self.processes > 1:
            import jax

            jax.distributed.shutdown()

    def all_reduce_sum(self, values) -> np.ndarray:
        if self.processes == 1:
            return np.asarray(values, dtype=np.float64)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(np.asarray(values, dtype=np.float64))).sum(axis=0)

    def gather(self, obj: Any) -> list | None:
        if self.processes == 1:
            return [obj]
        raise NotImplementedError("gathering objects over JAX processes (row-sharded tables are refused on the mesh)")

    # ---- the device side
    def scorer(self, B, cfg):
        """The evaluation scorer of process 0: ``make_sharded_scorer`` over its own devices (the
        other processes do not evaluate), the params' local copy placed on them."""
        return make_sharded_scorer(B, cfg, self.local_devices, params_of=local_copy if self.processes > 1 else None)

    def sharded_table(self, B, cfg, dense_rows=None) -> "MeshTable":
        """The item table row-sharded over the mesh (``embedding.sharding = "row"``)."""
        return MeshTable(B, cfg, self, dense_rows)

    def table_step(self, B, cfg):
        """``make_sharded_table_step`` over the mesh, micro-batches as ``train_step``'s."""
        sharded = make_sharded_table_step(B, cfg, self.devices)

        here = np.asarray(self.local_ranks)

        def step(params, opt_state, micro, scales, global_tokens, values, state, plan):
            """micro / scales: this process's ranks'; plan: every rank's (``MeshTable.plan``)."""
            return sharded(params, opt_state, [stack_rank_batches(parts) for parts in micro], scales, global_tokens,
                           values, state, {k: v[here] for k, v in plan.items()})

        return step

    def train_step(self, B, cfg):
        """``step(params, opt_state, micro, scales, global_tokens)``: micro is a list of
        micro-batches, each this process's ranks' numpy batches (one capacity for all ranks)."""
        sharded = make_sharded_train_step(B, cfg, self.devices)

        def step(params, opt_state, micro, scales, global_tokens):
            return sharded(params, opt_state, [stack_rank_batches(parts) for parts in micro], scales, global_tokens)

        return step


def coordinator_address() -> str:
    """Where the processes of a several-process JAX run meet: ``GRF_JAX_COORDINATOR`` (host:port;
    ``grf train --nproc`` sets a free local port), else torchrun's ``MASTER_ADDR:MASTER_PORT``
    when the processes were started by hand, or port + 1 under torchrun (its own store holds the port)."""
    explicit = os.environ.get(COORDINATOR_ENV)
    if explicit:
        return explicit
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"several JAX processes meet at a coordinator: set {COORDINATOR_ENV}=HOST:PORT (process "
                          f"0's host) or MASTER_ADDR and MASTER_PORT, as for torchrun ({', '.join(missing)} missing)")
    port = int(os.environ["MASTER_PORT"]) + (1 if "TORCHELASTIC_RUN_ID" in os.environ else 0)
    return f"{os.environ['MASTER_ADDR']}:{port}"


def initialize(cfg, processes: int, process: int) -> None:
    """``jax.distributed.initialize`` of this process (idempotent), with CPU collectives over gloo.
    The processes must meet within ``10 x dist.timeout_s + max(dist.timeout_s, 5 s)`` (as the
    torch process group); a process silent for ``max(dist.timeout_s, 5 s)`` is declared dead by
    the coordination service, which stops the others."""
    import jax

    if jax.distributed.is_initialized():
        return
    lim = limits(cfg.dist.timeout_s)
    address = coordinator_address()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes exchange through gloo
    # JAX ends the process itself (SIGABRT, its own message) when the processes do not all meet
    # in time: a process other than 0 first waits for the coordinator to listen, so a coordinator
    # that never comes is our error, named; process 0 says what it waits for
    if process == 0:
        print(f"grf: process 0 of {processes}: hosting the JAX coordinator at {address}; waiting up to "
              f"{lim.collective_s:g} s for the others (then JAX ends this process)", file=sys.stderr, flush=True)
    else:
        _wait_for_listener(address, lim.collective_s, f"process {process}: the JAX coordinator {address} (process 0)")
    try:
        jax.distributed.initialize(coordinator_address=address, num_processes=processes, process_id=process,
                                   initialization_timeout=max(1, int(lim.collective_s)),
                                   heartbeat_timeout_seconds=max(1, int(lim.dead_after)))
    except Exception as exc:  # noqa: BLE001 - the service's message says what did not answer
        raise DistributedError(f"process {process}: the {processes} JAX processes did not meet at the coordinator "
                               f"{address} within {lim.collective_s:g} s (10 x dist.timeout_s + "
                               f"{lim.dead_after:g} s): {exc}. Start every process with the same coordinator "
                               f"({COORDINATOR_ENV} or MASTER_ADDR/MASTER_PORT), WORLD_SIZE and its own RANK") from None


def _wait_for_listener(address: str, within_s: float, what: str) -> None:
    """Return once ``address`` (host:port) accepts a TCP connection; ``DistributedError`` after ``within_s``."""
    import socket
    import time

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise DistributedError(f"{what} did not answer within {within_s:g} s (10 x dist.timeout_s + "
                                       f"max(dist.timeout_s, 5 s)): {exc}. Start process 0 (RANK=0) with the same "
                                       f"coordinator ({COORDINATOR_ENV} or MASTER_ADDR/MASTER_PORT)") from None
            time.sleep(0.2)


def check_even(asked: dict, available: dict) -> None:
    """``ConfigError`` unless every process asks for the same number of devices (``asked``:
    process -> ``dist.devices``) and has that many (``available``): the mesh is even."""
    if len(set(asked.values())) > 1:
        each = ", ".join(f"process {p}: {n}" for p, n in sorted(asked.items()))
        raise ConfigError(f"dist.devices differs between the JAX processes ({each}); every process trains the same "
                          f"number of ranks (an even mesh): start each with the same --devices")
    per = next(iter(asked.values()))
    short = {p: n for p, n in available.items() if n < per}
    if short:
        raise ConfigError(f"dist.devices={per}: process(es) {sorted(short)} have only {sorted(set(short.values()))} "
                          f"device(s); start every process with --devices at most the devices of each")


def join(cfg) -> MeshComm:
    """The mesh of ``cfg.dist.devices`` (at least 1) devices of ``backend.device``'s platform
    (default JAX's) of each process: one process, or ``WORLD_SIZE`` processes (``RANK`` this one)
    that ``JaxBackend.prepare_process`` joined by ``jax.distributed`` (``initialize``), having
    asked XLA for the host devices first."""
    import jax

    processes, process = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    per = max(1, cfg.dist.devices)
    mesh_devices(per, cfg.backend.device or None)  # enough devices here, or a ConfigError saying how
    platform = cfg.backend.device or None
    everyone = jax.devices(platform) if platform else jax.devices()
    by_process = {p: sorted((d for d in everyone if d.process_index == p), key=lambda d: d.id)
                  for p in range(processes)}
    client = None
    if processes > 1:
        from jax._src import distributed  # the coordination service's key-value store: no public handle

        client = distributed.global_state.client
        # every process says how many ranks it trains; all refuse an uneven mesh, naming each
        client.key_value_set(f"grf/devices/{process}", str(per))
        wait_ms = int(1000 * limits(cfg.dist.timeout_s).collective_s)
        check_even({p: int(client.blocking_key_value_get(f"grf/devices/{p}", wait_ms)) for p in range(processes)},
                   {p: len(ds) for p, ds in by_process.items()})
    devices = [d for p in range(processes) for d in by_process[p][:per]]
    return MeshComm(devices, process, processes, client)


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


# ----------------------------------------------------------------------------- a row-sharded table on the mesh
class _Owner:
    """What a ``ShardedTable`` asks of its collective when it only keeps a mesh rank's host side:
    its rank and the world size (``MeshTable`` runs the exchange on the devices)."""

    mesh = False

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


class MeshTable:
    """A row-sharded item table (``embedding.sharding = "row"``) on the mesh of one JAX process:
    rank o's device holds the rows ``embedding.sharding.owners`` gives o, and their row-sparse
    optimizer state. Each owner's host side (the hash table's id -> row map, the dense table's
    row of each id, counters, checkpoint export / load, re-sharding) is a
    ``embedding.sharding.ShardedTable``, as on torch ranks, so checkpoints are the same files and
    a run moves between torch ranks and JAX devices.

    The requests are planned on the host (``plan``): the process builds the whole global batch,
    so it knows every rank's ids; each owner deduplicates what all ranks ask of it and maps the ids
    to its rows in the order a torch owner does. Rows and gradients travel between the devices by
    ``jax.lax.all_to_all`` inside the step (``make_sharded_table_step``): the owner gathers the
    rows (fresh rows at their initial value), sends each rank the rows it asked for, receives the
    ranks' row gradients, sums them per row (``segment_sum``) and applies the row-sparse
    optimizer, skipped everywhere when any rank's step is not finite."""

    def __init__(self, B, cfg, comm, dense_rows=None):

        R = comm.world_size
        self.B, self.cfg, self.comm, self.world = B, cfg, comm, R
        self.owners = [make_sharded(B, cfg, _Owner(o, R), dense_rows) for o in range(R)]
        self.dim, self.kind = self.owners[0].dim, self.owners[0].kind
        self.optimizer = cfg.embedding.optimizer
        self._to_devices()

    # ---- the rows between the owners' host objects and the mesh
    def _to_devices(self) -> None:
        """The owners' values and state, stacked ``[R, n, ...]``, onto the mesh (rank o's on device o)."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        B, here = self.B, list(self.comm.local_ranks)  # over several processes each places its own ranks' rows
        sharding = NamedSharding(table_mesh(self.cfg, self.comm.devices), P(("node", "local")))
        self.values = B.device_put(np.stack([B.to_numpy(self.owners[o].values) for o in here]), sharding)
        self.state = {k: B.device_put(np.stack([B.to_numpy(self.owners[o].state[k]) for o in here]), sharding)
                      for k in self.owners[0].state}
        for t in self.owners:  # the mesh holds them now
            t.values, t.state = None, None

    def _from_devices(self) -> None:
        """Every owner's rows back on its host object (over several processes: gathered to every
        process, a collective)."""
        B = self.B

        def whole(x):
            if x.is_fully_addressable:
                return B.to_numpy(x)
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))

        values = whole(self.values)
        state = {k: whole(v) for k, v in self.state.items()}
        for o, t in enumerate(self.owners):
            t.values, t.state = B.asarray(values[o]), {k: B.asarray(v[o]) for k, v in state.items()}

    def export_all(self, comm=None) -> list | None:
        """Every owner's ``ShardedTable.export`` (the checkpoint's ``shards``, rank order) on
        process 0, None on the others. Collective."""
        self._from_devices()
        try:
            return [t.export() for t in self.owners] if self.comm.is_main else None
        finally:
            for t in self.owners:
                t.values, t.state = None, None

    def load(self, shards: list) -> None:
        """The owners' rows from a checkpoint's ``shards`` (any world size: re-sharded by id)."""
        self._from_devices()
        for t in self.owners:
            t.load(shards)
        self._to_devices()

    def counters(self) -> dict:
        """The hash table's counters summed over owners ({} for a dense table)."""
        per = [t.counters() for t in self.owners]
        return {k: sum(c[k] for c in per) for k in per[0]} if per[0] else {}

    @property
    def bytes(self) -> dict:
        return {k: sum(t.bytes[k] for t in self.owners) for k in self.owners[0].bytes}

    # ---- a step's plan
    def plan(self, ids: list, step: int) -> tuple[dict, list]:
        """``(arrays, admitted)`` for ``make_sharded_table_step`` from ``ids[r]`` (rank r's
        distinct ids, int64 increasing), routed as the torch exchange routes them: rank r sends
        each id to the rank of its node whose local index is the owner's (``embedding.node_size``
        G ranks per node when ``embedding.hierarchical``; flat: one node of all R ranks, so that
        rank is the owner), which merges its node's requests and sends them on to the owner.

        arrays: ``own_rows[R, M]`` int32 (each owner's rows this step, 0 padding),
        ``own_fresh[R, M]``, ``own_init[R, M, D]`` (fresh rows' initial values), ``own_pos[R, N,
        C2]`` int32 (owner q's slot of the c-th id its node-n peer asks of it; M - 1, a row-0
        slot, for padding), ``mid_pos[R, G, C1]`` int32 (an intermediate's place, in the rows it
        got from the owners, of the c-th id its local peer g asks of it; ``N * C2`` for padding),
        ``perm[R, U]`` int32 (rank r's k-th id's place in the rows it gets; ``G * C1`` for
        padding). admitted: per rank, whether each id has a row (the others read zeros). The
        owners' maps change as torch owners' do, and the bytes are counted as theirs are."""
        R, D = self.world, self.dim
        G = self.owners[0].node_size if self.owners[0].hierarchical else R
        N = R // G
        node = lambda r: r // G  # noqa: E731
        own = [owners(u, R, self.kind) for u in ids]
        via = [node(r) * G + o % G for r, o in enumerate(own)]          # hop 1: the intermediate of each id
        merged = [np.unique(np.concatenate([ids[r][via[r] == m] for r in range(node(m) * G, node(m) * G + G)]))
                  for m in range(R)]                                   # what each intermediate sends on
        merged_own = [owners(x, R, self.kind) for x in merged]
        hop1, hop2 = np.zeros((R, R), np.int64), np.zeros((R, R), np.int64)   # [from, to] ids per hop
        for r in range(R):
            hop1[r] = np.bincount(via[r], minlength=R)
            hop2[r] = np.bincount(merged_own[r], minlength=R)
        C1, C2 = round_up_capacity(int(hop1.max()), 1), round_up_capacity(int(hop2.max()), 1)
        mine = [np.unique(np.concatenate([merged[m][merged_own[m] == q] for m in range(R)])) for q in range(R)]
        M = round_up_capacity(max(len(x) for x in mine) + 1)
        own_rows, own_fresh = np.zeros((R, M), np.int32), np.zeros((R, M), bool)
        own_init, own_pos = np.zeros((R, M, D), np.float32), np.full((R, N, C2), M - 1, np.int32)
        got_rows = []
        for q, t in enumerate(self.owners):
            if t.table is None:
                rows, fresh = t._dense_rows_of(mine[q]), np.zeros(len(mine[q]), bool)
            else:
                got = t.table.assign(mine[q], step)
                rows, fresh = got.rows, got.fresh
            n = len(mine[q])
            own_rows[q, :n], own_fresh[q, :n] = rows, fresh
            if fresh.any():
                own_init[q, :n][fresh] = (hashed_init(t.seed, mine[q][fresh], D) if t.dense_rows is None
                                          else t.dense_rows[mine[q][fresh]])
            got_rows.append(rows)
        # hop 2: intermediate m's ids for owner q (of node n), in m's order, at q's slots and back
        mid_pos, slot_of = np.full((R, G, C1), N * C2, np.int32), []
        for m in range(R):
            at = np.zeros(len(merged[m]), np.int64)           # each merged id's place in the rows m gets
            for q in np.unique(merged_own[m]):
                take = np.flatnonzero(merged_own[m] == q)
                own_pos[q, node(m), :len(take)] = np.searchsorted(mine[q], merged[m][take])
                at[take] = node(q) * C2 + np.arange(len(take))
            slot_of.append(at)
        # hop 1: rank r's ids for intermediate m (of r's node), in r's order
        U = round_up_capacity(max(len(u) for u in ids) + 1) - 1
        perm, admitted = np.full((R, U), G * C1, np.int32), []
        for r, u in enumerate(ids):
            for m in np.unique(via[r]):
                take = np.flatnonzero(via[r] == m)
                mid_pos[m, r % G, :len(take)] = slot_of[m][np.searchsorted(merged[m], u[take])]
                perm[r, take] = (m % G) * C1 + np.arange(len(take))
            ok = np.zeros(len(u), bool)
            for q in np.unique(own[r]):
                take = np.flatnonzero(own[r] == q)
                ok[take] = got_rows[q][np.searchsorted(mine[q], u[take])] > 0
            admitted.append(ok)
        row_bytes = 4 * D
        for hop in (hop1, hop2) if N > 1 else (hop1,):  # flat: one hop, as torch routes it
            for r in range(R):
                self.owners[r]._count("ids", hop[r], 8)
                self.owners[r]._count("rows", hop[:, r], row_bytes)
                self.owners[r]._count("grads", hop[r], row_bytes)
        return {"own_rows": own_rows, "own_fresh": own_fresh, "own_init": own_init, "own_pos": own_pos,
                "mid_pos": mid_pos, "perm": perm}, admitted


def table_mesh(cfg, devices):
    """The mesh of a row-sharded table's step: "node" (N) x "local" (G = ``embedding.node_size``
    when ``embedding.hierarchical``, else all R ranks in one node), rank r at (r // G, r % G)."""
    from jax.sharding import Mesh

    R = len(devices)
    G = cfg.embedding.node_size if cfg.embedding.hierarchical else R
    return Mesh(np.array(devices).reshape(R // G, G), ("node", "local"))


def make_sharded_table_step(B, cfg, devices):
    """The data-parallel step of a mesh whose item table is row-sharded (``MeshTable``):
    ``step(params, opt_state, micro, scales, global_tokens, values, state, plan) -> (params,
    opt_state, metrics, values, state)``. params are the dense parameters; micro / scales as
    ``make_sharded_train_step``'s, every rank's batches localised to its ids (``plan``'s
    ``perm`` order, slot 0 padding) with a ``Lookup`` whose ``touched`` marks the ids that have
    a row; values ``[R, n, D]`` / state: the shards; plan: ``MeshTable.plan``'s arrays. The mesh
    has two axes, "node" (N) x "local" (G ranks per node: ``embedding.node_size`` when
    ``embedding.hierarchical``, else all R in one node): the rows travel owner -> intermediate
    over "node" and intermediate -> asker over "local" (``jax.lax.all_to_all``), the gradients
    back the same way, summed at each end (``segment_sum``). The math of
    ``step.make_sharded_dist_step`` (torch ranks over ``ShardedTable``)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, ranks = table_mesh(cfg, devices), ("node", "local")
    N, G = mesh.devices.shape
    ocfg = dataclasses.replace(cfg.optim, lr=cfg.embedding.lr or cfg.optim.lr)
    optimizer = cfg.embedding.optimizer

    def per_rank(params, opt_state, micro, scales, global_tokens, values, state, plan):
        local = [jax.tree_util.tree_map(lambda x: x[0], mb) for mb in micro]
        values, state = values[0], {k: v[0] for k, v in state.items()}
        rows, fresh, init = plan["own_rows"][0], plan["own_fresh"][0], plan["own_init"][0]
        pos, mid, perm = plan["own_pos"][0], plan["mid_pos"][0], plan["perm"][0]   # [N, C2], [G, C1], [U]
        C2, C1, D = pos.shape[1], mid.shape[1], values.shape[1]
        pad = lambda x: jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])  # noqa: E731 - the padding slot's zero row
        # owner: this step's rows (fresh ones at their initial value, a zero state) -> intermediates -> askers
        looked = jnp.where(fresh[:, None], init, values[rows])
        old_state = {k: jnp.where(jnp.reshape(fresh, (-1,) + (1,) * (s.ndim - 1)), jnp.zeros_like(s[rows]), s[rows])
                     for k, s in state.items()}
        at_mid = jax.lax.all_to_all(looked[pos], "node", 0, 0).reshape(N * C2, D)
        mine = jax.lax.all_to_all(pad(at_mid)[mid], "local", 0, 0).reshape(G * C1, D)
        view = {**params, TABLE: jnp.concatenate([jnp.zeros((1, D), mine.dtype), pad(mine)[perm]])}
        loss_part, grads = rank_grads(B, view, opt_state, local, [scales[0, i] for i in range(len(local))], cfg)
        row_grads = grads.pop(TABLE)[1:]                                   # [U, D]
        grads = jax.lax.psum(grads, ranks)
        loss = jax.lax.psum(loss_part, ranks)
        bad = jax.lax.psum(jnp.where(all_finite(B, row_grads), 0, 1), ranks)
        lr = learning_rate(jnp, opt_state["step"] + 1.0, ocfg)            # this update's (unused when skipped)
        params, opt_state, metrics = apply_update(B, params, opt_state, loss, global_tokens, grads, cfg,
                                                  others_ok=bad == 0)
        # the rows' gradients back: summed per id at the intermediate, then per row at the owner
        sent = jnp.zeros((G * C1 + 1, D), row_grads.dtype).at[perm].add(row_grads)[:G * C1].reshape(G, C1, D)
        at_mid = jax.lax.all_to_all(sent, "local", 0, 0).reshape(G * C1, D)
        merged = jnp.zeros((N * C2 + 1, D), at_mid.dtype).at[mid.reshape(-1)].add(at_mid)[:N * C2].reshape(N, C2, D)
        arrived = jax.lax.all_to_all(merged, "node", 0, 0)                 # [N, C2, D], aligned with pos
        summed = jax.ops.segment_sum(arrived.reshape(-1, D), pos.reshape(-1), num_segments=rows.shape[0])
        new, new_state = rowopt.row_update(B, optimizer, looked, summed, old_state, rows > 0, lr, ocfg)
        ok = metrics["finite"]
        keep = lambda n, o: jnp.where(ok, n, o)  # noqa: E731 - a skipped step: the looked-up rows (fresh ones at init)
        values = values.at[rows].set(keep(new, looked))
        state = {k: s.at[rows].set(keep(new_state[k], old_state[k])) for k, s in state.items()}
        return params, opt_state, metrics, values[None], {k: v[None] for k, v in state.items()}

    spec = P(ranks)
    sharded = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(), spec, spec, P(), spec, spec, spec),
                                    out_specs=(P(), P(), P(), spec, spec), check_vma=False))
    data_sharding = NamedSharding(mesh, spec)

    def step(params, opt_state, micro, scales, global_tokens, values, state, plan):
        micro = B.device_put(micro, data_sharding)
        scales = B.device_put(np.asarray(scales, dtype=np.float32), data_sharding)
        plan = B.device_put(plan, data_sharding)   # over several processes: this process's ranks' rows
        params, opt_state, metrics, values, state = sharded(params, opt_state, micro, scales,
                                                            np.float32(global_tokens), values, state, plan)
        return params, opt_state, local_copy(metrics), values, state

    return step
