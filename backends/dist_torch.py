"""Multi-process data parallelism for the torch backends (``torch.distributed``) and its watchdog.

gr_functional imports no array library, so the runner and the distributed train step talk to a
``TorchCollective`` through these duck-typed members (``init`` builds one from torchrun's env):

  rank, world_size, local_rank, is_main
  value_and_grad(B, f, has_aux)  like ``B.value_and_grad`` but the gradients come back
                                 SUM-all-reduced over ranks; buckets are launched from tensor
                                 hooks while backward still runs (overlap), ``prior=`` adds
                                 locally accumulated micro-batch gradients first
  all_reduce_sum(values)         SUM of a small host float64 vector (loss, timings)
  exchange_counts / all_to_all   the sizes and rows of an all-to-all (row-sharded tables);
  all_to_all_start               the same in the background on a second group: ``finish()``
  lane()                         exchange_counts / all_to_all for ONE background thread (the
                                 prefetch worker's id exchanges), on a process group of its own
  broadcast(obj, src=0)          a picklable object from ``src`` (checkpoint state, errors)
  barrier()
  progress(phase)                tell the watchdog the main thread moved on (phase: a short
                                 name; names starting with "wait" mean "blocked on others")
  post(tag) / wait_for(tag)      rank 0 says it finished something (evaluation, files); the
                                 others wait on the rendezvous store, not in a collective, so a
                                 long evaluation is never a collective timeout
  fail(message)                  publish this rank's fatal error so peers stop at once
  shutdown()

Failure detection (docs/guides/distributed.md "Distributed training" / "Failure behaviour"). A watchdog thread per
rank, independent of the training step, writes a heartbeat (a counter, the main thread's progress
counter, step and phase) to the rendezvous store every ``interval`` seconds and reads everyone
else's. Nothing is judged on another host's clock: a peer's heartbeat is "unchanged for t
seconds" on the observer's own monotonic clock, and a rank judges its own progress itself (it
alone knows its phase and step times). With T = ``dist.timeout_s`` (``limits(T)``):

  interval      = min(5, max(0.2, T / 10))       heartbeat period
  dead_after    = max(T, 5 s)                    a peer's heartbeat unchanged this long: "rank N
                                                 died or is stopped" (SIGKILL, SIGSTOP, host
                                                 gone); >= 10 periods and >= 5 s, so a heartbeat
                                                 thread starved for a few seconds on a loaded
                                                 machine is not a death
  hang_after    = max(T, 5 x slowest step)       this rank made no progress this long outside a
                                                 "wait" phase: "this rank hung"; slowest step =
                                                 the longest time between the starts of two
                                                 consecutive steps measured so far on this rank,
                                                 counting only steps judged by this rule (so a
                                                 loaded machine, whose steps are all slow, raises
                                                 its own bound)
  warmup_after  = 10 x T                         the same, during warm-up: from the start (or
                                                 resume) and from each checkpoint, evaluation or
                                                 epoch end (``post`` / ``wait_for``) until the
                                                 second step after it begins, i.e. the first step
                                                 (compilation, caches, a new epoch's plan) and
                                                 everything before it are judged only by the
                                                 heartbeat plus this backstop
  store_down_after = max(3 x interval, 5 s)      no heartbeat round with the store completed this
                                                 long (calls failing, or blocked: judged by a
                                                 second thread): its host (rank 0 or the torchrun
                                                 agent) is gone or stopped
  collective_s  = warmup_after + dead_after      the process-group timeout of every collective: a
                                                 last resort (all ranks waiting in a collective
                                                 that never completes), never shorter than what
                                                 the rules above allow a slow rank

Phases: the runner reports ``progress("step")`` at the start of each step, "checkpoint", "eval"
and "files" (these three start a warm-up), and this module reports "wait:..." / "run" around
each collective and store wait; "wait" phases are never judged by the progress rules (the rank
waits for others, who are judged themselves).

On any of these the watchdog prints ``grf: error: rank R: ...``, publishes the message (peers
stop within one heartbeat: "stopping because rank R failed: ...") and ends the process with exit
code 4 (``os._exit``: the main thread may be blocked inside a C++ collective). A collective that
fails in the main thread (gloo: "connection closed by peer" when a peer dies) first waits up to
``dead_after`` to name the rank whose heartbeat stopped (stale for ``max(3 x interval, 2 s)``),
then raises ``DistributedError`` naming it. So every rank exits naming the culprit within:
a killed rank, ``dead_after`` (sooner, ~3 intervals, when a peer is in a collective with it);
a stopped rank, ``dead_after``; a rank stuck in its own code, ``hang_after`` (``warmup_after``
during warm-up) after its last progress; each plus about two heartbeat periods and scheduling.

Test-only hook: ``GRF_FAULT_SLOW_STEP="STEP:SECONDS[,STEP:SECONDS...]"`` makes the main thread
sleep SECONDS at the start of the forward pass of those steps (on rank ``GRF_FAULT_RANK`` only
when that is set): a slow but healthy step (tests/distributed/test_failure_under_load.py).
Benchmark-only: ``GRF_FAULT_EXCHANGE_DELAY_S=SECONDS`` makes every all-to-all (and its counts)
take at least SECONDS from its start, as a network's latency would (a background exchange's
delay runs in the background): what the pipelined step hides (``grf bench pipeline_sharded``).

``grf train --nproc N`` starts each rank through ``gr_functional.rank`` (``python -m gr_functional.rank
train ...``), which records the rank's exit code in ``$GRF_RANK_EXIT_DIR``; ``job_exit_code``
turns those into the job's exit code (torchrun itself only says 1). The launcher owns the job's
lifetime: ``supervise`` kills ranks still running ``STOP_GRACE_S`` after a rank recorded a
failure (a stopped rank would hold torchrun for its 30 s grace), ``stop_job`` passes Ctrl-C or
SIGTERM on to torchrun, bounded, and each rank stops when the launcher is gone
(``watch_launcher``; torchrun also gets SIGTERM then, on Linux); ``reap_exit_dirs`` removes the
temp folders of launchers that were killed.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gr_functional.tree import tree_items, tree_map, tree_map_with_path

PG_BACKENDS = ("gloo", "nccl", "hccl")
EXIT_DIST_FAILURE = 4
HANG_FACTOR = 5.0        # hang_after = max(T, HANG_FACTOR x slowest step)
WARMUP_FACTOR = 10.0     # warmup_after = WARMUP_FACTOR x T
FLOOR_S = 5.0            # heartbeat / store silences shorter than this are scheduling, never death
WARMUP_PHASES = ("checkpoint", "eval", "files")   # runner phases after which the next step warms up again
EXIT_DIR_ENV = "GRF_RANK_EXIT_DIR"                 # set by `grf train --nproc`: where ranks record exit codes
LAUNCHER_PID_ENV = "GRF_LAUNCHER_PID"              # set by `grf train --nproc`: ranks stop when it is gone
EXIT_DIR_PREFIX = "grf-ranks-"                     # the launcher's temp folder (in tempfile.gettempdir())
# a rank recorded a failing exit code: torchrun sends the others SIGTERM at once (they go at once:
# ranks keep SIGTERM's default action); those still running this much later ignore it (SIGSTOP
# holds it) and are killed by the launcher instead of after torchrun's own 30 s
STOP_GRACE_S = 1.0
STOP_WAIT_S = 10.0   # torchrun's time to exit once its ranks are gone, or to stop them when told to
SLOW_STEP_ENV = "GRF_FAULT_SLOW_STEP"              # test-only: "STEP:SECONDS,..." (module docstring)
EXCHANGE_DELAY_ENV = "GRF_FAULT_EXCHANGE_DELAY_S"  # benchmark-only: all-to-all latency (module docstring)


@dataclass(frozen=True)
class Limits:
    """The watchdog's thresholds for ``dist.timeout_s = timeout_s`` (seconds; module docstring)."""

    timeout_s: float
    interval: float          # heartbeat period
    dead_after: float        # a peer's heartbeat unchanged this long: died or stopped
    stale_after: float       # after a collective failed: a heartbeat this stale names the culprit
    store_down_after: float  # the store unreachable this long: its host is gone
    warmup_after: float      # no progress this long during warm-up: hung
    collective_s: float      # process-group timeout (last resort)

    def hang_after(self, slowest_step_s: float) -> float:
        """No progress this long outside warm-up and waits: hung."""
        return max(self.timeout_s, HANG_FACTOR * slowest_step_s)


