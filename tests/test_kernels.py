"""Each Triton launcher (flatopt.kernels.adamw_step / sgd_step / lion_step) against its pure-torch
reference (flatopt.reference.*_step, same signature), directly on flat buffers built by
flatopt.layout.FlatBuffer: lengths that are not multiples of the block size, several param groups,
per-parameter step counts, an active mask, grad_scale and found_inf, maximize. Every buffer and
meta.steps are compared after each launch, and the launch counter must be back at zero.

On a machine without a GPU the kernels run under the Triton interpreter, so sizes stay small; a
block size of 128 makes several programs run (the last one partial), None is the default block.
Each launch starts both sides from the same buffers (the kernel's output of the previous launch),
so the comparison is one rounding per launch: under the interpreter a bfloat16 store truncates
where torch rounds to nearest, one bf16 ulp, which TOL[bfloat16] (two ulps) allows.

float64 buffers step with a float64 table and float64 math. Kernel and reference differ by a rounding at
most (measured: 6e-17 absolute, the kernel's bias corrections using Kahan's expm1 where the reference uses
torch.expm1); TOLS[float64] allows 1e-13 relative and 1e-15 absolute, five orders of magnitude below what
float32 math or a float32 hyper-parameter would change (a relative 6e-8 or more).
"""

import math

import pytest
import torch
from conftest import TOL, TRITON_SKIP, device_for, variant_tol

from flatopt import functional, kernels, reference
from flatopt.layout import FlatBuffer, GradSources, StepMeta, compute_dtype
from flatopt.rules import ADAMW, LION, SGD

pytestmark = [
    TRITON_SKIP,
    # the beta1=0 group: the interpreter evaluates both branches of one_minus_pow's tl.where with numpy,
    # including log(0) and 0/0 in the branch that the where discards
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
]

DEVICE = device_for("triton")
TOLS = {**TOL, torch.float64: dict(atol=1e-15, rtol=1e-13)}  # see the module docstring
STEP_BLOCK = kernels.common.STEP_BLOCK  # parameters per chunk when the last program advances the steps
SHAPES = [(37,), (5, 13), (64,), (1,), (129,), (3, 3, 3), (70,)]  # 704 elements laid out: 5.5 blocks of 128
GROUP_OF = [0, 1, 2, 0, 1, 2, 1]
STEPS = [0.0, 3.0, 1.0, 10.0, 0.0, 7.0, 2.0]
ACTIVE = [1, 0, 1, 1, 0, 1, 1]

OPTS = {
    "adamw": dict(
        rule=ADAMW,
        groups=[
            dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, maximize=False),
            dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, maximize=True),
            dict(lr=5e-2, betas=(0.0, 0.5), eps=1e-3, weight_decay=0.5, maximize=False),
        ],
    ),
    "sgd": dict(
        rule=SGD,
        groups=[
            dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False),
            dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False, maximize=True),
            dict(lr=0.02, momentum=0.5, dampening=0.3, weight_decay=0.0, nesterov=False, maximize=False),
        ],
    ),
    "lion": dict(
        rule=LION,
        groups=[
            dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=0.1),  # lr above a bf16 ulp, so every step shows
            dict(lr=3e-2, betas=(0.95, 0.98), weight_decay=0.0),
            dict(lr=5e-2, betas=(0.5, 0.9), weight_decay=1.0),
        ],
    ),
}


def close(actual, expected, what, **tol):
    """torch.testing.assert_close with explicit tolerances and a message naming the step and the tensor."""
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def launchers(opt):
    return getattr(kernels, f"{opt}_step"), getattr(reference, f"{opt}_step")


