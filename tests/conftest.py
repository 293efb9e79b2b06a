"""Device gating and shared models for the tests.

* ``requires_cuda``: needs a CUDA GPU; CPU-only runs skip it and say why.
* ``backend`` fixture: every optimizer test runs with the pure-torch backend and with the Triton
  kernels. On a machine without a GPU the kernels run under the Triton interpreter, which must be
  switched on before triton is imported (``make test`` sets TRITON_INTERPRET=1).
"""

import os

import pytest
import torch
from torch import nn

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (CI runs without one)")
    for item in items:
        if "requires_cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def json_lines_without_interpreter(module, function):
    """Run ``module.function()`` (a test module's) in a fresh Python without the Triton interpreter (the
    compiler cannot see through its wrappers) and return the JSON objects it printed, one per line.
    Fails with the child's stderr when it exits with an error."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import {module}; {module}.{function}()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")], run


def triton_available():
    return HAS_CUDA or INTERPRET


TRITON_SKIP = pytest.mark.skipif(
    not triton_available(),
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by `make test`) to run on the CPU",
)


@pytest.fixture(params=["torch", "cpu", pytest.param("triton", marks=TRITON_SKIP)])
def backend(request):
    return request.param


def device_for(backend):
    """Where a test of ``backend`` runs: the Triton kernels on the GPU when there is one."""
    return "cuda" if backend == "triton" and HAS_CUDA and not INTERPRET else "cpu"


class Net(nn.Module):
    """Small model with what the layout must handle: a channels_last conv weight, a weight tied
    between embedding and head, a frozen layer, an unused layer, sizes that are not multiples of
    any block size."""

    def __init__(self, vocab=19, dim=6):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim + 5, 13)
        self.frozen = nn.Linear(13, dim)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(4, 3)

    def forward(self, img, tokens):
        feat = self.conv(img).mean(dim=(2, 3))
        h = torch.cat([self.emb(tokens).mean(1), feat], dim=1)
        return self.head(torch.tanh(self.frozen(torch.tanh(self.proj(h)))))


def make_batch(gen, batch=4, vocab=19, device="cpu"):
    img = torch.randn(batch, 3, 7, 7, generator=gen).to(device, memory_format=torch.channels_last)
    tokens = torch.randint(0, vocab, (batch, 5), generator=gen).to(device)
    target = torch.randint(0, vocab, (batch,), generator=gen).to(device)
    return img, tokens, target


def loss_fn(model, batch):
    img, tokens, target = batch
    return nn.functional.cross_entropy(model(img, tokens), target)


def param_groups(model, lr=1e-2, **decay_kwargs):
    """Two groups: matrices with weight decay, the rest without, and another lr."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, **decay_kwargs}, {"params": no_decay, "lr": lr * 0.5, "weight_decay": 0.0}]


TOL = {
    torch.float32: dict(atol=2e-6, rtol=2e-5),
    torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
    torch.float16: dict(atol=1e-5, rtol=2e-3),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}


def variant_tol(dtype, device):
    """Tolerances between two compiled variants of one kernel (another block shape, the gathering mode):
    none under the Triton interpreter, which runs each operation as written; on a GPU, ptxas may fuse a
    multiply and an add into one FMA in one variant and not in the other (PTX ``mul.f32``/``add.f32``
    without a rounding mode allow it), a rounding or a few apart: 1e-6 for float32 (capture's criterion
    against eager), one unit in the last place for bfloat16 and float16."""
    if torch.device(device).type != "cuda":
        return dict(atol=0, rtol=0)
    return {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}.get(
        dtype, dict(atol=1e-6, rtol=2**-10)
    )


def assert_same(ours, theirs, step, what, dtype=torch.float32):
    torch.testing.assert_close(ours, theirs, **TOL[dtype], msg=lambda m: f"step {step}, {what}: {m}")


class LionReference(torch.optim.Optimizer):
    """Lion as written in Chen et al. 2023 (Algorithm 2), decoupled weight decay as lion-pytorch."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - lr * wd)
                p.add_((m * beta1 + p.grad * (1 - beta1)).sign(), alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def pretend_ranks(monkeypatch, world):
    """torch.distributed as it looks in one of ``world`` ranks (the real multi-process run is in test_ddp.py)."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)


@pytest.fixture(autouse=True)
def gradients_as_on_a_gpu(request, monkeypatch):
    """On a GPU, zero_grad() releases the flat gradient storage, the covered layers write their gradients into the
    buffer and a hook copies each other gradient into it as it arrives; on the CPU the storage is kept, no layer is
    covered by default and step() lands the gradients itself (flatopt.landing, flatopt.grads: re-faulting pages, a
    Python hook per gradient and a Python autograd.Function per layer cost more than they save there). The suite runs
    on the CPU and tests the GPU's path, the one most users get; a test marked ``cpu_gradient_policy`` gets the
    CPU's, and so does every test with ``FLATOPT_TEST_GRADIENTS=cpu`` in the environment."""
    if "cpu_gradient_policy" not in request.keywords and os.environ.get("FLATOPT_TEST_GRADIENTS") != "cpu":
        from flatopt.grads import GradLanding
        from flatopt.landing import LandingSlots

        monkeypatch.setattr(LandingSlots, "release_on_cpu", True)
        monkeypatch.setattr(GradLanding, "copy_on_cpu", True)
        monkeypatch.setattr(GradLanding, "direct_on_cpu", True)
