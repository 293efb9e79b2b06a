"""Packaging: a built wheel ships the Triton kernels (the top-level kernels/ folder) as flatopt.kernels and
imports from outside the source tree; an editable install imports the package from any working directory,
including the folder that holds a clone named ``flatopt``."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_FILES = sorted(name for name in os.listdir(os.path.join(REPO, "kernels")) if name.endswith(".py"))


def _needs_setuptools():
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("setuptools is not installed, so the package cannot be built offline here")


def _env_without_pythonpath(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def test_wheel_ships_the_kernels_and_imports(tmp_path):
    _needs_setuptools()
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), REPO],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("flatopt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "adamw.py" in KERNEL_FILES and "__init__.py" in KERNEL_FILES, KERNEL_FILES
    for module in ["flatopt/__init__.py"] + [f"flatopt/kernels/{name}" for name in KERNEL_FILES]:
        assert module in names, f"{module} missing from {wheel.name}"
    assert not [n for n in names if n.startswith("kernels/")], "the kernels must ship as flatopt.kernels only"
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = "import flatopt, flatopt.kernels; print(flatopt.kernels.__file__)"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env_without_pythonpath(PYTHONPATH=str(target)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith(str(target)), run.stdout


def _clone_named_flatopt(parent):
    """What ``git clone`` into ``parent/flatopt`` leaves: the files an install reads, the link included."""
    clone = parent / "flatopt"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(REPO, name), clone / name)
    for name in ("flatopt", "kernels"):
        shutil.copytree(
            os.path.join(REPO, name), clone / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    return clone


def test_editable_install_imports_from_the_folder_holding_the_clone(tmp_path):
    """A clone in ``~/flatopt`` and a script run from ``~``: the working directory's ``flatopt`` folder (no
    ``__init__.py``) is a namespace package to Python's path finder, which must not shadow the package."""
    _needs_setuptools()
    clone = _clone_named_flatopt(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    # torch, pip and setuptools from this interpreter, after everything the scratch environment installs
    outer = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    with open(os.path.join(purelib, "zz_outer_site_packages.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(outer)) + "\n")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-q",
         "-e", str(clone)],
        cwd=tmp_path, env=_env_without_pythonpath(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    code = "import flatopt; flatopt.AdamW; import flatopt.kernels; print(flatopt.__file__, flatopt.kernels.__file__)"
    run = subprocess.run(
        [python, "-c", code], cwd=tmp_path, env=_env_without_pythonpath(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    package, kernels = run.stdout.split()
    assert package == str(clone / "flatopt" / "__init__.py"), run.stdout
    assert kernels == str(clone / "flatopt" / "kernels" / "__init__.py"), run.stdout
    assert os.path.samefile(kernels, clone / "kernels" / "__init__.py"), "flatopt.kernels is not the kernels/ folder"
