"""Prefill role: engine + KV sender + bootstrap registration."""
