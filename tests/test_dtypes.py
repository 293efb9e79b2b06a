"""bfloat16 and float16 parameters: states in the parameter's dtype, math in float32, against
torch.optim, on both backends; and a model mixing float32 and bfloat16 parameters. float64
parameters (the second half of this file): float64 math and hyper-parameters, against torch.optim's
float64 step in every mode, mixed with float32, recorded by capture() and through a state dict.

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


# ---------------------------------------------------------------------------------------------- float64
#
# float64 parameters step with float64 math and a float64 hyper-parameter table, so flatopt follows
# torch.optim's own float64 step (torch.optim.AdamW / SGD with foreach=False, Lion as the paper writes it)
# over F64_STEPS uninterrupted steps, with the lr changed at every step. The two differ only in the rounding
# of single operations: torch's CPU kernels fuse some multiply-adds (add with alpha, addcmul), the compiled
# Triton kernels others, and the bias corrections are computed as Kahan's expm1 here and as 1 - beta**t
# there; training carries those ulps from step to step. Measured over 60 steps: at most 2e-14 of the
# largest magnitude of each tensor (parameters, exp_avg, exp_avg_sq, momentum_buffer). F64_TOL allows
# 1e-12 of it (plus 1e-12 of the element itself): fifty times the measured drift, and four orders of
# magnitude below what float32 anywhere would change (a float32 lr or beta is off by up to 6e-8 relative,
# 1 - beta2 for beta2=0.999 by 1.3e-5; float32 math rounds every operation at 6e-8).

F64_STEPS = 50
F64_TOL = 1e-12


def f64_close(actual, expected, what):
    """Both float64, and ``|actual - expected| <= F64_TOL * (|expected| + max |expected|)`` (see above)."""
    assert actual.dtype == expected.dtype == torch.float64, f"{what}: {actual.dtype} vs {expected.dtype}"
    close(actual, expected, what, atol=F64_TOL * float(expected.abs().max()), rtol=F64_TOL)


class Chain(nn.Module):
    """Two float64 layers in a row, sizes that are not multiples of any block size: every gradient depends
    on every parameter, so a difference anywhere would spread."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(33, 17).double()
        self.b = nn.Linear(17, 5).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class SideBySide(nn.Module):
    """A float64 layer and a float32 one side by side: each gradient depends on its own layer only, so the
    float32 layer's roundings (where torch.optim's float32 step and flatopt's differ) never reach the float64
    comparison."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(33, 17).double()
        self.b = nn.Linear(33, 5)

    def forward(self, x):
        return torch.cat([torch.tanh(self.a(x)), torch.tanh(self.b(x.float())).double()], dim=1)


F64_OPTS = {  # (flatopt class, reference class, param groups of a model, torch.optim's state keys)
    "adamw": (
        flatopt.AdamW,
        lambda groups: torch.optim.AdamW(groups, foreach=False),
        lambda m: [
            {"params": [m.a.weight, m.b.weight], "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
            {
                "params": [m.a.bias, m.b.bias],
                "lr": 5e-3,
                "betas": (0.8, 0.99),
                "eps": 1e-6,
                "weight_decay": 0.0,
                "maximize": True,
            },
        ],  # fmt: skip
        ("step", "exp_avg", "exp_avg_sq"),
    ),
    "sgd": (  # every SGD feature, a param group each
        flatopt.SGD,
        lambda groups: torch.optim.SGD(groups, foreach=False),
        lambda m: [
            {"params": [m.a.weight], "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
            {"params": [m.a.bias], "lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.05},
            {"params": [m.b.weight], "lr": 0.05, "momentum": 0.0, "weight_decay": 0.1},  # no momentum buffer
            {"params": [m.b.bias], "lr": 0.01, "momentum": 0.5, "dampening": 0.5, "maximize": True},
        ],
        ("momentum_buffer",),
    ),
    "lion": (
        flatopt.Lion,
        lambda groups: LionReference(groups),  # Chen et al. 2023, here in float64 (tests/conftest.py)
        lambda m: [
            {"params": [m.a.weight, m.b.weight], "lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
            {"params": [m.a.bias, m.b.bias], "lr": 1e-3, "betas": (0.95, 0.98), "weight_decay": 0.0},
        ],
        ("exp_avg",),
    ),
}


def batch(gen, device):
    return torch.randn(8, 33, generator=gen, dtype=torch.float64).to(device)


def decay_lr(*opts):
    """The lr of every group times 0.97: torch.optim reads the new Python float, flatopt refreshes its table."""
    for o in opts:
        for group in o.param_groups:
            group["lr"] *= 0.97


def compare_float64(opt_name, ours, theirs, twin, step):
    """Every float64 parameter of ``ours`` and every state tensor of it against ``theirs`` (stepping ``twin``, a
    copy of the model), and the step counts."""
    *_, keys = F64_OPTS[opt_name]
    names = {q: n for n, q in twin.named_parameters()}
    for g, h in zip(ours.param_groups, theirs.param_groups, strict=True):
        for p, q in zip(g["params"], h["params"], strict=True):
            if p.dtype != torch.float64:
                continue
            for key in keys:
                expected = theirs.state[q].get(key)
                if expected is None:  # SGD's group without momentum: none, or the flat buffer's view left at zero
                    mine = ours.state[p].get(key)
                    assert mine is None or not mine.any(), f"step {step}, {names[q]}.{key} is not zero"
                elif key == "step":
                    assert float(ours.state[p]["step"]) == float(expected) == step, f"step {step}, {names[q]}.step"
                else:
                    f64_close(ours.state[p][key], expected, f"step {step}, {names[q]}.{key}")
            f64_close(p.detach(), q.detach(), f"step {step}, {names[q]}")


def train_against_reference(opt_name, model, ours, twin, theirs, steps=F64_STEPS, check=None, first=1):
    """Train ``model`` with ``ours`` and ``twin`` (a copy) with ``theirs`` on the same batches, the lr changed at
    every step, comparing them after each step (steps ``first`` ...); then ``check(step, x)``."""
    gen = torch.Generator().manual_seed(first)
    for step in range(first, first + steps):
        x = batch(gen, next(model.parameters()).device)
        decay_lr(ours, theirs)
        for m, o in ((model, ours), (twin, theirs)):
            m(x).square().mean().backward()
            o.step()  # in in-backward mode the step ran in backward: step() does nothing more
            o.zero_grad()
        compare_float64(opt_name, ours, theirs, twin, step)
        if check is not None:
            check(step, x)


F64_MODES = {
    "step": {},
    "flat=False": dict(flat=False),
    "in_backward": dict(in_backward=True, bucket_size=300),  # several buckets: launches over slices of the buffer
}


@pytest.mark.parametrize("mode", list(F64_MODES))
@pytest.mark.parametrize("opt_name", list(F64_OPTS))
def test_float64_matches_torch_optim_in_float64(backend, opt_name, mode):
    """F64_STEPS steps, parameters and every state against torch.optim. Under the Triton interpreter the modes
    that launch per parameter or per bucket (four and three launches a step, at a tenth of a second each) run 15
    steps: the same kernels as step mode, whose 50 steps check the drift; what those modes add is where each
    launch reads and writes, which the first steps show."""
    torch.manual_seed(0)
    device = device_for(backend)
    model = Chain().to(device)
    twin = copy.deepcopy(model)
    cls, make_ref, make_groups, _ = F64_OPTS[opt_name]
    ours = cls(make_groups(model), backend=backend, **F64_MODES[mode])
    interpreted = backend == "triton" and device == "cpu"
    steps = 15 if interpreted and mode != "step" else F64_STEPS
    train_against_reference(opt_name, model, ours, twin, make_ref(make_groups(twin)), steps=steps)
    look = flatopt.inspect(ours)
    if mode != "flat=False":  # flat=False steps each parameter's own tensors
        assert [buf.dtype for buf in look.buffers] == [torch.float64]
        assert all(s.dtype == torch.float64 for s in look.buffers[0].states.values())
    assert [t.dtype for t in look.tables.values()] == [torch.float64]


@pytest.mark.parametrize("mode", list(F64_MODES))
@pytest.mark.parametrize("opt_name", list(F64_OPTS))
def test_mixed_float32_and_float64_model(backend, opt_name, mode):
    """One buffer per dtype, one float64 table. The float64 parameters follow torch.optim in float64; the float32
    ones step with the table rounded to float32, bit for bit as an optimizer holding only them (and a float32
    table) steps them, and close to torch.optim's float32 step. 20 steps (6 in the modes that launch per
    parameter or bucket, under the interpreter)."""
    torch.manual_seed(0)
    device = device_for(backend)
    model = SideBySide().to(device)
    twin, split = copy.deepcopy(model), copy.deepcopy(model)
    cls, make_ref, make_groups, _ = F64_OPTS[opt_name]
    ours = cls(make_groups(model), backend=backend, **F64_MODES[mode])
    if mode != "flat=False":  # flat=False steps each parameter's own tensors
        look = flatopt.inspect(ours)
        assert sorted(str(b.dtype) for b in look.buffers) == ["torch.float32", "torch.float64"]
        for buf in look.buffers:
            assert all(p.dtype == buf.dtype for p in buf.params)
            assert all(s.dtype == buf.dtype for s in buf.states.values())
    alone = []  # the split model's float32 and float64 parameters, with an optimizer each
    for dtype in (torch.float32, torch.float64):
        groups = [{**g, "params": [p for p in g["params"] if p.dtype == dtype]} for g in make_groups(split)]
        alone.append(cls([g for g in groups if g["params"]], backend=backend, **F64_MODES[mode]))

    def same_as_split(step, x):
        decay_lr(*alone)
        split(x).square().mean().backward()
        for o in alone:
            o.step()
            o.zero_grad()
        for (n, p), q in zip(model.named_parameters(), split.parameters(), strict=True):
            close(p, q, f"step {step}, {n} against its dtype's own optimizer", atol=0, rtol=0)
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            if p.dtype == torch.float32:
                close(p, q, f"step {step}, {n} against torch.optim in float32", **TOL[torch.float32])

    steps = 6 if backend == "triton" and device == "cpu" and mode != "step" else 20
    theirs = make_ref(make_groups(twin))
    train_against_reference(opt_name, model, ours, twin, theirs, steps=steps, check=same_as_split)
    assert [t.dtype for t in flatopt.inspect(ours).tables.values()] == [torch.float64]
    assert [t.dtype for t in flatopt.inspect(alone[0]).tables.values()] == [torch.float32]
    assert [t.dtype for t in flatopt.inspect(alone[1]).tables.values()] == [torch.float64]


@pytest.mark.parametrize("opt_name", list(F64_OPTS))
def test_recorded_float64_step_matches_torch_optim(backend, opt_name):
    """What capture() records (flatopt.capture.RecordedBody: zero_grad, train_step's forward and backward, the
    step; with the Triton kernels the step reads each gradient where backward left it), run eagerly, in float64
    against torch.optim."""
    from flatopt.capture import RecordedBody

    torch.manual_seed(0)
    device = device_for(backend)
    model = Chain().to(device)
    twin = copy.deepcopy(model)
    cls, make_ref, make_groups, _ = F64_OPTS[opt_name]
    ours = cls(make_groups(model), backend=backend, direct_grads=False)  # backward leaves gradients to gather
    theirs = make_ref(make_groups(twin))
    body = RecordedBody(ours, lambda x: model(x).square().mean().backward(), [torch.zeros(8, 33, dtype=torch.float64)])
    gather = backend == "triton"
    assert (body.sources is not None) == gather
    buf = flatopt.inspect(ours).buffers[0]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        x = batch(gen, device)
        decay_lr(ours, theirs)
        body.static[:] = [x]
        ours.engine.refresh_hparams()  # as each replay's call does before the graph runs
        body.run(gather=gather)
        twin(x).square().mean().backward()
        theirs.step()
        theirs.zero_grad()
        if gather:  # read where backward left them, not from the views
            read = body.sources[buf].src.tolist()
            assert all(a != v.data_ptr() for a, v in zip(read, buf.grad_views)), f"step {step}: nothing gathered"
        compare_float64(opt_name, ours, theirs, twin, step)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("opt_name", list(F64_OPTS))
def test_captured_float64_step_matches_torch_optim(opt_name):
    """optimizer.capture(): a CUDA graph of zero_grad, forward, backward and the float64 step, replayed 20 times
    with the lr changed before each replay (the float64 table is refreshed in place), against torch.optim."""
    torch.manual_seed(0)
    model = Chain().cuda()
    twin = copy.deepcopy(model)
    cls, make_ref, make_groups, _ = F64_OPTS[opt_name]
    ours, theirs = cls(make_groups(model)), make_ref(make_groups(twin))
    gen = torch.Generator().manual_seed(1)
    xs = [batch(gen, "cuda") for _ in range(21)]
    step = ours.capture(lambda x: model(x).square().mean().backward(), xs[0])
    for i, x in enumerate(xs[1:], start=1):
        decay_lr(ours, theirs)
        step(x)
        twin(x).square().mean().backward()
        theirs.step()
        theirs.zero_grad()
        compare_float64(opt_name, ours, theirs, twin, i)
    assert [t.dtype for t in flatopt.inspect(ours).tables.values()] == [torch.float64]


def test_float64_state_dict_round_trip_with_torch_optim(backend):
    """A float64 flatopt.AdamW's state_dict loads into torch.optim.AdamW (float64 states, float32 steps as torch
    keeps them), which trains on as flatopt does; and torch's loads back into flatopt, which does the same."""
    torch.manual_seed(0)
    device = device_for(backend)
    model = Chain().to(device)
    cls, make_ref, make_groups, _ = F64_OPTS["adamw"]
    ours = cls(make_groups(model), backend=backend)
    twin = copy.deepcopy(model)
    train_against_reference("adamw", model, ours, twin, make_ref(make_groups(twin)), steps=5)

    theirs = make_ref(make_groups(twin))  # a fresh torch.optim.AdamW, given flatopt's state
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # as saved and loaded: no tensor shared
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert theirs.state[q]["step"].dtype == torch.float32 and float(theirs.state[q]["step"]) == 5
        for key in ("exp_avg", "exp_avg_sq"):
            close(theirs.state[q][key], ours.state[p][key], f"loaded {key}", atol=0, rtol=0)
    train_against_reference("adamw", model, ours, twin, theirs, steps=5, first=6)

    module = copy.deepcopy(twin)  # and torch's state into a fresh flatopt
    back = cls(make_groups(module), backend=backend)
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for p, q in zip(module.parameters(), twin.parameters(), strict=True):
        assert float(back.state[p]["step"]) == 10
        for key in ("exp_avg", "exp_avg_sq"):
            assert back.state[p][key].dtype == torch.float64
            close(back.state[p][key], theirs.state[q][key], f"loaded back {key}", atol=0, rtol=0)
    train_against_reference("adamw", module, back, twin, theirs, steps=5, first=11)


