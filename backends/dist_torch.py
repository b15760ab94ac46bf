"""Multi-process data parallelism for the torch backends (``torch.distributed``) and its watchdog.

gr_functional imports no array library, so the runner and the distributed train step talk to a
``TorchCollective`` through these duck-typed members (``init`` builds one from torchrun's env):

  rank, world_size, local_rank, is_main
  value_and_grad(B, f, has_aux)  like ``B.value_and_grad`` but the gradients come back
                                 SUM-all-reduced over ranks; buckets are launched from tensor
                                 hooks while backward still runs (overlap), ``prior=`` adds
                                 locally accumulated micro-batch gradients first
  all_reduce_tree(tree)          bucketed SUM all-reduce of a tree of tensors (no overlap)
  all_reduce_sum(values)         SUM of a small host float64 vector (loss, timings)
  broadcast(obj, src=0)          a picklable object from ``src`` (checkpoint state, errors)
  barrier()
  progress(phase)                tell the watchdog the main thread moved on (phase: a short
                                 name; names starting with "wait" mean "blocked on others")
  post(tag) / wait_for(tag)      rank 0 says it finished something (evaluation, files); the
                                 others wait on the rendezvous store, not in a collective, so a
                                 long evaluation is never a collective timeout
  fail(message)                  publish this rank's fatal error so peers stop at once
  shutdown()

Failure detection (README "Distributed training"). Every collective runs under the process-group
timeout (``dist.timeout_s``). A watchdog thread per rank writes a heartbeat (a counter, the main
thread's progress counter and phase) to the rendezvous store every ``interval`` seconds and reads
everyone else's, judging staleness on its own monotonic clock (no cross-host clock sync needed):

  - a peer's heartbeat unchanged for ``timeout_s``: "rank N died or is stopped";
  - a peer (or this rank) not in a "wait" phase whose progress is unchanged for ``timeout_s``:
    "rank N hung ... in phase P at step S" (the others are waiting for it);
  - a peer published a failure: "rank N failed: MESSAGE";
  - the store itself unreachable for ``3 * interval``: the store's host (rank 0 or the torchrun
    agent) is gone.

On any of these the watchdog prints ``grf: error: rank R: ...`` and ends the process with exit
code 4 (``os._exit``: the main thread may be blocked inside a C++ collective). A collective that
fails in the main thread (gloo: "connection closed by peer" when a peer dies) first waits a
few heartbeat intervals to name the rank whose heartbeat stopped, then raises
``DistributedError`` naming it. So no failure is silent and every rank exits within about
``timeout_s`` (a dead peer: within a few intervals, as soon as a collective notices).
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from gr_functional.tree import tree_items, tree_map, tree_map_with_path

PG_BACKENDS = ("gloo", "nccl", "hccl")
EXIT_DIST_FAILURE = 4


def _error_cls():
    from gr_functional.runner import DistributedError

    return DistributedError


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun (1 when not launched by it)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def device_for(pg_backend: str, configured: str) -> str:
    """The torch device of this rank: ``configured`` if it names an index, else the
    LOCAL_RANK-th device of the process-group backend's device type (cpu for gloo)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if configured and (":" in configured or configured == "cpu"):
        return configured
    kind = configured or {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}[pg_backend]
    return kind if kind == "cpu" else f"{kind}:{local}"


