"""Several id features, merged into as few physical tables as their widths allow.

A model with several sparse features (item, author, music, action type, ...) would look each up
in its own table: one gather per feature per step. Features of the same width and table kind can
share ONE physical table instead, with their id spaces kept apart, so a step does one lookup per
merged group (MTGRBoost's table merging). ``plan_tables`` groups the features automatically:

  dense features  ids 1..num_ids of feature f live in rows ``offset_f + 1 .. offset_f + num_ids``
                  of the group's table (row 0 is the shared padding row, id 0 of every feature)
  hash features   one ``HashTable`` of the summed capacities; feature f's id x is the key
                  ``splitmix64(x ^ salt_f)``, a bijection per feature, so two features' ids
                  collide only by a 64-bit hash collision (probability ~ n^2 / 2^65)

``EmbeddingCollection.plan`` turns a step's ``{feature: ids}`` into one deduplicated ``Lookup``
per group plus, per feature, the local indices into that group's rows; ``group_rows`` does one
``gather_rows`` per group and ``feature_rows`` hands each feature its ``[..., D]`` rows. The gradient of a merged
row is the sum over the features and positions that used it, as with separate tables
(tests/differential/test_collection.py proves outputs and gradients equal).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from .hashtable import HashTable, hashed_init, mix64
from .lookup import local_indexer, looked_up_rows, padded_lookup, unique_ids
from ..contracts import Backend


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature: ``dim`` wide; kind "dense" with ids 1..``num_ids``, or "hash" with a
    table of ``capacity`` rows for raw int64 ids."""

    name: str
    dim: int
    kind: Literal["dense", "hash"] = "dense"
    num_ids: int = 0
    capacity: int = 0


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """A physical table: the features it holds, their width and kind, and its rows (with the
    padding row 0). ``offsets``: dense features' row offsets; ``salts``: hash features' salts."""

    name: str
    features: tuple
    dim: int
    kind: str
    rows: int
    offsets: dict
    salts: dict


def plan_tables(features, merge: bool = True) -> list:
    """The physical tables for ``features``: one per (width, kind) when ``merge``, else one per
    feature. Deterministic: groups and their members keep the features' order."""
    groups: dict = {}
    for i, f in enumerate(features):
        key = (f.dim, f.kind) if merge else (f.name,)
        groups.setdefault(key, []).append((i, f))
    out = []
    for members in groups.values():
        first = members[0][1]
        offsets, salts, rows = {}, {}, 1
        for i, f in members:
            if f.kind == "dense":
                offsets[f.name] = rows - 1
                rows += f.num_ids
            else:
                salts[f.name] = int(mix64(np.asarray([i + 1], np.uint64))[0])
                rows += f.capacity
        name = "+".join(f.name for _, f in members)
        out.append(TableGroup(name, tuple(f.name for _, f in members), first.dim, first.kind, rows, offsets, salts))
    return out


class EmbeddingCollection:
    """The host side of a set of features in merged tables: per step, one ``Lookup`` per group
    and every feature's ids as local indices (``plan``). Hash groups insert and evict as
    ``HashTable`` does; new rows start at ``hashed_init(seed, key)``."""

    def __init__(self, features, *, merge: bool = True, seed: int = 0, policy: str = "lru"):
        self.features = {f.name: f for f in features}
        self.groups = plan_tables(list(features), merge)
        self.group_of = {name: g for g in self.groups for name in g.features}
        self.seed = seed
        self.tables = {g.name: HashTable(g.rows - 1, policy=policy, seed=seed) for g in self.groups if g.kind == "hash"}
        self.group_names = {name: g.name for name, g in self.group_of.items()}

    @property
    def lookups_per_step(self) -> tuple[int, int]:
        """``(before, after)``: gathers per step with one table per feature and with merging."""
        return len(self.features), len(self.groups)

    def keys(self, feature: str, ids) -> np.ndarray:
        """The group-level key of each id of ``feature`` (0 stays 0: padding)."""
        g = self.group_of[feature]
        ids = np.asarray(ids, dtype=np.int64)
        if g.kind == "dense":
            f = self.features[feature]
            if ids.size and (ids.min() < 0 or ids.max() > f.num_ids):
                raise ValueError(f"feature {feature!r}: ids outside 0..{f.num_ids}")
            return np.where(ids == 0, 0, ids + g.offsets[feature])
        keyed = mix64(ids.view(np.uint64) ^ np.uint64(g.salts[feature])).view(np.int64)
        return np.where(ids == 0, 0, np.where(keyed == 0, 1, keyed))  # key 0 is reserved for padding

    def plan(self, ids: dict, step: int) -> tuple[dict, dict]:
        """``(lookups, local)``: per group name a ``Lookup`` (rows of its distinct keys, slot 0 =
        padding), per feature its ids as int32 indices into its group's slots."""
        keys = {name: self.keys(name, x) for name, x in ids.items()}
        lookups, local = {}, {}
        for g in self.groups:
            mine = [n for n in g.features if n in keys]
            if not mine:
                continue
            uniq, _ = unique_ids([keys[n] for n in mine])
            if g.kind == "dense":
                lookups[g.name] = padded_lookup(uniq.astype(np.int32), np.zeros(len(uniq), bool),
                                                np.zeros((0, g.dim)), g.dim)
            else:
                got = self.tables[g.name].assign(uniq, step)
                lookups[g.name] = padded_lookup(got.rows, got.fresh, hashed_init(self.seed, uniq[got.fresh], g.dim),
                                                g.dim)
            index = local_indexer(uniq)
            for name in mine:
                local[name] = index(keys[name])
        return lookups, local


def group_rows(B: Backend, tables: dict, lookups: dict) -> dict:
    """Per group, the step's rows ``[S, D]``: ONE ``gather_rows`` of its table (fresh rows at
    their initial value). This is what a step differentiates and a row-sparse optimizer updates
    (as ``step.local_params`` does for the item table). ``tables``: group name -> ``[rows, D]``."""
    return {name: looked_up_rows(B, tables[name], lk) for name, lk in lookups.items()}


def feature_rows(B: Backend, rows: dict, local: dict, group_of: dict) -> dict:
    """``{feature: [..., D]}``: each feature's rows from its group's step rows by its local
    indices (``group_of``: feature -> group name, ``EmbeddingCollection.group_names``). The
    gradient of a group row sums every feature and position that used it."""
    return {feature: B.gather_rows(rows[group_of[feature]], idx) for feature, idx in local.items()}
