"""The shipped datasets, one module each; every module registers its datasets on import
(``gr_functional.data.registry`` imports them all):

  synthetic     "synthetic": generated KuaiRand-like sequences, no file (the quickstart's)
  movielens     "ml-1m", "ml-20m": MovieLens ratings, downloadable with ``grf data fetch``
  kuairand      "kuairand": the official KuaiRand log schema (211-row sample by default)
  interactions  "csv": your own CSV/TSV file of (user, item, time) rows, keys ``data.csv_*``
"""
