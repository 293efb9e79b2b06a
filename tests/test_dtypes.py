"""bfloat16 and float16 parameters: states in the parameter's dtype, math in float32, against
torch.optim, on both backends; and a model mixing float32 and bfloat16 parameters.

The reference. torch.optim's own low-precision path (foreach=False on bf16 tensors) does the math
in bf16, which flatopt deliberately does not (at step 1 it is already up to 13 % off on small
elements). flatopt's contract is "upcast, one float32 torch.optim step, round to the storage
dtype". So the reference is torch.optim.AdamW(foreach=False) / torch.optim.SGD(foreach=False) on
float32 copies that hold exactly our stored values before each step (bf16/fp16 values are exact in
float32), whose result is then rounded to the storage dtype; its own step count is kept and ours is
checked against it. Restarting the reference from our values each step keeps the comparison at
one rounding per step: a float32 result a few float32 ulps from a bf16 rounding boundary (the
kernel's bias corrections use a float32 expm1, torch's use float64 pow) may round the other way,
and without the restart that one-ulp difference would propagate and be amplified by cancellation
in exp_avg, forcing tolerances loose enough to hide bf16 math.

Tolerances: conftest.TOL, i.e. two units in the last place (bf16: 8 significant bits, one ulp is
at most 2**-7 = 0.78 % so rtol=1.6e-2; fp16: 11 bits, 2**-10 so rtol=2e-3) and atol=1e-5 for values
near zero. A rounding decided differently is rare (measured: at most 0.5 % of the elements of a
step), while low-precision math rounds every intermediate and differs from the reference in 10 to
50 % of the elements, mostly by one ulp, which TOL alone would let through (SGD's update is nearly
one operation): so at most MAX_DIFFERING of the low-precision elements of a step may differ at
all. torch's fused=True path on the CPU is the same upcast-step-round;
test_matches_torch_fused_on_cpu compares with it over 10 uninterrupted steps.

Rounding of the Triton backend under the interpreter: the interpreter truncates float32 ->
bfloat16 (triton/runtime/interpreter.py casts ignore the rounding mode); compiled kernels round to
nearest even like torch. The reference rounds the way the platform running the kernels does.
"""

import copy

import pytest
import torch
from conftest import TOL, LionReference, device_for
from torch import nn

import flatopt

LOW = [torch.bfloat16, torch.float16]
MAX_DIFFERING = 0.02  # fraction of the elements of a step that may differ from the reference at all


def close(actual, expected, what, **tol):
    """torch.testing.assert_close with explicit tolerances and a message naming the step and the tensor."""
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def round_like(t, dtype, backend):
    """``t`` (float32) stored as ``dtype`` the way ``backend`` stores it, returned as float32."""
    if dtype == torch.bfloat16 and backend == "triton" and device_for(backend) == "cpu":  # the interpreter
        return (t.float().view(torch.int32) & -65536).view(torch.float32)  # round toward zero
    return t.to(dtype).float()


class Mlp(nn.Module):
    """Sizes that are not multiples of any block size; ``low`` puts the second layer in another dtype."""

    def __init__(self, dtype=torch.float32, low=None):
        super().__init__()
        self.a = nn.Linear(33, 17).to(dtype)
        self.b = nn.Linear(17, 5).to(low or dtype)

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        return self.b(h.to(self.b.weight.dtype)).float()


def groups(model, **decay):
    mats = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": mats, **decay}, {"params": rest, "lr": decay.get("lr", 1e-2) * 0.5, "weight_decay": 0.0}]


OPTS = {
    "adamw": (
        lambda ps, **k: flatopt.AdamW(ps, **k),
        lambda ps: torch.optim.AdamW(ps, foreach=False),
        dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        ("exp_avg", "exp_avg_sq"),
    ),
    "sgd": (
        lambda ps, **k: flatopt.SGD(ps, **k),
        lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False),
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.1),
        ("momentum_buffer",),
    ),
    "lion": (  # against Lion as the paper writes it (tests/conftest.py), in float32
        lambda ps, **k: flatopt.Lion(ps, **k),
        lambda ps: LionReference(ps),
        dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
        ("exp_avg",),
    ),
}
TORCH_FUSED = ["adamw", "sgd"]  # torch.optim has no Lion


