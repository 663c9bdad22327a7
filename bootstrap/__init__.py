"""Bootstrap registry: prefill ranks, and which prefill DP rank holds each room."""