def init(dist_cfg, device: str = "cpu") -> "TorchCollective":
    """Join the process group described by torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) with ``dist_cfg.backend`` and ``dist_cfg.timeout_s``, start the
    watchdog. Raises ``DistributedError`` naming the rank and the fix when that fails."""
    import torch
    import torch.distributed as dist

    Err = _error_cls()
    backend = dist_cfg.backend
    if backend not in PG_BACKENDS:
        raise Err(f"dist.backend={backend!r} is not one of {', '.join(PG_BACKENDS)}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise Err(f"distributed training needs the environment torchrun sets ({', '.join(missing)} missing); "
                  f"launch with `grf train --nproc N ...` or `torchrun --nproc_per_node N -m gr_functional.cli "
                  f"train ...`")
    rank = int(os.environ["RANK"])
    if backend == "gloo" and not dist.is_gloo_available():
        raise Err(f"rank {rank}: this torch build has no gloo; use dist.backend='nccl' (CUDA) or 'hccl' (Ascend)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise Err(f"rank {rank}: dist.backend='nccl' needs CUDA GPUs; on CPU use dist.backend='gloo'")
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401  (registers the hccl process-group backend)
        except ImportError as exc:
            raise Err(f"rank {rank}: dist.backend='hccl' needs torch_npu with CANN ({exc}); on CPU use "
                      f"dist.backend='gloo'") from exc
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    elif device.startswith("npu"):
        torch.npu.set_device(torch.device(device))  # type: ignore[attr-defined]
    timeout = datetime.timedelta(seconds=float(dist_cfg.timeout_s))
    try:
        dist.init_process_group(backend, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the store's message says how many joined
        raise Err(f"rank {rank}: the process group ({backend}, {os.environ['WORLD_SIZE']} ranks at "
                  f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}) did not form within "
                  f"dist.timeout_s={dist_cfg.timeout_s:g}: {exc}. Check that every rank was started with "
                  f"the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE") from exc
    return TorchCollective(dist_cfg, device)


