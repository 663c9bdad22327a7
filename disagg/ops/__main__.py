"""`python -m disagg.ops [-v]`: build the csrc kernels for the running torch (see disagg/ops/build.py)."""

import sys

from disagg.ops.build import main

sys.exit(main(sys.argv[1:]))
