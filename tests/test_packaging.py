"""A built wheel installs flatopt with its Triton kernels as flatopt.kernels (pyproject's package-dir
maps kernels/ there), and imports from outside the source tree."""

import os
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_ships_the_kernels_and_imports(tmp_path):
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("setuptools is not installed, so the wheel cannot be built offline here")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), REPO],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("flatopt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("flatopt/__init__.py", "flatopt/kernels/__init__.py", "flatopt/kernels/adamw.py"):
        assert module in names, f"{module} missing from {wheel.name}"
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = "import flatopt, flatopt.kernels; print(flatopt.kernels.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith(str(target)), run.stdout
