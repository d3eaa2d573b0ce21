"""nanoserve installed from its sdist and wheel, not from the checkout, still has its kernels.

The native kernels are C++ that kernels.py compiles on the machine that runs them, so the sources
must travel in the package (pyproject's package data); without them an installed nanoserve falls
back to the PyTorch path without a word, dequantizing every matrix on every call. The test builds
the sdist (setuptools' PEP 517 hook, as a build frontend calls it), then a wheel from the unpacked
sdist with pip (as `pip install <sdist>` would), installs the wheel into a fresh venv that sees
this environment's torch through a .pth file but not the editable checkout, and runs the kernels
there from outside the repository. The build is named by its sources, torch and the ISA, not by
where nanoserve is installed, so with TORCH_EXTENSIONS_DIR pointed at this process's cache the
installed package loads the build the checkout made: no second minute of compiling.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from nanoserve.kernels import build_location, native, native_status

REPO = Path(__file__).resolve().parents[1]
CSRC = sorted(p.name for p in (REPO / "nanoserve" / "csrc").iterdir() if p.suffix in (".cpp", ".h"))

CHECK = """
import json, sys, torch
import torch.nn.functional as F
import nanoserve
from nanoserve.kernels import build_location, native, native_status
from nanoserve.quant import QuantTensor, dequantize_torch
import nanoserve.models  # a subpackage: the wheel must carry it too

ext = native()
report = {"file": nanoserve.__file__, "status": native_status(), "name": build_location()[0]}
if ext is not None:
    w = QuantTensor.quantize(torch.randn(48, 64), "q4_1").split()
    x = torch.randn(3, 64)
    want = F.linear(x, dequantize_torch(w.gguf_blocks(), "q4_1", w.shape))
    report["linear_diff"] = (w.linear(x) - want).abs().max().item()
print(json.dumps(report))
"""


def run(*cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    return r.stdout


@pytest.mark.slow
@pytest.mark.skipif(native() is None, reason=f"the native kernels are {native_status()}")
def test_a_wheel_installed_elsewhere_runs_the_native_kernels(tmp_path):
    name, build_dir = build_location()
    so = next(build_dir.glob(f"{name}*.so"))
    built_at = so.stat().st_mtime_ns

    # the sdist, from a copy of what it is built from (the build writes egg-info next to it)
    src = tmp_path / "src"
    for package in ("nanoserve", "nanocourse"):  # every package pyproject.toml lists
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    code = "from setuptools import build_meta as b; print(b.build_sdist('dist'))"
    sdist = src / "dist" / run(sys.executable, "-c", code, cwd=src).strip().splitlines()[-1]
    with tarfile.open(sdist) as t:
        shipped = t.getnames()
        t.extractall(tmp_path / "unpacked", filter="data")
    assert all(any(n.endswith(f"nanoserve/csrc/{f}") for n in shipped) for f in CSRC), shipped

    # the wheel, from the unpacked sdist
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheels = tmp_path / "wheels"
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        wheels,
        unpacked,
    )
    (wheel,) = wheels.glob("nanoserve-*.whl")
    assert {f"nanoserve/csrc/{f}" for f in CSRC} <= set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "nanoserve").rglob("*.py")}
    assert modules <= set(zipfile.ZipFile(wheel).namelist()), modules - set(zipfile.ZipFile(wheel).namelist())

    # a fresh venv: the wheel installed in it, torch & co. seen through a .pth, the checkout not
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANOSERVE_NATIVE")}
    env["TORCH_EXTENSIONS_DIR"] = str(build_dir.parent)  # this process's cache, where the build is
    report = json.loads(run(python, "-c", CHECK, cwd=tmp_path, env=env).strip().splitlines()[-1])
    assert Path(report["file"]).is_relative_to(venv), report  # the wheel's nanoserve, not the checkout's
    assert report["status"] == "built", report
    assert report["linear_diff"] < 1e-4, report
    assert report["name"] == name, report  # the same build as the checkout's ...
    assert so.stat().st_mtime_ns == built_at  # ... loaded as it was, not compiled again
