"""`python -m disagg.ops [-v]`: build the csrc kernels for the running torch (see disagg/ops/build.py).
`python -m disagg.ops cpu [lesser]`: what this CPU runs, or the settings of the level below it (disagg/ops/cpu.py)."""

import sys

from disagg.ops import build, cpu

sys.exit(cpu.main(sys.argv[2:]) if sys.argv[1:2] == ["cpu"] else build.main(sys.argv[1:]))