def limits(timeout_s: float) -> Limits:
    """``Limits`` derived from ``dist.timeout_s`` (the rule in the module docstring and README)."""
    t = float(timeout_s)
    # heartbeat period: fine enough to name a dead rank within seconds, coarse enough that R ranks
    # polling one store stay cheap
    interval = min(5.0, max(0.2, t / 10.0))
    dead = max(t, FLOOR_S)
    warmup = WARMUP_FACTOR * t
    return Limits(timeout_s=t, interval=interval, dead_after=dead, stale_after=max(3 * interval, 2.0),
                  store_down_after=max(3 * interval, FLOOR_S), warmup_after=warmup,
                  collective_s=warmup + dead)


def _error_cls():
    from gr_functional.errors import DistributedError

    return DistributedError


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
    # the collectives' own timeout is only the last resort: the watchdog judges slow, dead and hung
    # ranks first, by rules that allow a slow first step (a short collective timeout would not)
    lim = limits(dist_cfg.timeout_s)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=lim.collective_s))
    except Exception as exc:  # noqa: BLE001 - the store's message says how many joined
        raise Err(f"rank {rank}: the process group ({backend}, {os.environ['WORLD_SIZE']} ranks at "
                  f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}) did not form within "
                  f"{lim.collective_s:g} s ({WARMUP_FACTOR:g} x dist.timeout_s + {lim.dead_after:g} s): {exc}. "
                  f"Check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE") from exc
    return TorchCollective(dist_cfg, device)


