"""Data parallelism: engine worker processes behind one server, dispatch and utility fan-out."""
