"""Compile csrc/cpu into the `disagg_ops` library: `python -m disagg.ops` (run by `make install`).

The system compiler builds it through torch's cpp_extension (ninja, incremental: a second run with
unchanged sources only loads it). One build serves every x86 CPU: ops.cpp picks the AVX-512, AVX2
or baseline kernels at load time. The library sits under build/ops/torch-<version>, because it
links against that exact torch.
"""

from __future__ import annotations

import pathlib

import torch

LIBRARY_NAME = "disagg_ops"
ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "csrc" / "cpu"
SOURCES = ("ops.cpp", "kernels_base.cpp", "kernels_avx2.cpp", "kernels_avx512.cpp")
# -ffp-contract=off: no fused multiply-add unless a kernel asks for one (the torch twins round each op).
# Never -ffast-math: the kernels treat NaN and infinities as values (kernels.h refuses to build without them).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")


def library_path() -> pathlib.Path:
    """Where the built library is (or would be) for the running torch."""
    return ROOT / "build" / "ops" / f"torch-{torch.__version__}" / f"{LIBRARY_NAME}.so"


def build(verbose: bool = False) -> pathlib.Path:
    """Compile (or bring up to date) and load the library; returns its path. Raises when it cannot."""
    from torch.utils import cpp_extension

    missing = [name for name in SOURCES if not (SOURCE_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"csrc sources not found in {SOURCE_DIR}: {', '.join(missing)}")
    out = library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=LIBRARY_NAME, sources=[str(SOURCE_DIR / name) for name in SOURCES], build_directory=str(out.parent),
        extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose,
    )
    return out


def main(argv: list[str]) -> int:
    path = build(verbose="-v" in argv)
    print(f"disagg_ops: {path} (kernels for this CPU: {torch.ops.disagg.isa()})")
    return 0