class Case:
    """Flat buffers, their StepMeta and the hyper-parameter table of one kernel launch."""

    def __init__(self, opt, dtype, variant, seed=0):
        spec = OPTS[opt]
        uniform = variant == "uniform"
        groups = [0] * len(SHAPES) if uniform else GROUP_OF
        gen = torch.Generator().manual_seed(seed)
        params = [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in SHAPES]
        states = spec["rule"].state_names if variant != "no-momentum" else ()
        self.buf = FlatBuffer(params, groups, states)
        b = self.buf
        for i in range(len(params)):
            b.data_views[i].copy_(torch.randn(SHAPES[i], generator=gen))
            b.grad_views[i].copy_(torch.randn(SHAPES[i], generator=gen))
            for name, views in b.state_views.items():
                value = torch.randn(SHAPES[i], generator=gen)
                views[i].copy_(value.abs() * 0.01 if name == "exp_avg_sq" else value * 0.1)
        rows = spec["groups"]
        if variant == "no-momentum":
            rows = [{**g, "momentum": 0.0, "nesterov": False} for g in rows]
        self.hparams = torch.tensor([spec["rule"].row(g) for g in rows], dtype=compute_dtype(dtype), device=DEVICE)
        self.meta = b.meta
        self.meta.steps.copy_(torch.tensor([5.0] * len(SHAPES) if uniform else STEPS))
        self.meta.uniform = uniform
        if variant == "active":
            self.meta.active = torch.tensor(ACTIVE, dtype=torch.uint8, device=DEVICE)
        self.states = states
        self.opt = opt
        self.grad_scale = self.found_inf = None
        if variant == "grad_scale":
            self.grad_scale = torch.tensor([4.0], device=DEVICE)
            self.found_inf = torch.tensor([0.0], device=DEVICE)

    def tensors(self):
        b = self.buf
        out = {"param": b.data, "grad": b.grad, **b.states}
        if self.opt == "sgd" and not self.states:
            out["momentum_buffer"] = None
        return out

    def clone(self):
        """An independent copy: same values, separate buffers and meta."""
        other = object.__new__(Case)
        other.__dict__.update(self.__dict__)
        b = self.buf
        other.buf = object.__new__(FlatBuffer)
        other.buf.__dict__.update(b.__dict__)
        other.buf.data, other.buf.grad = b.data.clone(), b.grad.clone()
        other.buf.states = {k: v.clone() for k, v in b.states.items()}
        other.hparams = self.hparams.clone()
        m = self.meta
        other.meta = other.buf.meta = StepMeta(
            param_of_granule=m.param_of_granule.clone(),
            param_group=m.param_group.clone(),
            steps=m.steps.clone(),
            counter=m.counter.clone(),
            active=None if m.active is None else m.active.clone(),
            uniform=m.uniform,
        )
        return other

    def load(self, other):
        """Copy ``other``'s buffers and steps into this case."""
        for name, t in self.tensors().items():
            if t is not None:
                t.copy_(other.tensors()[name])
        self.meta.steps.copy_(other.meta.steps)

    def launch(self, fn, block_size, found_inf=None):
        fn(
            *self.tensors().values(),
            hparams=self.hparams,
            meta=self.meta,
            grad_scale=self.grad_scale,
            found_inf=self.found_inf if found_inf is None else found_inf,
            block_size=block_size,
        )


def padding(buf):
    pad = torch.ones(buf.numel, dtype=torch.bool, device=buf.device)
    for s, e in buf.index.values():
        pad[s:e] = False
    return pad


def compare(kernel, ref, launch, dtype):
    for name, t in kernel.tensors().items():
        if t is None:
            continue
        close(t, ref.tensors()[name], f"launch {launch}, {name}", **TOLS[dtype])
    close(kernel.meta.steps, ref.meta.steps, f"launch {launch}, steps", atol=0, rtol=0)
    assert kernel.meta.counter.tolist() == [0], f"launch {launch}: counter left at {kernel.meta.counter.tolist()}"


VARIANTS = ["uniform", "groups-and-steps", "active", "grad_scale"]


