"""Build step: compile proto/**/*.proto into services/common/gen with grpcio-tools."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = pathlib.Path(__file__).resolve().parent / "gen"


def generate() -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for module in OUT_DIR.rglob("*_pb2.py"):
        package = module.parent
        while package != OUT_DIR:  # each level of openmanus/<service>/v1 becomes a package
            (package / "__init__.py").touch()
            package = package.parent
    return protos


if __name__ == "__main__":
    built = generate()
    print(f"generated {len(built)} proto files into {OUT_DIR.relative_to(ROOT)}", file=sys.stderr)
