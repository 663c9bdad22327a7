"""Benchmarks: engine, KV transfer and serving."""