def test_unsupported_dtypes_are_refused_naming_the_supported_ones():
    for dtype in (torch.float8_e5m2, torch.complex128):
        bad = nn.Parameter(torch.zeros(3, dtype=dtype))
        expected = "complex parameters" if dtype.is_complex else "supports float32, bfloat16, float16 and float64 param"
        with pytest.raises(ValueError, match=expected):
            flatopt.AdamW([bad])


def test_clip_grad_norm_of_float64_and_mixed_gradients_matches_torch():
    """opt.clip_grad_norm_() over a float32 and a float64 buffer: the float64 gradients' norm in float64, the
    total as torch.nn.utils.clip_grad_norm_ computes it, and the same clipped gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3).double())
    ref = copy.deepcopy(model)
    opt = flatopt.SGD(model, lr=0.1)
    x = torch.randn(6, 5)
    for m in (model, ref):
        m[1](m[0](x).double()).square().sum().backward()
    total = opt.clip_grad_norm_(0.5)
    expected = nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, expected.double(), atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # the float32 buffer's norm is one float32 norm here and a float32 norm per tensor in torch: the total, and
        # so the float64 gradients' coefficient, agree to float32 rounding of that part (about 1e-8 relative)
        tol = dict(atol=1e-12, rtol=1e-7) if p.dtype == torch.float64 else dict(atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=name: f"{n}.grad: {m}")
