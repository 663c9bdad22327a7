"""Generate disagg/wire/*_pb2*.py from proto/*.proto with the locally installed grpcio-tools.

    python scripts/gen_proto.py            # rewrite the committed files in disagg/wire/
    python scripts/gen_proto.py --check    # exit 1 if they differ from a fresh generation
    python scripts/gen_proto.py --out DIR  # write somewhere else

No network: protoc ships inside grpcio-tools. The output depends on the grpcio-tools version, which
is written into every generated file's first comment so a check can tell drift from edits.
Generated modules import each other as `disagg.wire.<name>_pb2`, not as top-level modules.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
WIRE_DIR = ROOT / "disagg" / "wire"
PACKAGE = "disagg.wire"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(r"^import (\w+_pb2) as ", re.MULTILINE)


def tools_version() -> str:
    """The installed grpcio-tools version, e.g. '1.85.1'."""
    return importlib.metadata.version("grpcio-tools")


def header() -> str:
    """First comment line of every generated file."""
    return f"# Generated from proto/ by scripts/gen_proto.py with grpcio-tools {tools_version()}. Do not edit.\n"


def _postprocess(text: str) -> str:
    text = _IMPORT.sub(rf"from {PACKAGE} import \1 as ", text)
    lines = text.splitlines(keepends=True)
    # A coding cookie must stay on the first line.
    at = 1 if lines and lines[0].startswith("# -*- coding") else 0
    return "".join(lines[:at] + [header()] + lines[at:])


def _run_protoc(proto: pathlib.Path, out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Generate every proto/*.proto into `out_dir`; returns the written files, sorted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp)
        for proto in sorted(PROTO_DIR.glob("*.proto")):
            _run_protoc(proto, raw)
        for path in sorted(raw.iterdir()):
            if path.name.endswith(SUFFIXES):
                target = out_dir / path.name
                target.write_text(_postprocess(path.read_text()))
                written.append(target)
    return written


def differences(generated_dir: pathlib.Path, committed_dir: pathlib.Path = WIRE_DIR) -> list[str]:
    """Names of generated files that are missing from, or differ byte for byte with, committed_dir."""
    bad = []
    for path in sorted(generated_dir.iterdir()):
        committed = committed_dir / path.name
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            bad.append(path.name)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=WIRE_DIR, help="output folder")
    parser.add_argument("--check", action="store_true", help="compare with the committed files only")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(args.out):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        bad = differences(pathlib.Path(tmp))
    for name in bad:
        print(f"stale: disagg/wire/{name} (run python scripts/gen_proto.py)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