class TorchCollective:
    """A joined process group plus its watchdog; see the module docstring for the members."""

    def __init__(self, dist_cfg, device: str = "cpu"):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.mesh = False  # one rank per process (a JAX mesh: backends/dist_jax.py)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main = self.rank == 0
        self.backend = dist.get_backend()
        self.device = torch.device(device)
        self.timeout_s = float(dist_cfg.timeout_s)
        self.limits = limits(self.timeout_s)
        self.interval = self.limits.interval
        self.bucket_bytes = max(1, int(float(dist_cfg.bucket_mb) * 2**20))
        self._slow_steps = _slow_steps(self.rank)
        self.exchange_delay = float(os.environ.get(EXCHANGE_DELAY_ENV, "0") or 0)
        self._ready_order: list[str] | None = None  # leaf paths in the order backward produced them
        self._side = None  # all_to_all_start's process group
        self.last_backward_end = 0.0
        self.last_backward_cpu = 0.0
        self._step_start = (0.0, 0.0)
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
        # a killed peer's heartbeat goes stale within stale_after; wait up to dead_after for it (a
        # loaded machine may delay this rank's watchdog) rather than blame nobody
        culprit = self._watchdog.find_dead(wait_s=self.limits.dead_after + 2 * self.interval)
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

    def gather(self, obj: Any) -> list | None:
        """Every rank's ``obj`` on rank 0 (a list in rank order; None elsewhere)."""
        box = [None] * self.world_size if self.is_main else None
        self._run("gather to rank 0", lambda: self._dist.gather_object(obj, box, dst=0))
        return box

    def exchange_counts(self, send_counts) -> np.ndarray:
        """``recv[r]`` = what rank r sends this rank, given ``send_counts[r]`` = what this rank
        sends rank r (int64 [R]): the sizes of an ``all_to_all``."""
        return self._exchange_counts(send_counts, None, self._run)

    def _exchange_counts(self, send_counts, group, run) -> np.ndarray:
        torch = self._torch
        send = torch.as_tensor(np.asarray(send_counts, dtype=np.int64), device=self.device)
        recv = torch.empty_like(send)
        started = time.perf_counter()
        run("all-to-all of counts", lambda: self._dist.all_to_all_single(recv, send, group=group))
        self._latency(started)
        return recv.cpu().numpy()

    def all_to_all(self, x, send_counts, recv_counts):
        """Rows of ``x`` (destination-major: ``send_counts[r]`` rows for rank r) to their ranks;
        returns the rows received (``recv_counts[r]`` from rank r, in rank order). numpy in,
        numpy out (ids, on the host); a tensor stays a tensor on this rank's device (rows)."""
        return self._all_to_all(x, send_counts, recv_counts, None)()

    def all_to_all_start(self, x, send_counts, recv_counts):
        """``all_to_all`` in the background, on a second process group of the same ranks (made at
        the first call: every rank calls this at the same point), so the collectives the main
        group runs meanwhile (the next step's lookup, the dense all-reduce) do not queue behind
        it. Returns ``finish() -> rows received`` (waits). Every rank starts the same exchanges
        in the same order."""
        if self._side is None:
            timeout = datetime.timedelta(seconds=self.limits.collective_s)    # the main group's last resort
            self._side = self._run("second process group",
                                   lambda: self._dist.new_group(backend=self.backend, timeout=timeout))
        return self._all_to_all(x, send_counts, recv_counts, self._side)

    def lane(self) -> "Lane":
        """Blocking ``exchange_counts`` / ``all_to_all`` for one background thread, on a process
        group of its own made now (a collective: every rank calls this at the same point, on the
        main thread), so the thread's exchanges never interleave with the main thread's. The
        prefetch worker routes each step's ids to their owners on it (``train.prefetch`` with a
        row-sharded table); every rank's worker issues the same exchanges in the same order."""
        timeout = datetime.timedelta(seconds=self.limits.collective_s)
        group = self._run("prefetch process group", lambda: self._dist.new_group(backend=self.backend, timeout=timeout))
        return Lane(self, group)

    def _quiet(self, what: str, fn: Callable[[], Any]) -> Any:
        """``_run`` for a background thread: the same error (naming a dead peer), no progress
        phases (those describe the main thread)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            self._collective_failed(what, exc)

    def _all_to_all(self, x, send_counts, recv_counts, group, run=None):
        """Launch the exchange (blocking on the main group when ``group`` is None, asynchronous on
        ``group`` otherwise); ``finish()`` returns what arrived (waiting through ``run``, default
        ``_run``)."""
        torch = self._torch
        host = isinstance(x, np.ndarray)
        t = torch.from_numpy(np.ascontiguousarray(x)).to(self.device) if host else x.contiguous()
        wide = t.dtype in (torch.int16, torch.float16, torch.bfloat16) and t.ndim == 2
        wire = t.view(torch.uint8) if wide else t  # gloo has no 16-bit types: send the bytes
        out = wire.new_empty((int(np.sum(recv_counts)),) + tuple(wire.shape[1:]))
        recv, send = [int(c) for c in recv_counts], [int(c) for c in send_counts]
        started = time.perf_counter()
        if group is None:
            self._run("all-to-all", lambda: self._dist.all_to_all_single(out, wire, recv, send))
            self._latency(started)
            work = None
        else:
            work = self._dist.all_to_all_single(out, wire, recv, send, group=group, async_op=True)

        def finish():
            if work is not None:
                (run or self._run)("all-to-all (overlapped)", work.wait)
                self._latency(started)
            got = out.view(t.dtype) if wide else out
            return got.cpu().numpy() if host else got
        return finish

    def _latency(self, started: float) -> None:
        """``GRF_FAULT_EXCHANGE_DELAY_S``: wait until the exchange started at ``started`` has
        taken the injected latency."""
        left = self.exchange_delay - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)

    # ------------------------------------------------------------------ step timing
    def start_step(self) -> None:
        """Mark the start of a step's forward+backward (wall and main-thread CPU clocks)."""
        self._step_start = (time.perf_counter(), time.thread_time())

    def step_times(self) -> tuple[float, float, float]:
        """``(compute_s, cpu_s, wait_s)`` of the step since ``start_step``: wall and main-thread
        CPU seconds until this rank's backward finished, and the wall seconds it then waited for
        the gradient all-reduce (call right after the gradients are in)."""
        t0, c0 = self._step_start
        return (self.last_backward_end - t0, self.last_backward_cpu - c0,
                time.perf_counter() - self.last_backward_end)

    # ------------------------------------------------------------------ gradients
    def value_and_grad(self, B, f: Callable, has_aux: bool = False, local: tuple = ()) -> Callable:
        """``g(params, *args, prior=None) -> (value, grads)``: ``B.value_and_grad(f)`` with the
        gradients SUM-all-reduced over ranks. Each leaf's hook (fired by autograd when that
        leaf's gradient is complete) adds ``prior[path]`` (gradients of earlier local
        micro-batches) and, once a bucket's leaves are all in, launches its async all-reduce,
        so communication overlaps the rest of backward (gloo runs it on its own threads).
        ``self.last_backward_end`` / ``last_backward_cpu`` hold the ``perf_counter`` and main-thread
        ``thread_time`` when backward finished. Leaves whose path is in ``local`` (a row-sharded
        table's rows: their gradients go to the rows' owners instead) are not reduced: their
        gradients come back local (plus ``prior``)."""
        torch = self._torch

        def wrapped(params, *args, prior=None, **kwargs):
            with torch.enable_grad():
                leaves = tree_map(lambda p: p.detach().requires_grad_(p.is_floating_point()), params)
                every = [(path, leaf) for path, leaf in tree_items(leaves) if leaf.requires_grad]
                pairs = [(path, leaf) for path, leaf in every if path not in local]
                kept = [(path, leaf) for path, leaf in every if path in local]
                prior_map = dict(tree_items(prior)) if prior is not None else None
                reducer = _Reducer(self, [p for p, _ in pairs], [leaf for _, leaf in pairs], prior_map)
                handles = [leaf.register_hook(reducer.hook(i)) for i, (_, leaf) in enumerate(pairs)]
                try:
                    delay = self._slow_steps.pop(self.step, 0.0)
                    if delay:
                        time.sleep(delay)  # test-only GRF_FAULT_SLOW_STEP: a slow but healthy step
                    out = f(leaves, *args, **kwargs)
                    loss, aux = out if has_aux else (out, None)
                    all_grads = torch.autograd.grad(loss, [leaf for _, leaf in pairs + kept], allow_unused=True)
                    grads, kept_grads = all_grads[:len(pairs)], all_grads[len(pairs):]
                finally:
                    for h in handles:
                        h.remove()
            self.last_backward_end = time.perf_counter()
            self.last_backward_cpu = time.thread_time()
            reduced = reducer.finish(list(grads))
            if self._ready_order is None:
                self._ready_order = reducer.ready_order()
            by_path = dict(zip([p for p, _ in pairs], reduced))
            for (path, leaf), g in zip(kept, kept_grads):
                g = torch.zeros_like(leaf) if g is None else g.detach()
                by_path[path] = g + prior_map[path] if prior_map is not None and path in prior_map else g
            grad_tree = tree_map_with_path(lambda path, leaf: by_path.get(path, torch.zeros_like(leaf)), leaves)
            detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
            value = (loss.detach(), tree_map(detach, aux)) if has_aux else loss.detach()
            return value, grad_tree

        return wrapped

    # ------------------------------------------------------------------ watchdog-facing
    def progress(self, phase: str) -> None:
        # phases describe the main thread (the training loop); a worker's collectives (the
        # prefetch and sparse workers' lanes, a background exchange it waits for) leave them alone
        if threading.current_thread() is threading.main_thread():
            self._watchdog.progress(phase)

    @property
    def concurrent_groups(self) -> bool:
        """Whether collectives of several process groups may run from several threads in an
        order that differs between ranks (the pipelined step's workers). gloo: yes, verified
        here. NCCL / HCCL document that concurrent communicators can deadlock unless every rank
        issues them in the same order, and the workers have not run on a GPU or NPU: no."""
        return self.backend == "gloo"

    def post(self, tag: str) -> None:
        """Say ``tag`` is done (an epoch's evaluation, the files); the next step warms up again."""
        self._watchdog.start_warmup()
        store, since = self._watchdog.main_store, None
        while True:
            try:
                store.set(f"posted/{tag}", "1")
                return
            except Exception as exc:  # noqa: BLE001 - a slow store on a loaded machine: retry a while
                since = since or time.monotonic()
                if time.monotonic() - since > self.limits.store_down_after:
                    self._collective_failed(f"posting {tag}", exc)
                time.sleep(0.1)

    def wait_for(self, tag: str) -> None:
        """Block until some rank ``post``-ed ``tag`` (store polling; the watchdog ends this
        process if the poster dies or hangs meanwhile). The next step warms up again."""
        self._watchdog.start_warmup()
        self.progress(f"wait:{tag}")
        store, key = self._watchdog.main_store, f"posted/{tag}"
        delay, since = 0.01, None
        while True:
            try:
                if store.check([key]):
                    break
                since = None
            except Exception as exc:  # noqa: BLE001 - one slow reply is not a lost store
                since = since or time.monotonic()
                if time.monotonic() - since > self.limits.store_down_after:
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
            self._run("final barrier", lambda: self._dist.barrier())
        finally:
            self._dist.destroy_process_group()