@pytest.mark.parametrize("block_size", [128, None], ids=["block128", "default-block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    "opt, variant",
    [(opt, variant) for opt in OPTS for variant in VARIANTS] + [("sgd", "no-momentum")],  # SGD's optional buffer
    ids=lambda x: x,
)
def test_kernel_matches_reference(opt, variant, dtype, block_size):
    kernel_fn, ref_fn = launchers(opt)
    kernel = Case(opt, dtype, variant)
    ref = kernel.clone()
    steps0 = kernel.meta.steps.clone()
    active = torch.ones_like(steps0) if kernel.meta.active is None else kernel.meta.active.float()
    untouched = {n: t.clone() for n, t in kernel.tensors().items() if t is not None}
    pad = padding(kernel.buf)
    for launch in (1, 2, 3):
        ref.load(kernel)
        kernel.launch(kernel_fn, block_size)
        ref.launch(ref_fn, block_size)
        compare(kernel, ref, launch, dtype)
        close(kernel.meta.steps, steps0 + launch * active, f"launch {launch}, steps", atol=0, rtol=0)
        for name, t in kernel.tensors().items():
            if t is not None:
                assert not t[pad].any(), f"launch {launch}: {name} padding is not zero"
    # inactive parameters are left exactly as they were (gradients stay scaled too)
    for i, on in enumerate(active.tolist()):
        if not on:
            s, e = kernel.buf.index[kernel.buf.params[i]]
            for name, t in kernel.tensors().items():
                if t is not None:
                    assert torch.equal(t[s:e], untouched[name][s:e]), f"inactive params[{i}] {name} changed"
    # every active parameter was updated
    for i, on in enumerate(active.tolist()):
        if on:
            s, e = kernel.buf.index[kernel.buf.params[i]]
            assert not torch.equal(kernel.buf.data[s:e], untouched["param"][s:e]), f"params[{i}] was not stepped"


@pytest.mark.parametrize("block_size", [128, None], ids=["block128", "default-block"])
@pytest.mark.parametrize("variant", ["uniform", "active", "grad_scale"])
@pytest.mark.parametrize("opt", list(OPTS))
def test_found_inf_leaves_everything_unchanged(opt, variant, block_size):
    kernel_fn, ref_fn = launchers(opt)
    case = Case(opt, torch.float32, variant)
    before = {n: t.clone() for n, t in case.tensors().items() if t is not None}
    steps = case.meta.steps.clone()
    for fn in (kernel_fn, ref_fn):
        for _ in range(2):
            case.launch(fn, block_size, found_inf=torch.tensor([1.0], device=DEVICE))
            for name, t in case.tensors().items():
                if t is not None:
                    assert torch.equal(t, before[name]), f"{fn.__module__}: found_inf=1 changed {name}"
            assert torch.equal(case.meta.steps, steps), f"{fn.__module__}: found_inf=1 advanced the steps"
            assert case.meta.counter.tolist() == [0]


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_maximize_is_minimizing_the_negated_gradient(opt):
    kernel_fn, _ = launchers(opt)
    up = Case(opt, torch.float32, "groups-and-steps")
    down = up.clone()
    grad_sign = OPTS[opt]["rule"].columns.index("grad_sign")
    up.hparams[:, grad_sign] = -1.0  # maximize in every group
    down.hparams[:, grad_sign] = 1.0
    down.buf.grad.neg_()
    for launch in (1, 2):
        up.launch(kernel_fn, 128)
        down.launch(kernel_fn, 128)
        for name in ["param", *up.states]:
            close(up.tensors()[name], down.tensors()[name], f"launch {launch}, {name}", atol=0, rtol=0)


@pytest.mark.parametrize("opt", list(OPTS))
def test_uniform_and_per_element_paths_agree(opt):
    """One group and equal steps: the UNIFORM kernel (scalars per program) and the general one agree bit for bit."""
    kernel_fn, _ = launchers(opt)
    uniform = Case(opt, torch.float32, "uniform")
    general = uniform.clone()
    general.meta.uniform = False
    for launch in (1, 2):
        uniform.launch(kernel_fn, 128)
        general.launch(kernel_fn, 128)
        for name, t in uniform.tensors().items():
            close(t, general.tensors()[name], f"launch {launch}, {name}", atol=0, rtol=0)
        assert torch.equal(uniform.meta.steps, general.meta.steps)


def test_launcher_rejects_mismatched_buffers():
    kernel_fn, _ = launchers("adamw")
    case = Case("adamw", torch.float32, "uniform")
    t = case.tensors()
    with pytest.raises(ValueError, match="flat buffers must share device, dtype and length"):
        kernel_fn(t["param"], t["grad"][:-64], t["exp_avg"], t["exp_avg_sq"], hparams=case.hparams, meta=case.meta)
    with pytest.raises(ValueError, match="flat buffers must be 1-D and contiguous"):
        kernel_fn(
            t["param"].view(-1, 64), t["grad"], t["exp_avg"], t["exp_avg_sq"], hparams=case.hparams, meta=case.meta
        )


@pytest.mark.parametrize("opt", list(OPTS))
def test_more_parameters_than_step_block(opt):
    """More parameters than STEP_BLOCK: the last program advances the step counters in several chunks."""
    kernel_fn, ref_fn = launchers(opt)
    n = STEP_BLOCK + 77
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(1 + i % 3, generator=gen).to(DEVICE) for i in range(n)]
    buf = FlatBuffer(params, [i % 3 for i in range(n)], OPTS[opt]["rule"].state_names)
    for views in [buf.data_views, buf.grad_views, *buf.state_views.values()]:
        for v in views:
            v.copy_(torch.rand(v.shape, generator=gen))
    spec = OPTS[opt]
    hparams = torch.tensor([spec["rule"].row(g) for g in spec["groups"]], dtype=torch.float32, device=DEVICE)
    buf.meta.steps.copy_(torch.arange(n) % 5)
    buf.meta.active = (torch.arange(n) % 4 != 1).to(device=DEVICE, dtype=torch.uint8)
    buf.meta.uniform = False
    steps0 = buf.meta.steps.clone()
    flat = [buf.data, buf.grad, *buf.states.values()]
    ref = [t.clone() for t in flat]
    ref_meta = StepMeta(
        buf.meta.param_of_granule, buf.meta.param_group, steps0.clone(), buf.meta.counter.clone(), buf.meta.active
    )
    kernel_fn(*flat, hparams=hparams, meta=buf.meta)
    ref_fn(*ref, hparams=hparams, meta=ref_meta)
    for name, mine, theirs in zip(["param", "grad", *buf.states], flat, ref, strict=True):
        close(mine, theirs, f"launch 1, {name}", **TOL[torch.float32])
    close(buf.meta.steps, steps0 + buf.meta.active.float(), "launch 1, steps", atol=0, rtol=0)
    close(ref_meta.steps, buf.meta.steps, "launch 1, reference steps", atol=0, rtol=0)
    assert buf.meta.counter.tolist() == [0]


