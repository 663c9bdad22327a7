"""Fault tests: real processes killed, stopped and flooded. They reuse the e2e cluster helpers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