def step_by_step(backend, opt_name, model, steps=10):
    """Train ``model`` with flatopt; before each step restart a float32 torch.optim copy from our
    values, step it once, round it like the backend stores, and compare every tensor."""
    make_ours, make_ref, kw, keys = OPTS[opt_name]
    device = next(model.parameters()).device
    ref = copy.deepcopy(model).float()
    ours = make_ours(groups(model, **kw), backend=backend)
    theirs = make_ref(groups(ref, **kw))
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(8, 33, generator=gen).to(device)
        model(x).square().mean().backward()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                q.copy_(p.float())
                q.grad = p.grad.float()
                for key in keys:
                    if key in theirs.state.get(q, {}):
                        theirs.state[q][key].copy_(ours.state[p][key].float())
        ours.step()
        theirs.step()
        differing = total = 0
        for name, p, q in zip(names, model.parameters(), ref.parameters(), strict=True):
            dtype = p.dtype
            tol = TOL[dtype]
            expected = round_like(q.detach(), dtype, backend)
            close(p.detach().float(), expected, f"step {step}, {name}", **tol)
            low = dtype != torch.float32  # float32 differs in float32 op order only: TOL covers it
            differing += int((p.detach().float() != expected).sum()) if low else 0
            total += p.numel() if low else 0
            for key in keys:
                mine = ours.state[p][key]
                assert mine.dtype == dtype, f"step {step}, {name}.{key} is {mine.dtype}, not the parameter's {dtype}"
                if key not in theirs.state[q]:  # SGD's group without momentum
                    continue
                theirs_value = round_like(theirs.state[q][key], dtype, backend)
                close(mine.float(), theirs_value, f"step {step}, {name}.{key}", **tol)
                differing += int((mine.float() != theirs_value).sum()) if low else 0
                total += mine.numel() if low else 0
            if "step" in theirs.state[q]:
                assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == step, f"step {step}, {name}"
        assert differing <= MAX_DIFFERING * total, f"step {step}: {differing} of {total} elements differ"
        ours.zero_grad()
        theirs.zero_grad()
    return ours


def skip_lion_on_gpu(opt_name, backend):
    if opt_name == "lion" and device_for(backend) == "cuda":
        pytest.skip(
            "compiled Lion kernels contract beta1 * m + (1 - beta1) * g into an FMA, which can flip the sign where "
            "it is within rounding of zero; tests/test_gpu.py checks Lion in bf16/fp16 with a sign-aware tolerance"
        )


@pytest.mark.parametrize("opt_name", list(OPTS))
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_matches_torch_math_in_float32(backend, dtype, opt_name):
    skip_lion_on_gpu(opt_name, backend)
    torch.manual_seed(0)
    model = Mlp().to(device_for(backend), dtype)
    ours = step_by_step(backend, opt_name, model)
    assert [buf.dtype for buf in flatopt.inspect(ours).buffers] == [dtype]
    assert all(s.dtype == dtype for s in flatopt.inspect(ours).buffers[0].states.values())


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_mixed_float32_and_bfloat16_model(backend, opt_name):
    skip_lion_on_gpu(opt_name, backend)
    torch.manual_seed(0)
    model = Mlp(torch.float32, low=torch.bfloat16).to(device_for(backend))
    ours = step_by_step(backend, opt_name, model)
    assert sorted(str(buf.dtype) for buf in flatopt.inspect(ours).buffers) == ["torch.bfloat16", "torch.float32"]
    for buf in flatopt.inspect(ours).buffers:
        assert all(p.dtype == buf.dtype for p in buf.params)
        assert all(s.dtype == buf.dtype for s in buf.states.values())
    assert {id(p) for p in flatopt.inspect(ours).buffers[0].params} | {
        id(p) for p in flatopt.inspect(ours).buffers[1].params
    } == {id(p) for p in model.parameters()}


def fused_is_float32_math(cls, dtype):
    """Whether torch's fused CPU kernel of ``cls`` is "upcast, float32 step, round" for ``dtype`` here.
    (torch 2.13's fused CPU SGD is not: for tensors of 16 elements or more it is off by up to 0.15
    for bf16 and fp16, a torch bug; its fused AdamW is exact.)"""
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(100, generator=gen).to(dtype), torch.randn(100, generator=gen).to(dtype)
    fused, ref = nn.Parameter(p0.clone()), nn.Parameter(p0.float())
    try:
        opts = [cls([fused], lr=0.1, weight_decay=0.1, fused=True), cls([ref], lr=0.1, weight_decay=0.1, foreach=False)]
    except (RuntimeError, ValueError):
        return False
    for _ in range(2):
        fused.grad, ref.grad = g.clone(), g.float()
        try:
            opts[0].step()
        except (RuntimeError, ValueError):
            return False
        opts[1].step()
        with torch.no_grad():
            ref.copy_(ref.to(dtype))
    return torch.allclose(fused.detach().float(), ref.detach(), **TOL[dtype])


@pytest.mark.parametrize("opt_name", TORCH_FUSED)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_matches_torch_fused_on_cpu(dtype, opt_name):
    """The CPU backend against torch.optim's fused CPU kernel (float32 math, states in the parameter's
    dtype) over 10 uninterrupted steps: both run the same float32 expressions, so they agree to the bit
    in practice; TOL leaves room for one rounding decided differently."""
    make_ours, _, kw, keys = OPTS[opt_name]
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[opt_name]
    if not fused_is_float32_math(cls, dtype):
        pytest.skip(f"torch {torch.__version__}'s fused CPU {cls.__name__} for {dtype} is not float32 math")
    torch.manual_seed(0)
    model = Mlp().to(dtype)
    ref = copy.deepcopy(model)
    ours = make_ours(groups(model, **kw), backend="torch")
    theirs = cls(groups(ref, **kw), fused=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        x = torch.randn(8, 33, generator=gen)
        for m, o in ((model, ours), (ref, theirs)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            close(p, q, f"step {step}, {name}", **TOL[dtype])
            for key in keys:
                if key in theirs.state[q]:
                    close(ours.state[p][key], theirs.state[q][key], f"step {step}, {name}.{key}", **TOL[dtype])
