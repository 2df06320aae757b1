"""patterns/ and kernels/ install as k3fuse.patterns and k3fuse.kernels, editable and normal alike."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["k3fuse.model", "k3fuse.tools", "k3fuse.tools.bench", "k3fuse.patterns", "k3fuse.kernels",
               "k3fuse.kernels.ops", "k3fuse.kernels.lib", "k3fuse.kernels.lib.reference", "k3fuse.kernels.lib.cute",
               "k3fuse.kernels.lib.triton"]


def test_every_kernels_and_patterns_folder_is_a_listed_package():
    """A new subpackage under kernels/ or patterns/ must be in pyproject's package list (else the
    wheel silently lacks it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for src, pkg in (("kernels", "k3fuse.kernels"), ("patterns", "k3fuse.patterns")):
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src).parts
            assert ".".join([pkg, *rel]) in listed, f"{init.parent} is not in pyproject's packages"


def test_editable_install_maps_top_level_folders():
    import k3fuse.kernels
    import k3fuse.patterns

    assert Path(k3fuse.kernels.__file__) == ROOT / "kernels" / "__init__.py"
    assert Path(k3fuse.patterns.__file__) == ROOT / "patterns" / "__init__.py"


def test_normal_install_from_the_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    (wheel,) = (tmp_path / "dist").glob("k3fuse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ["k3fuse", *SUBPACKAGES]:
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert not any(n.startswith(("kernels/", "patterns/")) for n in names)  # no stray top-level `kernels`
    assert not any(n.endswith("front_model.py") for n in names)  # one benchmark's model stays in bench/
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[torch_dynamo_backends]" in text and "k3fuse = k3fuse.backend:k3fuse_backend" in text
    assert "k3fuse = k3fuse_cli:main" in text and "k3fuse_cli.py" in names  # the command's entry, beside the package

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib, k3fuse; "
            f"mods = [importlib.import_module(m) for m in {SUBPACKAGES!r}]; "
            "assert all(m.__file__.startswith(sys.argv[1]) for m in [k3fuse, *mods]), [m.__file__ for m in mods]; "
            "import torch; assert hasattr(torch.ops.k3fuse, 'gemm_ar_residual'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
