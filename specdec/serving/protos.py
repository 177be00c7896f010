"""Generates the Python gRPC code in specdec/v1 from protos/.

The generated files are committed; `python -m specdec.serving.protos` regenerates them, and a test
checks that the committed copy is current.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("specdec/v1/*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(args[1:]))
    (out_dir / "specdec" / "v1" / "__init__.py").touch()


if __name__ == "__main__":
    generate(REPO_ROOT)
    sys.exit(0)
