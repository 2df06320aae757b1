"""Re-zip a wheel with LZMA so that more wheels fit the GPU machine's 64 MiB transfer.

The CuTe DSL 4.3.5 wheel is 58.6 MB deflated (its MLIR library alone 57 MB); LZMA takes it to 42 MB,
which leaves room for humming-kernels and apache-tvm-ffi beside the working tree. The files and the
RECORD hashes (of the unpacked bytes) are unchanged; pip reads LZMA members through zipfile.

    python scripts/repack_wheel.py .whl/nvidia_cutlass_dsl-4.3.5-*.whl   # in place
"""
from __future__ import annotations

import argparse
import os
import zipfile


def repack(path: str) -> tuple[int, int]:
    """Rewrite `path` with every member LZMA-compressed; returns (bytes before, bytes after)."""
    before, tmp = os.path.getsize(path), path + ".lzma-tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_LZMA)
    os.replace(tmp, path)
    return before, os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="+")
    for path in ap.parse_args().wheels:
        before, after = repack(path)
        print(f"{path}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
