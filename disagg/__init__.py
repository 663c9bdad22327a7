"""disagg: a prefill/decode disaggregated LLM serving cluster.

Kept light on purpose: importing `disagg` (or `disagg.router`) must not import torch.
"""

__version__ = "0.1.0"