class Lane:
    """``TorchCollective.lane()``: the exchanges of one background thread on their own group."""

    def __init__(self, comm: TorchCollective, group):
        self.comm, self.group = comm, group
        self.rank, self.world_size = comm.rank, comm.world_size

    def exchange_counts(self, send_counts) -> np.ndarray:
        return self.comm._exchange_counts(send_counts, self.group, self.comm._quiet)

    def all_to_all(self, x, send_counts, recv_counts):
        return self.comm._all_to_all(x, send_counts, recv_counts, self.group, run=self.comm._quiet)()


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
    """Heartbeat writer and failure detector (module docstring). Daemon thread, independent of the
    training step: it keeps beating while the main thread computes, compiles or waits."""

    def __init__(self, comm: TorchCollective):
        super().__init__(name=f"grf-watchdog-rank{comm.rank}", daemon=True)
        import torch.distributed as dist

        self.comm, self.limits = comm, comm.limits
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
        self.seen_step = {r: ("0", "setup") for r in range(self.world)}
        self.own_prog_time = now
        self.last_round = now          # the last completed heartbeat round trip with the store
        self.store_error = "no reply"  # why the last round failed, for the message
        # step timing (under self._lock): steps begun since the last warm-up start, when the
        # current one began, the slowest step judged by hang_after so far
        self._steps_since_warmup = 0
        self._step_start = now
        self.slowest_step = 0.0
        self._publish()

    def progress(self, phase: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._progress += 1
            self._phase = phase
            self.own_prog_time = now
            if phase in WARMUP_PHASES:
                self._steps_since_warmup = 0
            elif phase == "step":
                self._steps_since_warmup += 1
                if self._steps_since_warmup >= 3:  # the step that just ended was past warm-up: measure it
                    self.slowest_step = max(self.slowest_step, now - self._step_start)
                self._step_start = now

    def start_warmup(self) -> None:
        """The next step is a first step again (after evaluation, an epoch end): judged only by
        ``warmup_after`` until the step after it begins."""
        with self._lock:
            self._steps_since_warmup = 0

    def own_limit(self) -> tuple[float, str]:
        """This rank's current no-progress limit and the rule that gave it (for the message)."""
        lim = self.limits
        with self._lock:
            warm, slowest = self._steps_since_warmup < 2, self.slowest_step
        if warm:
            return lim.warmup_after, (f"warm-up limit {WARMUP_FACTOR:g} x dist.timeout_s={lim.timeout_s:g}: the "
                                      f"first step after start, resume, checkpoint or evaluation")
        return lim.hang_after(slowest), (f"limit max(dist.timeout_s={lim.timeout_s:g}, {HANG_FACTOR:g} x slowest "
                                         f"step so far {slowest:.2f} s)")

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
        """A peer whose heartbeat has not changed for > ``stale_after``, waiting up to ``wait_s``
        for one to appear (called after a collective failed): ``(rank, seconds)`` or None."""
        deadline = time.monotonic() + wait_s
        while True:
            if not self.is_alive():  # stopped (shutdown): seen_beat no longer advances, blame nobody
                return None
            now = time.monotonic()
            stale = [(r, now - t) for r, (_, t) in self.seen_beat.items()
                     if r != self.rank and now - t > self.limits.stale_after]
            if stale:
                return max(stale, key=lambda x: x[1])
            if now >= deadline:
                return None
            time.sleep(0.05)

    def _die(self, message: str) -> None:
        text = f"grf: error: rank {self.rank}: {message}"
        try:
            print(text, file=sys.stderr, flush=True)
        finally:
            # publish the failure, but never wait on a store that may be the thing that is gone
            # (a stopped store host leaves some store calls blocked whatever their timeout)
            publish = threading.Thread(target=self.comm.fail, args=(message,), daemon=True)
            publish.start()
            publish.join(timeout=2 * self.limits.interval + 1)
            record_exit(EXIT_DIST_FAILURE)
            os._exit(EXIT_DIST_FAILURE)

    def _watch_store(self) -> None:
        """Second thread: the store is lost when no heartbeat round completed for
        ``store_down_after``, whether its calls fail (host dead) or block (host stopped)."""
        lim = self.limits
        while not self._halt.wait(lim.interval):
            silent = time.monotonic() - self.last_round
            if silent > lim.store_down_after:
                self._die(f"lost the rendezvous store at {self.addr}:{self.port}: no reply for {silent:.1f} s "
                          f"({self.store_error}; limit max(3 heartbeat periods, {FLOOR_S:g} s)); it lives in rank 0 "
                          f"(or the torchrun agent on its host), which has probably died or is stopped")

    def run(self) -> None:
        keys = [f"hb/{r}" for r in range(self.world)]
        lim = self.limits
        self.last_round = time.monotonic()  # the barrier since __init__ may have been slow: not a silence
        threading.Thread(target=self._watch_store, name=f"grf-store-watch-rank{self.rank}", daemon=True).start()
        while not self._halt.wait(lim.interval):
            try:
                self._publish()
                values = self.store.multi_get(keys)
                failures = int(self.store.add("failures", 0))
                failure = self.store.get("failure").decode() if failures else ""
            except Exception as exc:  # noqa: BLE001 - judged by _watch_store: one slow reply is not a loss
                if self._halt.is_set():
                    return
                self.store_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                continue
            now = time.monotonic()  # judged on this rank's clock only
            self.last_round = now
            if failure:
                who, _, msg = failure.partition("\t")
                if who != str(self.rank):
                    self._die(f"stopping because rank {who} failed: {msg}")
            for r, raw in enumerate(values):
                beat, _prog, step, phase = raw.decode().split("\t", 3)
                if beat != self.seen_beat[r][0]:
                    self.seen_beat[r] = (beat, now)
                self.seen_step[r] = (step, phase)
            # hung: judged by the rank itself (its phase and step times, its clock); the peers
            # hear of it through the failure key within one heartbeat
            with self._lock:
                own_idle, own_phase = now - self.own_prog_time, self._phase
            if not own_phase.startswith("wait"):
                limit, rule = self.own_limit()
                if own_idle > limit:
                    self._die(f"this rank hung: no progress for {own_idle:.1f} s in phase {own_phase!r} at step "
                              f"{self.comm.step} ({rule} = {limit:.1f} s); the other ranks are stopping too")
            for r in range(self.world):
                if r == self.rank:
                    continue
                silent = now - self.seen_beat[r][1]
                if silent > lim.dead_after:
                    step, phase = self.seen_step[r]
                    self._die(f"rank {r} died or is stopped: no heartbeat for {silent:.1f} s (last seen at step "
                              f"{step}, phase {phase!r}; limit max(dist.timeout_s={lim.timeout_s:g}, {FLOOR_S:g} s))")


# ----------------------------------------------------------------------------- test hook, launcher
def _slow_steps(rank: int) -> dict[int, float]:
    """Test-only ``GRF_FAULT_SLOW_STEP="STEP:SECONDS,..."`` (limited to rank ``GRF_FAULT_RANK`` when
    set): step -> seconds the main thread sleeps at the start of that step's forward pass."""
    spec = os.environ.get(SLOW_STEP_ENV, "")
    only = os.environ.get("GRF_FAULT_RANK")
    if not spec or (only is not None and only != str(rank)):
        return {}
    try:
        return {int(step): float(sec) for step, _, sec in (item.partition(":") for item in spec.split(","))}
    except ValueError:
        raise _error_cls()(f"rank {rank}: {SLOW_STEP_ENV}={spec!r} is not STEP:SECONDS[,STEP:SECONDS...]") from None


def record_exit(value) -> None:
    """Write this rank's exit code (or "started") to ``$GRF_RANK_EXIT_DIR/rank-RANK`` when the
    launcher asked for it; best effort (a missing file reads as "no exit code"). "started" also
    writes the rank's pid (``rank-RANK.pid``: the launcher stops a rank that outlives the job
    with it) and starts ``watch_launcher``."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if not folder:
        return
    path = Path(folder) / f"rank-{os.environ.get('RANK', '0')}"
    try:
        if value == "started":
            _write_atomic(path.with_suffix(".pid"), str(os.getpid()))
        _write_atomic(path, str(value))
    except OSError:
        pass
    if value == "started":
        watch_launcher()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed launcher whose parent has not
    reaped it yet is gone for our purposes)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive (and never ours to judge)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) said it exists


def watch_launcher(poll_s: float = 0.5) -> threading.Thread | None:
    """A rank of ``grf train --nproc N`` stops when its launcher is gone (``kill -9`` of ``grf
    train``, which cannot stop anything itself): a daemon thread polls the launcher's pid
    (``$GRF_LAUNCHER_PID``) and this rank's parent (torchrun: its pid changes when it dies), and
    on either prints one line and ends the rank with exit 4 (``os._exit``: the main thread may be
    inside a collective), removing the launcher's temp folder on rank 0. The run's lock is the
    kernel's (``flock``), dropped with the process, so the same command resumes at once. On Linux
    the launcher also gives torchrun a parent-death signal (SIGTERM), so torchrun stops the ranks
    itself; this watch is what works everywhere, and also when torchrun dies alone."""
    try:
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    except ValueError:
        return None
    if launcher <= 0:
        return None
    parent = os.getppid()
    rank = os.environ.get("RANK", "0")

    def run():
        while True:
            time.sleep(poll_s)
            if pid_alive(launcher) and os.getppid() == parent:
                continue
            orphaned = not pid_alive(launcher)
            who = f"its launcher (grf train --nproc, pid {launcher})" if orphaned else f"torchrun (pid {parent})"
            try:
                print(f"grf: error: rank {rank}: {who} is gone: stopping this rank; rerun the same command to "
                      f"resume from the last checkpoint", file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass
            if orphaned and rank == "0":  # nobody else will remove it (a later launcher would: reap_exit_dirs)
                import shutil

                shutil.rmtree(os.environ.get(EXIT_DIR_ENV, ""), ignore_errors=True)
            else:
                record_exit(EXIT_DIST_FAILURE)
            os._exit(EXIT_DIST_FAILURE)

    thread = threading.Thread(target=run, name="grf-launcher-watch", daemon=True)
    thread.start()
    return thread


def recorded_exits(folder, nproc: int) -> dict[int, str]:
    """rank -> what it recorded ("started" or its exit code, as text); ranks with no file left out."""
    out = {}
    for r in range(nproc):
        try:
            out[r] = (Path(folder) / f"rank-{r}").read_text().strip()
        except OSError:
            continue
    return out


def _rank_pid(folder, rank: int) -> int | None:
    try:
        return int((Path(folder) / f"rank-{rank}.pid").read_text())
    except (OSError, ValueError):
        return None


def a_rank_failed(folder, nproc: int) -> bool:
    """Whether some rank recorded a failing exit code (anything but "started" and 0), or ended
    without one (killed by a signal: "started", and its process is gone)."""
    for r, text in recorded_exits(folder, nproc).items():
        if text == "0":
            continue
        if text != "started":
            return True
        pid = _rank_pid(folder, r)
        if pid is not None and not pid_alive(pid) and recorded_exits(folder, nproc).get(r) == "started":
            return True  # read again: it may have recorded its code and exited in between
    return False


def _is_rank_process(pid: int) -> bool:
    """Whether ``pid`` still runs ``gr_functional.rank`` (where /proc says; else assumed, the pid
    being this job's own and seconds old)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"gr_functional.rank" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def stop_ranks(folder, nproc: int, sig: int | None = None) -> list[int]:
    """Send ``sig`` (default SIGKILL) to every rank of ``folder`` that recorded "started" but no
    exit code and still runs (torchrun starts each in its own process group: the group gets it,
    so what the rank started goes too). Returns the ranks signalled."""
    import signal

    sig = signal.SIGKILL if sig is None else sig
    hit = []
    for r, text in recorded_exits(folder, nproc).items():
        pid = _rank_pid(folder, r)
        if text != "started" or pid is None:
            continue
        if not pid_alive(pid) or not _is_rank_process(pid):
            continue
        try:
            if hasattr(os, "killpg") and os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            hit.append(r)
        except OSError:
            pass
    return hit


def supervise(proc, folder, nproc: int, grace_s: float = STOP_GRACE_S, poll_s: float = 0.2) -> int:
    """Wait for torchrun (``proc``) and return its exit code, ending the job soon after a rank
    failed. Once a rank records a failing exit code, torchrun stops the others with SIGTERM, and
    waits 30 s for those that do not go (a stopped rank: SIGSTOP holds the signal) before it
    kills them. Here, ranks still running ``grace_s`` after the first recorded failure are killed
    (their process groups, SIGKILL); torchrun, which then sees every worker gone, is given
    ``STOP_WAIT_S`` to exit, then SIGTERM, and as long again before SIGKILL."""
    import subprocess

    failed_at = killed_at = None
    terminated = False
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if failed_at is None and a_rank_failed(folder, nproc):
            failed_at = now
        if failed_at is not None and killed_at is None and now - failed_at >= grace_s:
            stop_ranks(folder, nproc)
            killed_at = now
        if killed_at is not None and now - killed_at >= STOP_WAIT_S:
            if not terminated:
                proc.terminate()
                terminated = True
            elif now - killed_at >= 2 * STOP_WAIT_S:
                proc.kill()


def stop_job(proc, folder, nproc: int, sig: int, wait_s: float = STOP_WAIT_S) -> None:
    """The launcher was interrupted (``sig``: SIGINT for Ctrl-C, SIGTERM): pass ``sig`` to torchrun,
    which passes it to the ranks (torchrun runs in its own process group, so it gets it once,
    from here); after ``wait_s``, kill whatever is left (ranks, then torchrun)."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_ranks(folder, nproc)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def make_exit_dir() -> str:
    """The launcher's temp folder ``grf-ranks-*``, with its pid in ``launcher.pid`` (so a later
    launcher can tell it was left by one that died: ``reap_exit_dirs``)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix=EXIT_DIR_PREFIX)
    _write_atomic(Path(folder) / "launcher.pid", str(os.getpid()))
    return folder