@pytest.mark.parametrize("skip", [False, True], ids=["stepped", "found-inf"])
@pytest.mark.parametrize("opt", list(OPTS))
def test_uniform_launch_over_a_slice_advances_exactly_its_steps(opt, skip):
    """A UNIFORM launch over parameters [first, stop) of a buffer (an in-backward bucket) with more than
    STEP_BLOCK of them: the programs advance every count but the first, a block each, the last program the
    first one; counts outside the slice stay, and a found_inf skip advances none."""
    kernel_fn, ref_fn = launchers(opt)
    n, first, stop = STEP_BLOCK + 300, 5, STEP_BLOCK + 290
    block_size = 2048  # [first, stop) spans about 35 programs: several advance a block of counts
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(1 + i % 3, generator=gen).to(DEVICE) for i in range(n)]
    buf = FlatBuffer(params, [0] * n, OPTS[opt]["rule"].state_names)
    for views in [buf.data_views, buf.grad_views, *buf.state_views.values()]:
        for v in views:
            v.copy_(torch.rand(v.shape, generator=gen))
    spec = OPTS[opt]
    hparams = torch.tensor([spec["rule"].row(spec["groups"][0])], dtype=torch.float32, device=DEVICE)
    buf.meta.steps.fill_(3.0)
    lo, hi = buf.starts[first], buf.starts[stop]
    granules = buf.meta.param_of_granule[lo // 64 : hi // 64]
    meta = StepMeta(granules, buf.meta.param_group, buf.meta.steps, buf.meta.counter, first=first, stop=stop)
    meta.uniform = True
    ref_meta = StepMeta(granules, buf.meta.param_group, buf.meta.steps.clone(), buf.meta.counter.clone(), first=first)
    ref_meta.stop = stop
    found_inf = torch.tensor([1.0 if skip else 0.0], device=DEVICE)
    flat = [t[lo:hi] for t in (buf.data, buf.grad, *buf.states.values())]
    ref = [t.clone() for t in flat]
    for launch in (1, 2):
        kernel_fn(*flat, hparams=hparams, meta=meta, found_inf=found_inf, block_size=block_size)
        ref_fn(*ref, hparams=hparams, meta=ref_meta, found_inf=found_inf)
        for name, mine, theirs in zip(["param", "grad", *buf.states], flat, ref, strict=True):
            close(mine, theirs, f"launch {launch}, {name}", **TOL[torch.float32])
        expected = torch.full((n,), 3.0)
        expected[first:stop] += 0 if skip else launch
        close(buf.meta.steps.cpu(), expected, f"launch {launch}, steps", atol=0, rtol=0)
        close(ref_meta.steps.cpu(), expected, f"launch {launch}, reference steps", atol=0, rtol=0)
        assert buf.meta.counter.tolist() == [0]


def gradient_sources(case, dtype, seed=1):
    """Gradients of their own for the parameters of ``case`` (None for two of them: read from their own
    views), one of them a view at a 16-byte-aligned offset into a larger tensor, as GradSources takes them.
    Parameters 1 and 4 (inactive in the "active" variant) have gradients of their own."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for i, shape in enumerate(SHAPES):
        if i in (3, 5):
            grads.append(None)
        elif i == 2:
            n = math.prod(shape)
            big = torch.randn(n + 64, generator=gen).to(DEVICE, dtype)
            grads.append(big[16 : 16 + n].view(shape))  # 16 elements in: 32 or 64 bytes, aligned
        else:
            grads.append(torch.randn(shape, generator=gen).to(DEVICE, dtype))
    return grads


@pytest.mark.parametrize("block_size", [128, None], ids=["block128", "default-block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("variant", VARIANTS + ["found_inf"])
@pytest.mark.parametrize("opt", list(OPTS))
def test_gathered_gradients_step_as_a_copy_into_the_buffer_then_a_step(opt, variant, dtype, block_size):
    """sources=: the kernel reads each gradient where it lies and stores it into the flat gradient buffer as it
    steps. What copying the gradients into the buffer and stepping leaves, in every buffer and step counter,
    over three launches (bit for bit under the interpreter; within variant_tol on a GPU, whose compiler may
    fuse operations differently in the two variants; the stored gradients and the counters bit for bit
    everywhere): also for inactive parameters and a step found_inf skips (their gradients stored as read),
    and with GradScaler's unscaling (stored unscaled where the step applies)."""
    kernel_fn, _ = launchers(opt)
    gathered = Case(opt, dtype, "grad_scale" if variant == "found_inf" else variant)
    copied = gathered.clone()
    found_inf = torch.tensor([1.0], device=DEVICE) if variant == "found_inf" else None
    pad = padding(gathered.buf)
    for launch in (1, 2, 3):
        grads = gradient_sources(gathered, dtype, seed=launch)
        for (s, e), g in zip(gathered.buf.index.values(), grads):
            if g is not None:
                copied.buf.grad[s:e].copy_(g.reshape(-1))
        kernel_fn(*gathered.tensors().values(), hparams=gathered.hparams, meta=gathered.meta,
                  grad_scale=gathered.grad_scale, found_inf=found_inf if found_inf is not None else gathered.found_inf,
                  block_size=block_size, sources=GradSources.of(gathered.buf, grads))  # fmt: skip
        copied.launch(kernel_fn, block_size, found_inf=found_inf)
        for name, t in gathered.tensors().items():
            if t is not None:
                exact = name == "grad" and variant != "grad_scale"  # stored as read: a copy, no arithmetic
                tol = dict(atol=0, rtol=0) if exact else variant_tol(dtype, DEVICE)
                close(t, copied.tensors()[name], f"launch {launch}, {name}", **tol)
                assert not t[pad].any(), f"launch {launch}: {name} padding is not zero"
        close(gathered.meta.steps, copied.meta.steps, f"launch {launch}, steps", atol=0, rtol=0)
        assert gathered.meta.counter.tolist() == [0]
        s, e = gathered.buf.index[gathered.buf.params[0]]  # the source was read, not what the buffer held
        if variant not in ("found_inf", "grad_scale"):
            close(gathered.buf.grad[s:e], grads[0].reshape(-1), f"launch {launch}, gradient stored", atol=0, rtol=0)
        elif variant == "found_inf":  # skipped: stored as read (still scaled)
            close(gathered.buf.grad[s:e], grads[0].reshape(-1), f"launch {launch}, gradient stored", atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", VARIANTS + ["found_inf"])
@pytest.mark.parametrize("opt", list(OPTS))
def test_gathered_gradients_without_store_leave_the_buffer_alone(opt, variant, dtype):
    """sources built with store=False: the kernel steps from the gradients where they lie, as a copy into the
    buffer and a step would, and writes nothing into their slots of the flat gradient buffer (a NaN left there
    stays, and would poison the step if it were read); under GradScaler's unscaling the unscaled gradient goes
    back where it was read, where the step applies (a step found_inf skips leaves it scaled)."""
    kernel_fn, _ = launchers(opt)
    gathered = Case(opt, dtype, "grad_scale" if variant == "found_inf" else variant)
    copied = gathered.clone()
    found_inf = torch.tensor([1.0], device=DEVICE) if variant == "found_inf" else None
    for launch in (1, 2, 3):
        grads = gradient_sources(gathered, dtype, seed=launch)
        for (s, e), g in zip(gathered.buf.index.values(), grads):
            if g is not None:
                copied.buf.grad[s:e].copy_(g.reshape(-1))
                gathered.buf.grad[s:e].fill_(float("nan"))
        kernel_fn(*gathered.tensors().values(), hparams=gathered.hparams, meta=gathered.meta,
                  grad_scale=gathered.grad_scale, found_inf=found_inf if found_inf is not None else gathered.found_inf,
                  block_size=128, sources=GradSources.of(gathered.buf, grads, store=False))  # fmt: skip
        copied.launch(kernel_fn, 128, found_inf=found_inf)
        for name, t in gathered.tensors().items():
            if t is not None and name != "grad":
                close(t, copied.tensors()[name], f"launch {launch}, {name}", **variant_tol(dtype, DEVICE))
        close(gathered.meta.steps, copied.meta.steps, f"launch {launch}, steps", atol=0, rtol=0)
        assert gathered.meta.counter.tolist() == [0]
        for (s, e), g in zip(gathered.buf.index.values(), grads):
            if g is not None:
                assert gathered.buf.grad[s:e].isnan().all(), f"launch {launch}: a gathered gradient was stored"
                # where it was read: unscaled as the copy in the buffer was (exactly: the same division)
                close(g.reshape(-1), copied.buf.grad[s:e], f"launch {launch}, gradient left", atol=0, rtol=0)


def test_reference_backend_takes_gathered_gradients():
    """The torch reference's sources= copies the gradients into the buffer before its step."""
    _, ref_fn = launchers("adamw")
    gathered = Case("adamw", torch.float32, "groups-and-steps")
    copied = gathered.clone()
    grads = gradient_sources(gathered, torch.float32)
    for (s, e), g in zip(gathered.buf.index.values(), grads):
        if g is not None:
            copied.buf.grad[s:e].copy_(g.reshape(-1))
    ref_fn(*gathered.tensors().values(), hparams=gathered.hparams, meta=gathered.meta, block_size=None,
           sources=GradSources.of(gathered.buf, grads))  # fmt: skip
    copied.launch(ref_fn, None)
    for name, t in gathered.tensors().items():
        close(t, copied.tensors()[name], name, atol=0, rtol=0)


def test_grad_sources_refuse_a_gradient_the_kernel_cannot_read():
    case = Case("adamw", torch.float32, "uniform")
    grads = [None] * len(SHAPES)
    grads[1] = torch.randn(13, 5, device=DEVICE).t()  # other strides
    with pytest.raises(ValueError, match=r"parameter 1 cannot be read in place.*strides"):
        GradSources.of(case.buf, grads)
    grads[1] = torch.randn(70, device=DEVICE)[1:66].view(5, 13)  # 4 bytes in: not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        GradSources.of(case.buf, grads)
    with pytest.raises(ValueError, match="expected 7 gradients, got 2"):
        GradSources.of(case.buf, grads[:2])
    sources = GradSources.of(case.buf, [None] * len(SHAPES))
    sources.src = sources.src.to(torch.int32)
    whole = GradSources.of(case.buf, [None] * len(SHAPES))
    _, ref_fn = launchers("adamw")
    grad_before = case.buf.grad.clone()
    for fn in (kernels.adamw_step, ref_fn):  # checked alike, before anything changes
        other = Case("adamw", torch.float32, "uniform")
        other.meta.stop = 3  # a launch over a slice
        with pytest.raises(ValueError, match=r"steps a whole flat buffer, not parameters \[0, 3\) of 7"):
            fn(*other.tensors().values(), hparams=other.hparams, meta=other.meta, sources=whole)
        short = FlatBuffer([torch.zeros(s, device=DEVICE) for s in SHAPES[:6]] + [torch.zeros(3, device=DEVICE)],
                           [0] * 7)  # fmt: skip
        with pytest.raises(ValueError, match="built for a flat buffer of 704 torch.float32 elements and 7 parameters"):
            fn(short.data, short.grad, torch.zeros_like(short.data), torch.zeros_like(short.data),
               hparams=case.hparams, meta=short.meta, sources=whole)  # fmt: skip
        bad_vec = GradSources.of(case.buf, [None] * len(SHAPES))
        for vec in (0, 3, 4):  # 4 is a width, but these sizes are not multiples of it
            bad_vec.vec = vec
            with pytest.raises(ValueError, match=f"GradSources.vec={vec} is not a load width"):
                fn(*case.tensors().values(), hparams=case.hparams, meta=case.meta, sources=bad_vec)
        assert torch.equal(case.buf.grad, grad_before)
    with pytest.raises(ValueError, match="need a flat gradient buffer"):
        GradSources.of(FlatBuffer([torch.zeros(3, device=DEVICE)], [0], grad=False), [None])
    with pytest.raises(ValueError, match="block size that is a multiple of 64"):
        kernels.adamw_step(*case.tensors().values(), hparams=case.hparams, meta=case.meta, block_size=32,
                           sources=whole)  # fmt: skip
    with pytest.raises(ValueError, match=r"GradSources.src must be int64"):
        case_launch = Case("adamw", torch.float32, "uniform")
        kernels.adamw_step(*case_launch.tensors().values(), hparams=case_launch.hparams, meta=case_launch.meta,
                           sources=sources)  # fmt: skip


@pytest.mark.parametrize("dtype, vec", [(torch.float32, 4), (torch.bfloat16, 8), (torch.float64, 2)], ids=str)
def test_gathered_loads_are_16_bytes_wide_when_every_size_allows(dtype, vec):
    """GradSources.vec: 16 bytes of elements when every parameter's size is a multiple of it (the kernel then
    loads that many at a time), else 1; and such a buffer steps as a copy and a step does."""
    shapes = [(8, 4), (64,), (3, 8), (16, 1)]
    params = [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]
    buf = FlatBuffer(params, [0] * len(params), ("exp_avg", "exp_avg_sq"))
    grads = [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]
    sources = GradSources.of(buf, grads)
    assert sources.vec == vec
    assert GradSources.of(FlatBuffer([torch.zeros(5, device=DEVICE, dtype=dtype)], [0]), [None]).vec == 1
    other = FlatBuffer([p.clone() for p in params], [0] * len(params), ("exp_avg", "exp_avg_sq"))
    for (s, e), g in zip(other.index.values(), grads):
        other.grad[s:e].copy_(g.reshape(-1))
    group = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, maximize=False)
    hp = torch.tensor([ADAMW.row(group)], dtype=compute_dtype(dtype), device=DEVICE)
    for b, src in ((buf, sources), (other, None)):
        b.meta.uniform = True
        kernels.adamw_step(b.data, b.grad, b.states["exp_avg"], b.states["exp_avg_sq"], hparams=hp, meta=b.meta,
                           block_size=128, sources=src)  # fmt: skip
    for name in ("data", "grad"):
        close(getattr(buf, name), getattr(other, name), name, atol=0, rtol=0)
    for name in ("exp_avg", "exp_avg_sq"):
        close(buf.states[name], other.states[name], name, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- the table's dtype


@pytest.mark.parametrize("opt", list(OPTS))
def test_a_buffer_refuses_a_table_of_another_dtype_before_anything_changes(opt):
    """float64 buffers step with a float64 table (a float32 one would round lr, betas and eps), float32 ones
    with a float32 table: each launcher says which it needs, and changes nothing."""
    kernel_fn, ref_fn = launchers(opt)
    name = OPTS[opt]["rule"].name
    for dtype, wrong, want in ((torch.float64, torch.float32, "float64"), (torch.float32, torch.float64, "float32")):
        case = Case(opt, dtype, "groups-and-steps")
        case.hparams = case.hparams.to(wrong)
        before = {n: t.clone() for n, t in case.tensors().items() if t is not None}
        steps = case.meta.steps.clone()
        for fn in (kernel_fn, ref_fn):
            with pytest.raises(ValueError, match=rf"{name}'s hyper-parameter table is {want} \[groups, .*got {wrong}"):
                case.launch(fn, 128)
        for n, t in case.tensors().items():
            if t is not None:
                assert torch.equal(t, before[n]), f"{dtype}: {n} changed"
        assert torch.equal(case.meta.steps, steps)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("opt", list(OPTS))
def test_a_float64_table_steps_a_float32_buffer_as_its_float32_table_does(opt, dtype, backend):
    """flatopt.functional takes a float64 table (an optimizer's, on a device that also holds float64 parameters)
    for buffers whose math is float32: rounded to float32, it holds the values of the float32 table of the same
    rows, so the results are the same bit for bit."""
    fn = getattr(functional, opt)
    wide = Case(opt, dtype, "groups-and-steps")
    narrow = wide.clone()
    wide.hparams = torch.tensor([OPTS[opt]["rule"].row(g) for g in OPTS[opt]["groups"]], dtype=torch.float64)
    wide.hparams = wide.hparams.to(DEVICE)
    assert narrow.hparams.dtype == torch.float32 and not torch.equal(wide.hparams, narrow.hparams.double())
    for launch in (1, 2):
        for case in (wide, narrow):
            fn(*case.tensors().values(), hparams=case.hparams, meta=case.meta, backend=backend)
        for name, t in wide.tensors().items():
            close(t, narrow.tensors()[name], f"launch {launch}, {name}", atol=0, rtol=0)
        close(wide.meta.steps, narrow.meta.steps, f"launch {launch}, steps", atol=0, rtol=0)


def sm90_float_ops(kernel, num_hp, dtype, uniform):
    """The floating-point instructions (``fma.rn.f64``, ``cvt.rn.f32.f64``, ...) of ``kernel`` compiled ahead of
    time for an H100 (sm_90) over ``dtype`` buffers ("fp32" or "fp64") with a table of that dtype, GradScaler's
    unscaling and an active mask; a set of strings."""
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kernel, "fn", kernel)
    names = list(inspect.signature(fn).parameters)
    constexprs = dict(
        NUM_HP=num_hp, GRANULE=64, UNIFORM=uniform, BLOCK_SIZE=kernels.common.BLOCK_SIZE, STEP_BLOCK=STEP_BLOCK,
        HAS_ACTIVE=not uniform, HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, HAS_MOMENTUM=True, GATHER=0,
        MASTER=0, STOCHASTIC=False, QUANT=False,
    )  # fmt: skip
    ints = {"param_of_granule_ptr": "*i32", "param_group_ptr": "*i32", "counter_ptr": "*i32", "active_ptr": "*u8",
            "src_ptr": "*i64", "start_ptr": "*i64", "numel_ptr": "*i64"}  # fmt: skip
    f32 = {"step_ptr", "grad_scale_ptr", "found_inf_ptr"}  # float32 whatever the buffers' dtype
    signature = {}
    for n in names:
        if n in constexprs:
            signature[n] = "constexpr"
        elif n.endswith("_ptr"):
            signature[n] = ints.get(n) or ("*fp32" if n in f32 else f"*{dtype}")  # the table has the buffers' dtype
        else:
            signature[n] = "i64"
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items() if k in names})  # fmt: skip
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    return set(re.findall(r"\b(?:add|sub|mul|fma|div|sqrt|cvt|setp|neg|abs|rcp|max|min)(?:\.\w+)*\.f(?:32|64)\b", ptx))


