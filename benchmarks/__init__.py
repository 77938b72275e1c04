"""Benchmarks: each module has ``run(...) -> list[dict]`` and prints a table as ``__main__``."""
