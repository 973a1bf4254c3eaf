"""Regenerate the committed stubs from the .proto: `python -m appliance.serve.api.generate [OUT_DIR]`.

protoc names modules after the proto's path (appliance/v1/appliance.proto -> appliance.v1.appliance_pb2),
which is not where the stubs live, so the generated gRPC module's import is rewritten to appliance.serve.api.
Needs grpcio-tools (a dev dependency); the serving path never imports this module.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO / "protos"
PROTO_FILE = "appliance/v1/appliance.proto"
API_DIR = Path(__file__).resolve().parent
STUB_NAMES = ("appliance_pb2.py", "appliance_pb2.pyi", "appliance_pb2_grpc.py")


def generate_stubs(out_dir: Path = API_DIR, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile proto_root/PROTO_FILE into out_dir (pb2, pyi, pb2_grpc) with package-relative imports."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(proto_root / PROTO_FILE)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto_root / PROTO_FILE} (see the messages above)")
        written = []
        src_dir = Path(tmp) / Path(PROTO_FILE).parent
        for name in STUB_NAMES:
            text = (src_dir / name).read_text()
            text = re.sub(r"^from appliance\.v1 import ", "from appliance.serve.api import ", text, flags=re.M)
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else API_DIR
    for path in generate_stubs(out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
