"""Kernels of the forward pass: the csrc/ extension where it is built, pure torch everywhere else.

The only loader of csrc/ (DESIGN.md section 2). Every op here has a pure-torch twin in
`disagg.ops.reference`, and tests/unit/test_ops.py checks the two agree.
"""