class TorchCollective:
    """A joined process group plus its watchdog; see the module docstring for the members."""

    def __init__(self, dist_cfg, device: str = "cpu"):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main = self.rank == 0
        self.backend = dist.get_backend()
        self.device = torch.device(device)
        self.timeout_s = float(dist_cfg.timeout_s)
        self.bucket_bytes = max(1, int(float(dist_cfg.bucket_mb) * 2**20))
        # heartbeat period: fine enough to name a dead rank within seconds, coarse enough that
        # R ranks polling one store stay cheap
        self.interval = min(5.0, max(0.2, self.timeout_s / 10.0))
        self._ready_order: list[str] | None = None  # leaf paths in the order backward produced them
        self.last_backward_end = 0.0
        self.last_backward_cpu = 0.0
        self.step = 0
        self._watchdog = _Watchdog(self)  # publishes this rank's first heartbeat
        self.barrier()  # every heartbeat key exists before any watchdog reads them
        self._watchdog.start()

    # ------------------------------------------------------------------ small collectives
    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a blocking collective in a "wait" phase; a failure raises ``DistributedError``
        naming the rank whose heartbeat stopped, when one did."""
        self.progress(f"wait:{what}")
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            self._collective_failed(what, exc)
        self.progress("run")
        return out

    def _collective_failed(self, what: str, exc: BaseException):
        Err = _error_cls()
        culprit = self._watchdog.find_dead(wait_s=min(self.timeout_s, max(4 * self.interval, 2.0)))
        # same wording as the watchdog's own message: whichever path notices first, users read one text
        who = (f"rank {culprit[0]} died or is stopped: no heartbeat for {culprit[1]:.1f} s" if culprit
               else "no rank's heartbeat stopped (a network problem, or a rank exited)")
        msg = f"rank {self.rank}: {what} at step {self.step} failed: {who}. Underlying error: {exc}"
        self.fail(msg)
        raise Err(msg) from exc

    def barrier(self) -> None:
        self._run("barrier", lambda: self._dist.barrier())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        self._run(f"broadcast from rank {src}", lambda: self._dist.broadcast_object_list(box, src=src))
        return box[0]

    def all_reduce_sum(self, values) -> np.ndarray:
        """SUM over ranks of a small host vector (float64; float32 on hccl)."""
        torch = self._torch
        dtype = torch.float32 if self.backend == "hccl" else torch.float64
        t = torch.as_tensor(np.asarray(values, dtype=np.float64), dtype=dtype, device=self.device)
        self._run("all-reduce of the loss", lambda: self._dist.all_reduce(t))
        return t.cpu().numpy().astype(np.float64)

    def all_reduce_tree(self, tree):
        """SUM all-reduce of every leaf of ``tree`` (torch tensors), in buckets of ``dist.bucket_mb``."""
        paths = [(p, leaf) for p, leaf in tree_items(tree)]
        reducer = _Reducer(self, [p for p, _ in paths], [leaf for _, leaf in paths], None)
        reduced = reducer.finish([leaf for _, leaf in paths])
        by_path = dict(zip([p for p, _ in paths], reduced))
        return tree_map_with_path(lambda p, leaf: by_path[p], tree)

    # ------------------------------------------------------------------ gradients
    def value_and_grad(self, B, f: Callable, has_aux: bool = False) -> Callable:
        """``g(params, *args, prior=None) -> (value, grads)``: ``B.value_and_grad(f)`` with the
        gradients SUM-all-reduced over ranks. Each leaf's hook (fired by autograd when that
        leaf's gradient is complete) adds ``prior[path]`` (gradients of earlier local
        micro-batches) and, once a bucket's leaves are all in, launches its async all-reduce,
        so communication overlaps the rest of backward (gloo runs it on its own threads).
        ``self.last_backward_end`` / ``last_backward_cpu`` hold the ``perf_counter`` and main-thread
        ``thread_time`` when backward finished."""
        torch = self._torch

        def wrapped(params, *args, prior=None, **kwargs):
            with torch.enable_grad():
                leaves = tree_map(lambda p: p.detach().requires_grad_(p.is_floating_point()), params)
                pairs = [(path, leaf) for path, leaf in tree_items(leaves) if leaf.requires_grad]
                prior_map = dict(tree_items(prior)) if prior is not None else None
                reducer = _Reducer(self, [p for p, _ in pairs], [leaf for _, leaf in pairs], prior_map)
                handles = [leaf.register_hook(reducer.hook(i)) for i, (_, leaf) in enumerate(pairs)]
                try:
                    out = f(leaves, *args, **kwargs)
                    loss, aux = out if has_aux else (out, None)
                    grads = torch.autograd.grad(loss, [leaf for _, leaf in pairs], allow_unused=True)
                finally:
                    for h in handles:
                        h.remove()
            self.last_backward_end = time.perf_counter()
            self.last_backward_cpu = time.thread_time()
            reduced = reducer.finish(list(grads))
            if self._ready_order is None:
                self._ready_order = reducer.ready_order()
            by_path = dict(zip([p for p, _ in pairs], reduced))
            grad_tree = tree_map_with_path(lambda path, leaf: by_path.get(path, torch.zeros_like(leaf)), leaves)
            detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
            value = (loss.detach(), tree_map(detach, aux)) if has_aux else loss.detach()
            return value, grad_tree

        return wrapped

    # ------------------------------------------------------------------ watchdog-facing
    def progress(self, phase: str) -> None:
        self._watchdog.progress(phase)

    def post(self, tag: str) -> None:
        self._watchdog.main_store.set(f"posted/{tag}", "1")

    def wait_for(self, tag: str) -> None:
        """Block until some rank ``post``-ed ``tag`` (store polling; the watchdog ends this
        process if the poster dies or hangs meanwhile)."""
        self.progress(f"wait:{tag}")
        store, key = self._watchdog.main_store, f"posted/{tag}"
        delay = 0.01
        while True:
            try:
                if store.check([key]):
                    break
            except Exception as exc:  # noqa: BLE001
                self._collective_failed(f"waiting for {tag}", exc)
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
        self.progress("run")

    def fail(self, message: str) -> None:
        """Publish this rank's fatal error (first writer wins) so every peer stops at once."""
        try:
            s = self._watchdog.main_store
            s.compare_set("failure", "", f"{self.rank}\t{message}")
            s.add("failures", 1)
        except Exception:  # noqa: BLE001 - the store may be the thing that failed
            pass

    def shutdown(self) -> None:
        """Stop the watchdog, then leave the process group (after a barrier, so rank 0 never
        takes a store it hosts away from ranks still using it)."""
        self._watchdog.stop()
        try:
            self._dist.barrier()
        finally:
            self._dist.destroy_process_group()


