"""Where should the hash table's id -> row map run: in the numpy data pipeline (host) or as a
backend op? The same algorithm, timed both ways on this CPU.

``python3 benchmarks/embedding_map.py [--json] [--quick]``

- ``get`` / ``put``: ids/s of ``IdMap.get`` (all ids present) and ``IdMap.put`` (all ids new) for
  batches of 10k, 100k and 1M distinct random int64 ids against a map holding 1M or 4M keys, as
  numpy (``gr_functional.embedding.hashtable.IdMap``, what the pipeline runs) and as torch tensor
  ops (``TorchIdMap`` below: the same splitmix64 hash, linear probing and first-claimant-wins
  rounds; what a device-side op would run, here on the CPU with ``torch.set_num_threads(2)``,
  and again with 1 thread, like numpy: "torch_1thread").
  A map holding K keys has the next power of two >= 2 (K + 1M) slots (load 0.24, so the largest
  put stays under the 3/4 limit without a rebuild); every put starts from the same K-key map.
  Both implementations end in bitwise the same slot arrays (checked).
- ``dedup``: ``np.unique(return_inverse=True)`` vs ``torch.unique(return_inverse=True)`` on
  3.3M int32 ids drawn from 3,706 values (an ML-1M-sized step's item references) and on 1M int64
  ids drawn Zipf-like (a = 1.2) from 2^60.

Each figure is the best of a few repeats (the machine is shared). With ``--json`` one object per
line: ``op``, ``impl`` ("numpy" | "torch" | "torch_1thread"), ``batch`` (ids per call), ``table`` (keys in the map;
for dedup the number of values drawn from), ``ids_per_s``. Takes about a minute.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gr_functional.embedding.hashtable import IdMap, mix64

_FULL = 1
_UNCLAIMED = np.iinfo(np.int32).max
# splitmix64's multipliers as int64 (two's complement): torch has no usable uint64 arithmetic
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
# torch as asked (2 threads) and single-threaded like numpy: on a machine whose cores are busy
# with other work, torch's parallel regions wait for descheduled threads (tens of ms per op seen
# here), so the 1-thread figure is the like-for-like algorithm comparison
TORCH_IMPLS = (("torch", 2), ("torch_1thread", 1))


# ----------------------------------------------------------------------------- torch twin
def _srl(x, k: int):
    """Logical right shift of int64 tensors (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def torch_mix64(x):
    """``mix64`` on int64 tensors: int64 multiplication wraps like uint64's."""
    x = x ^ _srl(x, 30)
    x = x * _M1
    x = x ^ _srl(x, 27)
    x = x * _M2
    return x ^ _srl(x, 31)


class TorchIdMap:
    """``IdMap``'s get/put as torch tensor ops over the same arrays (no rebuild: not needed here)."""

    def __init__(self, torch, m: IdMap):
        self.torch = torch
        self.keys = torch.from_numpy(m.keys.copy())
        self.values = torch.from_numpy(m.values.copy())
        self.state = torch.from_numpy(m.slot_state.copy())
        self.claim = torch.full((len(m.keys),), _UNCLAIMED, dtype=torch.int32)
        self.mask = len(m.keys) - 1

    def get(self, q):
        torch = self.torch
        pos = torch_mix64(q) & self.mask
        out = torch.full((q.numel(),), -1, dtype=torch.int32)
        active = torch.arange(q.numel())
        while active.numel():
            p = pos[active]
            state = self.state[p]
            found = (state == _FULL) & (self.keys[p] == q[active])
            out[active[found]] = self.values[p[found]]
            go_on = ~found & (state != 0)
            active = active[go_on]
            pos[active] = (p[go_on] + 1) & self.mask
        return out

    def put(self, keys, values) -> None:
        torch = self.torch
        pos = torch_mix64(keys) & self.mask
        pending = torch.arange(keys.numel(), dtype=torch.int32)
        while pending.numel():
            p = pos[pending]
            free = self.state[p] != _FULL
            fp, fi = p[free], pending[free]
            self.claim.scatter_reduce_(0, fp, fi, reduce="amin")  # first claimant in input order
            won = self.claim[fp] == fi
            self.claim[fp] = _UNCLAIMED
            slots, winners = fp[won], fi[won].long()
            self.keys[slots] = keys[winners]
            self.values[slots] = values[winners]
            self.state[slots] = _FULL
            moves = ~free
            moves[free.nonzero().squeeze(1)[~won]] = True
            pending = pending[moves]
            pos[pending.long()] = (p[moves] + 1) & self.mask


# ----------------------------------------------------------------------------- timing
def _best(fn, repeats: int, setup=None) -> float:
    best = float("inf")
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _random_ids(rng, n: int) -> np.ndarray:
    return rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)


