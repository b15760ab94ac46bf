"""Benchmarks behind ``grf bench NAME [--json]``: speed, memory, MFU and imbalance scripts (not tests).

Each module exposes ``run(json_lines: bool) -> list[dict]``; with ``json_lines`` it prints one JSON
object per line (with ratio fields), otherwise a human-readable table.
"""
