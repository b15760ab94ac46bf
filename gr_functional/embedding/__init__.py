"""The sparse side: embedding tables whose rows are looked up and updated per step.

  hashtable.py  HashTable: raw int64 id -> row of a fixed-capacity table (vectorised open
                addressing in numpy), insertion on first sight, LRU/LFU eviction, admission
                after a minimum count, counters; hashed_init: a row's initial value from (seed, id)
  lookup.py     the per-step lookup plan: dedup of every id a batch names, the rows they map to,
                and the batch rewritten to index the step's unique rows
  rowopt.py     row-sparse optimizers (lazy Adam, row-wise Adagrad) over the looked-up rows
  sharding.py   row-sharded tables: owners, flat / hierarchical all-to-all, 16-bit exchange,
                shard export / re-sharding
  collection.py several id features merged into tables by width (one gather per group)

The sparse train step itself is ``step.local_params`` / ``step.sparse_update`` (replicated
tables) and ``step.make_sharded_dist_step`` (row-sharded ones).

Host work (mapping, dedup) is numpy, like negatives and dropout masks; rows and their optimizer
state live with the backend.
"""