def bench_map(torch, table: int, batches, repeats: int, emit) -> None:
    rng = np.random.default_rng(table)
    keys = np.unique(_random_ids(rng, table + 1000))[:table]
    keys = keys[rng.permutation(len(keys))]
    m = IdMap(1 << (2 * (table + max(batches)) - 1).bit_length())
    m.put(keys, np.arange(table, dtype=np.int32))
    saved = {k: v.copy() for k, v in m.state_dict().items()}
    tm = TorchIdMap(torch, m)
    t_saved = (tm.keys.clone(), tm.values.clone(), tm.state.clone())

    def restore_numpy():
        np.copyto(m.keys, saved["keys"])
        np.copyto(m.values, saved["values"])
        np.copyto(m.slot_state, saved["slot_state"])
        m.live, m.tombs = (int(x) for x in saved["counts"])

    def restore_torch():
        for dst, src in zip((tm.keys, tm.values, tm.state), t_saved):
            dst.copy_(src)

    for n in batches:
        query = keys[:n].copy()
        q_t = torch.from_numpy(query)
        if not np.array_equal(tm.get(q_t).numpy(), m.get(query)):
            raise AssertionError("the torch map's get disagrees with IdMap")
        emit("get", "numpy", n, table, n / _best(lambda: m.get(query), repeats))
        for impl, threads in TORCH_IMPLS:
            torch.set_num_threads(threads)
            emit("get", impl, n, table, n / _best(lambda: tm.get(q_t), repeats))

        new = _random_ids(rng, n)
        new = new[m.get(new) < 0]
        vals = np.arange(len(new), dtype=np.int32)
        new_t, vals_t = torch.from_numpy(new), torch.from_numpy(vals)
        emit("put", "numpy", len(new), table, len(new) / _best(lambda: m.put(new, vals), repeats, restore_numpy))
        for impl, threads in TORCH_IMPLS:
            torch.set_num_threads(threads)
            emit("put", impl, len(new), table, len(new) / _best(lambda: tm.put(new_t, vals_t), repeats, restore_torch))
        if not (np.array_equal(tm.keys.numpy(), m.keys) and np.array_equal(tm.state.numpy(), m.slot_state)
                and np.array_equal(tm.values.numpy(), m.values)):
            raise AssertionError("the torch map's put disagrees with IdMap")
        restore_numpy()
        restore_torch()


def bench_dedup(torch, repeats: int, emit, quick: bool) -> None:
    rng = np.random.default_rng(0)
    scale = 10 if quick else 1
    ml1m = rng.integers(1, 3707, size=3_300_000 // scale).astype(np.int32)
    ranks = np.minimum(rng.zipf(1.2, size=1_000_000 // scale), 1 << 40).astype(np.uint64)
    zipf = (mix64(ranks) >> np.uint64(4)).astype(np.int64)  # popularity ranks scattered over 2^60
    for ids, space in ((ml1m, 3706), (zipf, 1 << 60)):
        ids_t = torch.from_numpy(ids)
        emit("dedup", "numpy", len(ids), space,
             len(ids) / _best(lambda: np.unique(ids, return_inverse=True), repeats))
        for impl, threads in TORCH_IMPLS:
            torch.set_num_threads(threads)
            emit("dedup", impl, len(ids), space,
                 len(ids) / _best(lambda: torch.unique(ids_t, return_inverse=True), repeats))


# ----------------------------------------------------------------------------- report
def _table(records: list) -> str:
    head = (f"{'op':<6} {'batch':>9} {'table':>10} {'numpy ids/s':>13} {'torch ids/s':>13} "
            f"{'torch 1 thr':>13} {'numpy/torch':>12} {'numpy/1 thr':>12}")
    lines = [head, "-" * len(head)]
    pairs: dict = {}
    for r in records:
        pairs.setdefault((r["op"], r["batch"], r["table"]), {})[r["impl"]] = r["ids_per_s"]
    for (op, batch, table), v in pairs.items():
        shown = "2^60" if table == 1 << 60 else f"{table:,}"
        lines.append(f"{op:<6} {batch:>9,} {shown:>10} {v['numpy']:>13.3g} {v['torch']:>13.3g} "
                     f"{v['torch_1thread']:>13.3g} {v['numpy'] / v['torch']:>12.2f} "
                     f"{v['numpy'] / v['torch_1thread']:>12.2f}")
    return "\n".join(lines)


def run(json_lines: bool = False, quick: bool = False) -> list:
    """Every measurement; ``quick`` shrinks the sizes (a smoke test). Returns the records."""
    import torch

    torch.set_num_threads(2)
    records = []

    def emit(op, impl, batch, table, ids_per_s):
        rec = {"op": op, "impl": impl, "batch": int(batch), "table": int(table), "ids_per_s": float(ids_per_s)}
        records.append(rec)
        if json_lines:
            print(json.dumps(rec), flush=True)

    if quick:
        bench_map(torch, 20_000, (1_000, 10_000), 2, emit)
    else:
        for table in (1_000_000, 4_000_000):
            bench_map(torch, table, (10_000, 100_000, 1_000_000), 3, emit)
    bench_dedup(torch, 2 if quick else 3, emit, quick)
    if not json_lines:
        print("id map and dedup, ids/s (best of repeats; numpy single-threaded; torch CPU with 2 threads "
              "and with 1)")
        print(_table(records))
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args(argv)
    run(json_lines=args.json, quick=args.quick)


if __name__ == "__main__":
    main()