def print_sm90_float_ops():
    """Run in a process without the interpreter: one JSON line per kernel, dtype and variant."""
    import json

    for name in OPTS:
        kernel = getattr(getattr(kernels, name), f"{name}_kernel")
        num_hp = OPTS[name]["rule"].num_hparams
        for dtype in ("fp32", "fp64"):
            for uniform in (True, False):
                ops = sorted(sm90_float_ops(kernel, num_hp, dtype, uniform))
                print(json.dumps(dict(name=name, dtype=dtype, uniform=uniform, ops=ops)))


def test_float64_kernels_compile_for_sm90_with_float64_math():
    """Compiled for an H100 on a machine without one: over float64 buffers the update math is float64 (float64
    arithmetic, nothing converted down to float32: only the float32 step counts and grad scale are converted up),
    and over float32 buffers it has no float64 instruction at all, as before float64 was supported."""
    from conftest import json_lines_without_interpreter

    pytest.importorskip("triton.compiler", reason="this triton has no ahead-of-time compile API")
    results, run = json_lines_without_interpreter("test_kernels", "print_sm90_float_ops")
    assert len(results) == len(OPTS) * 4, run.stdout + run.stderr[-4000:]
    for r in results:
        ops, what = set(r["ops"]), f"{r['name']} {r['dtype']} uniform={r['uniform']}: {r['ops']}"
        f64 = {op for op in ops if op.endswith(".f64")}
        if r["dtype"] == "fp32":
            assert not f64, what
            continue
        assert {"fma.rn.f64", "mul.f64"} <= ops, what
        assert not {op for op in ops if op.startswith("cvt") and ".f32.f64" in op}, what  # nothing narrowed
        if r["name"] == "adamw":
            assert {"sqrt.rn.f64", "div.rn.f64"} <= ops, what
