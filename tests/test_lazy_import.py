"""``import flatopt`` and steps with the pure-torch backend leave the Triton kernels unimported:
``flatopt.kernels`` (which imports triton, seconds on a CPU-only machine) is imported by the functional
dispatch when a Triton launch first runs. Each check runs in a fresh interpreter."""

import json
import os
import subprocess
import sys

from conftest import TRITON_SKIP

# Records the first frame outside the import machinery that imports triton, then runs one of the MODES.
PROBE = r"""
import json, os, sys, traceback

first = {}


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" and not first:
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
            first["importer"] = os.path.realpath(frames[-1].filename)
        return None


sys.meta_path.insert(0, Watch())
import flatopt

seen = {"after_import": sorted(m for m in ("triton", "flatopt.kernels") if m in sys.modules)}
mode = sys.argv[1]
if mode == "import-kernels":
    import flatopt.kernels
elif mode != "import":
    import torch

    on_gpu = mode == "triton" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    model = torch.nn.Linear(4, 4, device="cuda" if on_gpu else "cpu")
    opt = flatopt.AdamW(model, lr=0.1, backend=mode)
    before = model.weight.detach().clone()
    for _ in range(2):
        model(torch.randn(2, 4, device=model.weight.device)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(before, model.weight), "the optimizer did not step"
seen["after"] = sorted(m for m in ("triton", "flatopt.kernels") if m in sys.modules)
seen["triton_importer"] = first.get("importer")
seen["flatopt_dirs"] = [os.path.realpath(os.path.dirname(flatopt.__file__))]
seen["flatopt_dirs"].append(os.path.realpath(os.path.join(seen["flatopt_dirs"][0], "kernels")))
print(json.dumps(seen))
"""


def probe(mode):
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def imported_by_flatopt(seen):
    importer = seen["triton_importer"]
    return importer is not None and any(importer.startswith(d + os.sep) for d in seen["flatopt_dirs"])


def test_import_flatopt_leaves_triton_unimported():
    seen = probe("import")
    assert seen["after_import"] == [], f"`import flatopt` imported {seen['after_import']} ({seen['triton_importer']})"


def test_torch_backend_steps_without_the_triton_kernels():
    """torch.optim.Optimizer's own constructor imports torch._dynamo, which imports triton when it is installed
    (torch 2.13; torch.optim.AdamW does the same); flatopt itself must not, and must not load its kernels."""
    seen = probe("torch")
    assert "flatopt.kernels" not in seen["after"], seen
    assert not imported_by_flatopt(seen), f"flatopt's own code imported triton: {seen['triton_importer']}"


def test_the_probe_sees_an_import_by_flatopt():
    """The check above can fail: importing flatopt.kernels is seen as flatopt's import of triton."""
    seen = probe("import-kernels")
    assert "flatopt.kernels" in seen["after"] and "triton" in seen["after"], seen
    assert imported_by_flatopt(seen), seen


@TRITON_SKIP
def test_triton_backend_imports_the_kernels_at_its_first_launch():
    seen = probe("triton")
    assert seen["after_import"] == [] and "flatopt.kernels" in seen["after"], seen