def reap_exit_dirs() -> list[str]:
    """Remove the temp folders of launchers that died (``kill -9`` of ``grf train --nproc``): this
    user's ``grf-ranks-*`` whose ``launcher.pid`` names a process that is gone; a rank of theirs
    still running is killed first. Returns the folders removed."""
    import shutil
    import tempfile

    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{EXIT_DIR_PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            pid = int((folder / "launcher.pid").read_text())
        except (OSError, ValueError, AttributeError):
            continue  # not ours, a folder of an older version, or one being made
        if pid_alive(pid):
            continue
        ranks = [int(p.name[5:]) for p in folder.glob("rank-*") if p.name[5:].isdigit()]
        stop_ranks(folder, 1 + max(ranks, default=-1))
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def job_exit_code(launcher_code: int, folder, nproc: int) -> tuple[int, str]:
    """``(exit code, reason)`` of ``grf train --nproc N`` from torchrun's exit code and what the
    ranks recorded in ``folder``. 0 when torchrun succeeded. Else, first match: a rank's user error
    2; a NaN abort 3; any other code a rank returned except 4, the lowest (1: an unexpected error,
    5: a failed write; the rank that had it is the root cause, its peers only exit 4); 4 when
    the failures are only ranks that exited 4 (a peer died or hung) or ended without an exit
    code (killed by a signal, or stopped by torchrun or the launcher after another rank failed);
    torchrun's own code when no rank started, or every rank exited 0."""
    if launcher_code == 0:
        return 0, "every rank exited 0"
    recorded: dict[int, int | None] = {}
    for r in range(nproc):
        try:
            text = (Path(folder) / f"rank-{r}").read_text().strip()
        except OSError:
            continue
        recorded[r] = int(text) if text.lstrip("-").isdigit() else None
    if not recorded:
        return launcher_code, "no rank started: torchrun failed before starting them"
    parts = [f"rank {r} " + (f"exited {recorded[r]}" if recorded.get(r) is not None else
                             "never started" if r not in recorded else
                             "ended without an exit code (killed by a signal, or stopped by torchrun or the "
                             "launcher after another rank failed)") for r in range(nproc)]
    why = "; ".join(parts)
    codes = set(recorded.values())
    for wanted in (2, 3):
        if wanted in codes:
            return wanted, why
    other = sorted(c for c in codes if c not in (None, 0, EXIT_DIST_FAILURE))
    if other:
        return other[0], why
    if EXIT_DIST_FAILURE in codes or None in codes or len(recorded) < nproc:
        return EXIT_DIST_FAILURE, why
    return launcher_code, why + "; torchrun itself failed"

