"""Benchmarks: importable functions (each with a smoke test in tests/) and a `python -m` entry point each."""
