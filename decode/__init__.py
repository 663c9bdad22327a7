"""Decode role: block reservation, prefill-rank resolution, KV receiver."""