class _Reducer:
    """Buckets of gradient leaves all-reduced (SUM, async) as soon as each bucket is complete."""

    def __init__(self, comm: TorchCollective, paths: list[str], leaves: list, prior: dict | None):
        self.comm, self.paths, self.prior, self.leaves = comm, paths, prior, leaves
        self.grads: list = [None] * len(paths)
        self.fired: list[int] = []
        index = {p: i for i, p in enumerate(paths)}
        # bucket order: the order backward produced gradients last time (DDP rebuilds its buckets
        # the same way after the first step), else reverse definition order
        order = [index[p] for p in (comm._ready_order or []) if p in index]
        order += [i for i in reversed(range(len(paths))) if i not in set(order)]
        self.buckets: list[list[int]] = []
        current, size, dtype = [], 0, None
        for i in order:
            nbytes = leaves[i].numel() * leaves[i].element_size()
            if current and (size + nbytes > comm.bucket_bytes or leaves[i].dtype != dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
            dtype = leaves[i].dtype
        if current:
            self.buckets.append(current)
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.pending = [len(m) for m in self.buckets]
        self.works: dict[int, tuple] = {}

    def hook(self, i: int):
        def fn(grad):
            self._take(i, grad.detach())
            return None  # the gradient autograd hands back stays the local one (unused)
        return fn

    def _take(self, i: int, grad) -> None:
        if self.grads[i] is not None:
            return
        if self.prior is not None and self.paths[i] in self.prior:
            grad = grad + self.prior[self.paths[i]]
        self.grads[i] = grad
        self.fired.append(i)
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        torch = self.comm._torch
        members = self.buckets[b]
        flat = torch.cat([self.grads[i].reshape(-1) for i in members])
        if flat.device != self.comm.device:
            flat = flat.to(self.comm.device)
        work = self.comm._dist.all_reduce(flat, async_op=True)
        self.works[b] = (work, flat)

    def finish(self, local: list) -> list:
        """Launch what the hooks did not (leaves without a gradient get zeros), wait, unflatten."""
        torch = self.comm._torch
        for i, g in enumerate(local):
            if self.grads[i] is None:
                self._take(i, g.detach() if g is not None else torch.zeros_like(self.leaves[i]))
        out: list = [None] * len(self.paths)

        def wait_all():
            for b, members in enumerate(self.buckets):
                work, flat = self.works[b]
                work.wait()
                off = 0
                for i in members:
                    n = self.grads[i].numel()
                    out[i] = flat[off:off + n].view_as(self.grads[i]).to(self.grads[i].device)
                    off += n

        self.comm._run("gradient all-reduce", wait_all)
        return out

    def ready_order(self) -> list[str]:
        return [self.paths[i] for i in self.fired]


class _Watchdog(threading.Thread):
    """Heartbeat writer and failure detector (module docstring). Daemon thread."""

    def __init__(self, comm: TorchCollective):
        super().__init__(name=f"grf-watchdog-rank{comm.rank}", daemon=True)
        import torch.distributed as dist

        self.comm = comm
        self.rank, self.world = comm.rank, comm.world_size
        self.addr, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # keys of this job and restart only (a restarted torchrun job reuses the agent's store)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        prefix = f"grf/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

        def client():
            store = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=max(2.0, 2 * comm.interval)))
            return dist.PrefixStore(prefix, store)

        self.store = client()        # this thread's connection
        self.main_store = client()   # the main thread's (post / wait_for / fail)
        self.main_store.compare_set("failure", "", "")  # create the key (first writer wins)
        self._lock = threading.Lock()
        self._progress, self._phase = 0, "setup"
        self._beat = 0
        self._halt = threading.Event()
        now = time.monotonic()
        self.seen_beat = {r: (None, now) for r in range(self.world)}
        self.seen_prog = {r: (None, now, "setup", 0) for r in range(self.world)}
        self.own_prog_time = now
        self._publish()

    def progress(self, phase: str) -> None:
        with self._lock:
            self._progress += 1
            self._phase = phase
            self.own_prog_time = time.monotonic()

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
            value = f"{self._beat}\t{self._progress}\t{self.comm.step}\t{self._phase}"
        self.store.set(f"hb/{self.rank}", value)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=2 * self.comm.interval + 1)

    def find_dead(self, wait_s: float) -> tuple[int, float] | None:
        """A peer whose heartbeat has not changed for > 3 intervals, waiting up to ``wait_s`` for
        one to appear (called after a collective failed): ``(rank, seconds)`` or None."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            stale = [(r, now - t) for r, (_, t) in self.seen_beat.items()
                     if r != self.rank and now - t > 3 * self.comm.interval]
            if stale:
                return max(stale, key=lambda x: x[1])
            if now >= deadline or not self.is_alive():
                return None
            time.sleep(0.05)

    def _die(self, message: str) -> None:
        text = f"grf: error: rank {self.rank}: {message}"
        try:
            print(text, file=sys.stderr, flush=True)
        finally:
            self.comm.fail(message)
            os._exit(EXIT_DIST_FAILURE)

    def run(self) -> None:
        keys = [f"hb/{r}" for r in range(self.world)]
        store_down_since = None
        timeout, interval = self.comm.timeout_s, self.comm.interval
        while not self._halt.wait(interval):
            try:
                self._publish()
                values = self.store.multi_get(keys)
                failures = int(self.store.add("failures", 0))
                failure = self.store.get("failure").decode() if failures else ""
                store_down_since = None
            except Exception as exc:  # noqa: BLE001
                if self._halt.is_set():
                    return
                now = time.monotonic()
                store_down_since = store_down_since or now
                if now - store_down_since > 3 * interval:
                    self._die(f"lost the rendezvous store at {self.addr}:{self.port} for "
                              f"{now - store_down_since:.1f} s ({exc}); it lives in rank 0 (or the torchrun "
                              f"agent on its host), which has probably died")
                continue
            now = time.monotonic()
            if failure:
                who, _, msg = failure.partition("\t")
                if who != str(self.rank):
                    self._die(f"stopping because rank {who} failed: {msg}")
            for r, raw in enumerate(values):
                beat, prog, step, phase = raw.decode().split("\t", 3)
                if beat != self.seen_beat[r][0]:
                    self.seen_beat[r] = (beat, now)
                if prog != self.seen_prog[r][0]:
                    self.seen_prog[r] = (prog, now, phase, step)
                else:
                    self.seen_prog[r] = (prog, self.seen_prog[r][1], phase, step)
            with self._lock:
                own_idle, own_phase = now - self.own_prog_time, self._phase
            if not own_phase.startswith("wait") and own_idle > timeout:
                self._die(f"this rank hung: no progress for {own_idle:.1f} s in phase {own_phase!r} at step "
                          f"{self.comm.step} (dist.timeout_s={timeout:g}); the other ranks are stopping too")
            for r in range(self.world):
                if r == self.rank:
                    continue
                _, t_beat = self.seen_beat[r]
                _, t_prog, phase, step = self.seen_prog[r]
                if now - t_beat > timeout:
                    self._die(f"rank {r} died or is stopped: no heartbeat for {now - t_beat:.1f} s (last seen at "
                              f"step {step}, phase {phase!r}; dist.timeout_s={timeout:g})")
                # "hung" needs a live heartbeat: a rank whose heartbeat stopped too is dead or
                # stopped, and the rule above names it so once its silence reaches timeout_s
                if not phase.startswith("wait") and now - t_prog > timeout and now - t_beat <= 3 * interval:
                    self._die(f"rank {r} hung: no progress for {now - t_prog:.1f} s in phase {phase!r} at step "
                              f"{step} while this rank waits for it (dist.timeout_s={timeout:g})")
