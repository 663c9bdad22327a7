"""KV cache block transfer: one request-agnostic interface, several backends."""
