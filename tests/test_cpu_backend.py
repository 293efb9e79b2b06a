"""The CPU backend (``backend="cpu"``, flatopt.cpu): torch's fused CPU kernels and chunked in-place code over the
flat buffers, one call per run of parameters sharing param group, step count and active flag.

* Launch by launch against the pure-torch reference (flatopt.reference, the ground truth), on buffers built by
  FlatBuffer: every optimizer and dtype (float32, bfloat16, float16, float64), one group or three with per-parameter
  step counts (first steps included), an active mask, grad_scale, found_inf (0, 1, NaN), a launch over a slice of
  the parameters (an in-backward bucket), gathered gradients (``sources=``). Chunks are made small (``CHUNK``
  patched to 256) so that pieces span several chunks and end inside one; one test runs the real chunk size.
  Each launch starts both sides from the same buffers, so the comparison is of one launch's roundings.
* ``flatopt.reference.runs``, which cuts a launch into pieces, against a per-element reading of the tables.
* The structure that makes it fast: one fused call per piece, so one per buffer for one param group.
* Optimizer level, many steps, against torch.optim (AdamW and SGD, fused=True: the same kernels; for bfloat16
  torch's fused SGD is not used, see below), the Lion reference of conftest, and backend="torch": several groups,
  parameters without gradients, GradScaler's found_inf and grad_scale.
* torch's fused CPU SGD for bfloat16/float16: whichever path ``fused_sgd_steps`` picks, the step matches the
  reference (above); and it recognises a kernel that leaves the parameters unchanged.
* The default backend (``"cpu"`` for CPU parameters) and the refusals (other devices, buffers it cannot step in
  place), which change nothing.

The optimizer-level tests of the other files (test_compat, test_optim_db, test_property, test_dtypes, ...) also
run with ``backend="cpu"`` through the ``backend`` fixture, and every test that does not name a backend steps with
it on the CPU.
"""

import pytest
import torch
from conftest import TOL, LionReference
from torch import nn

import flatopt
from flatopt import cpu, functional, layout, reference
from flatopt.layout import ALIGN, FlatBuffer, GradSources, StepMeta, compute_dtype
from flatopt.rules import ADAMW, LION, SGD

TOLS = {**TOL, torch.float64: dict(atol=1e-15, rtol=1e-13)}  # one launch: a rounding of float64 at most
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# sizes around the patched chunk (256) and the alignment granule (64), an empty parameter, a 0-dim one
SHAPES = [(37,), (5, 13), (0,), (300,), (), (700,), (64,), (3, 3, 3), (257,)]
GROUP_OF = [0, 1, 2, 0, 1, 2, 1, 0, 0]
STEPS = [0.0, 3.0, 1.0, 10.0, 0.0, 7.0, 2.0, 0.0, 0.0]  # zeros: SGD's first step sets the momentum buffer
ACTIVE = [1, 0, 1, 1, 0, 1, 1, 1, 0]
OPTS = {
    "adamw": (
        ADAMW,
        [
            dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, maximize=False),
            dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, maximize=True),
            dict(lr=5e-2, betas=(0.0, 0.5), eps=1e-3, weight_decay=0.5, maximize=False),
        ],
    ),
    "sgd": (
        SGD,
        [
            dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False),
            dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False, maximize=True),
            dict(lr=0.02, momentum=0.5, dampening=0.3, weight_decay=0.0, nesterov=False, maximize=False),
        ],
    ),
    # the groups bfloat16 and float16 SGD steps with addcmul (flatopt.cpu._sgd_low_precision): momentum with and
    # without weight decay, dampening (taken on first steps only), no momentum
    "sgd-momentum": (
        SGD,
        [
            dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False, maximize=False),
            dict(lr=0.05, momentum=0.8, dampening=0.5, weight_decay=0.0, nesterov=False, maximize=False),
            dict(lr=0.02, momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False, maximize=False),
        ],
    ),
    "lion": (
        LION,
        [
            dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=0.1),
            dict(lr=3e-2, betas=(0.95, 0.98), weight_decay=0.0),
            dict(lr=5e-2, betas=(0.5, 0.9), weight_decay=1.0),
        ],
    ),
}
VARIANTS = ["uniform", "groups-and-steps", "active", "grad_scale", "slice", "sources", "in-place", "no-momentum"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(cpu, "CHUNK", 256)


def rule_name(opt):
    """The launcher of an OPTS entry: ``sgd-momentum`` is SGD's."""
    return opt.split("-")[0]


def close(actual, expected, what, **tol):
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


class Case:
    """Flat buffers of SHAPES, their StepMeta and hyper-parameter table, and the launch's other arguments."""

    def __init__(self, opt, dtype, variant, seed=0, grad=True):
        rule, rows = OPTS[opt]
        uniform = variant in ("uniform", "grad_scale", "sources")
        gen = torch.Generator().manual_seed(seed)
        params = [torch.zeros(s, dtype=dtype) for s in SHAPES]
        states = () if variant == "no-momentum" else rule.state_names
        self.buf = b = FlatBuffer(params, [0] * len(SHAPES) if uniform else GROUP_OF, states, grad=grad)
        for i, s in enumerate(SHAPES):
            b.data_views[i].copy_(torch.randn(s, generator=gen))
            b.grad_views[i].copy_(torch.randn(s, generator=gen))
            for name, views in b.state_views.items():
                value = torch.randn(s, generator=gen)
                views[i].copy_(value.abs() * 0.01 if name == "exp_avg_sq" else value * 0.1)
        if variant == "no-momentum":
            rows = [{**g, "momentum": 0.0, "nesterov": False} for g in rows]
        self.rule, self.opt, self.dtype = rule, opt, dtype
        self.hparams = torch.tensor([rule.row(g) for g in rows], dtype=compute_dtype(dtype))
        b.meta.steps.copy_(torch.tensor([5.0] * len(SHAPES) if uniform else STEPS))
        b.meta.uniform = uniform
        if variant == "active":
            b.meta.active = torch.tensor(ACTIVE, dtype=torch.uint8)
        self.meta, self.span = b.meta, None
        if variant == "slice":  # parameters [2, 7): an in-backward bucket
            first, stop = 2, 7
            s, e = b.starts[first], b.starts[stop]
            self.meta = StepMeta(b.meta.param_of_granule[s // ALIGN : e // ALIGN], b.meta.param_group, b.meta.steps,
                                 b.meta.counter, first=first, stop=stop)  # fmt: skip
            self.span = (s, e)
        self.grad_scale = self.found_inf = None
        if variant in ("grad_scale", "sources", "in-place"):
            self.grad_scale, self.found_inf = torch.tensor([4.0]), torch.tensor([0.0])
        self.sources = None
        if variant in ("sources", "in-place"):  # every other gradient lies in a tensor of its own
            self.grads = [torch.randn(s, generator=gen).to(dtype) if i % 2 else None for i, s in enumerate(SHAPES)]
            # in-place: the backend may step from them where they lie (the reference gathers them all the same)
            self.sources = GradSources.of(b, self.grads, store=variant != "in-place")

    def tensors(self):
        b = self.buf
        out = [b.data, b.grad, *(b.states.get(n) for n in self.rule.state_names)]
        if self.span is not None:
            s, e = self.span
            out = [None if t is None else t[s:e] for t in out]
        return out

    def named(self):
        return dict(zip(["param", "grad", *self.rule.state_names], self.tensors()))

    def launch(self, backend, **kw):
        fn = getattr(functional, rule_name(self.opt))
        args = dict(hparams=self.hparams, meta=self.meta, grad_scale=self.grad_scale, found_inf=self.found_inf)
        fn(*self.tensors(), **{**args, **kw}, backend=backend, sources=self.sources)

    def clone(self):
        other = Case.__new__(Case)
        other.__dict__.update(self.__dict__)
        b = self.buf
        other.buf = FlatBuffer.__new__(FlatBuffer)
        other.buf.__dict__.update(b.__dict__)
        other.buf.data, other.buf.grad = b.data.clone(), b.grad.clone()
        other.buf.states = {k: v.clone() for k, v in b.states.items()}
        m = self.meta
        other.meta = StepMeta(m.param_of_granule, m.param_group, m.steps.clone(), m.counter.clone(), m.active,
                              m.uniform, m.first, m.stop)  # fmt: skip
        if self.sources is not None:
            other.grads = [None if g is None else g.clone() for g in self.grads]
            other.sources = GradSources.of(other.buf, other.grads, store=self.sources.store)
        return other

    def load(self, other):
        """Take ``other``'s buffer values and steps (and gradients of its sources)."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            if mine is not None:
                mine.copy_(theirs)
        self.meta.steps.copy_(other.meta.steps)
        if self.sources is not None:
            for mine, theirs in zip(self.grads, other.grads):
                if mine is not None:
                    mine.copy_(theirs)


# bfloat16 and float16 SGD through addcmul (flatopt.cpu._sgd_low_precision) rounds the momentum buffer before the
# parameters take it, as torch.optim's SGD does, where the reference rounds once: half a unit in the last place more,
# of values of magnitude up to about 2 here (absolute), which near a cancellation is any relative difference
LOW_PRECISION_SGD_TOL = {torch.bfloat16: dict(atol=2**-7, rtol=1.6e-2), torch.float16: dict(atol=2**-10, rtol=2e-3)}


def tolerance(opt, dtype):
    """The tolerance of a launch of ``opt`` (an OPTS key) over ``dtype`` buffers against the reference."""
    if opt == "sgd-momentum" and dtype in LOW_PRECISION_SGD_TOL:
        return LOW_PRECISION_SGD_TOL[dtype]
    return TOLS[dtype]


def compare(ours, ref, what):
    """``ours`` against ``ref`` (the reference, which gathers every source into the flat gradient buffer): a
    gradient ``ours`` read in place (``store=False``) is compared where it lies, and unscaled there."""
    tol = tolerance(ours.opt, ours.dtype)
    in_place = ours.sources is not None and not ours.sources.store
    for name, t in ours.named().items():
        if t is None:
            continue
        if name == "grad" and in_place:
            for i, (g, like) in enumerate(zip(ours.grads, ours.buf.like)):
                s, n = ours.buf.starts[i], like.numel()
                mine = t[s : s + n] if g is None else g.reshape(-1)
                close(mine, ref.buf.grad[s : s + n], f"{what}, gradient {i}", **tol)
            continue
        close(t, ref.named()[name], f"{what}, {name}", **tol)
    close(ours.meta.steps, ref.meta.steps, f"{what}, steps", atol=0, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt", list(OPTS))
def test_launches_match_the_reference(opt, dtype, variant):
    if variant == "no-momentum" and opt != "sgd":
        pytest.skip("only SGD has a state that a group may not use")
    ours = Case(opt, dtype, variant)
    ref = ours.clone()
    before = ours.meta.steps.clone()
    for launch in (1, 2, 3):
        if ours.sources is not None:  # new gradients in their own tensors at every launch
            for g in ours.grads:
                if g is not None:
                    g.copy_(torch.randn(g.shape, generator=torch.Generator().manual_seed(launch)))
            ref.load(ours)
        ours.launch("cpu")
        ref.launch("torch")
        compare(ours, ref, f"{opt} {dtype} {variant}, launch {launch}")
        ref.load(ours)
    active = torch.ones(len(SHAPES)) if ours.meta.active is None else ours.meta.active.float()
    if variant == "slice":
        active = torch.tensor([1.0 if 2 <= i < 7 else 0.0 for i in range(len(SHAPES))])
    close(ours.meta.steps, before + 3 * active, "steps after three launches", atol=0, rtol=0)


@pytest.mark.parametrize("found", [1.0, float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt", list(OPTS))
def test_found_inf_skips_the_launch(opt, dtype, found):
    """As the reference and torch's fused kernels: nothing changes, the gradient stays scaled, no step counts."""
    case = Case(opt, dtype, "grad_scale")
    case.found_inf = torch.tensor([found])
    before = [None if t is None else t.clone() for t in case.tensors()]
    steps = case.meta.steps.clone()
    case.launch("cpu")
    ref = Case(opt, dtype, "grad_scale")
    ref.found_inf = torch.tensor([found])
    ref.launch("torch")
    for t, old, r in zip(case.tensors(), before, ref.tensors()):
        if t is not None:
            assert torch.equal(t, old) and torch.equal(t, r)
    assert torch.equal(case.meta.steps, steps) and torch.equal(ref.meta.steps, steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opt", list(OPTS))
def test_real_chunk_size(opt, dtype, monkeypatch):
    """The chunk size the backend runs with, over buffers of several chunks (and a partial last one)."""
    monkeypatch.setattr(cpu, "CHUNK", 1 << 16)
    rule, rows = OPTS[opt]
    gen = torch.Generator().manual_seed(3)
    sizes = [150_001, 3, 70_000]
    buf = FlatBuffer([torch.zeros(n, dtype=dtype) for n in sizes], [0, 1, 0], rule.state_names)
    for t in (buf.data, buf.grad, *buf.states.values()):
        t.copy_(torch.randn(buf.numel, generator=gen).abs() * 0.01 if t is buf.states.get("exp_avg_sq") else
                torch.randn(buf.numel, generator=gen))  # fmt: skip
    for pad in buf.padding(buf.data) + buf.padding(buf.grad) + [p for s in buf.states.values() for p in buf.padding(s)]:
        pad.zero_()
    buf.meta.steps.fill_(2.0)
    buf.meta.uniform = False
    hparams = torch.tensor([rule.row(g) for g in rows[:2]])
    ours = [buf.data, buf.grad, *buf.states.values()]
    ref = [t.clone() for t in ours]
    ref_meta = StepMeta(buf.meta.param_of_granule, buf.meta.param_group, buf.meta.steps.clone(), buf.meta.counter)
    for launch in (1, 2):
        getattr(functional, rule_name(opt))(*ours, hparams=hparams, meta=buf.meta, backend="cpu")
        getattr(functional, rule_name(opt))(*ref, hparams=hparams, meta=ref_meta, backend="torch")
        for i, (a, b) in enumerate(zip(ours, ref)):
            close(a, b, f"launch {launch}, tensor {i}", **tolerance(opt, dtype))
            b.copy_(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opt", list(OPTS))
def test_gradients_read_in_place_are_not_copied_into_the_buffer(opt, dtype):
    """``store=False`` sources (step() reading autograd's gradients where they lie): the slots of those gradients in
    the flat buffer are never written, by any optimizer (NaN left there stays NaN, and no NaN reaches the
    parameters), chunks that span several gradients included; the results are the reference's."""
    ours = Case(opt, dtype, "in-place")
    ref = ours.clone()
    taken = [i for i, g in enumerate(ours.grads) if g is not None and g.numel() > 0]
    for i in taken:
        ours.buf.grad_views[i].fill_(float("nan"))
    ours.launch("cpu")
    ref.launch("torch")
    for i in taken:
        assert ours.buf.grad_views[i].isnan().all(), f"the slot of gradient {i}, read in place, was written"
        ours.buf.grad_views[i].copy_(ref.buf.grad_views[i])  # for compare(), which reads the others' slots
    compare(ours, ref, f"{opt} {dtype}, gradients read in place")


@pytest.mark.parametrize("scale", [None, 3.0], ids=["unscaled", "grad_scale"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_lion_rounds_as_documented_read_in_place_or_gathered(dtype, scale, monkeypatch):
    """16-bit Lion on the CPU: the sign of beta1 * m + (1 - beta1) * g in float32 with the rule's roundings (an exact
    cancellation gives no update), the parameter's update in float32 rounded once, the state one float32 ``lerp``
    rounded once; bit for bit, whether a chunk's gradient lies in one tensor (read there, the state interpolated in
    the buffers' dtype) or in several (gathered into float32 first). With a grad scale (not a power of two), the
    gradient unscaled in float32, not as the 16-bit value left where it lies."""
    monkeypatch.setattr(cpu, "CHUNK", 1 << 12)
    n = 10_000
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen).to(dtype)
    m = (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 2, (n,), generator=gen)).to(dtype)
    g = torch.randn(n, generator=gen).to(dtype)
    m[::5] = -g[::5]  # with beta1 = 1/2, beta1 * m + (1 - beta1) * g is exactly zero there
    h = dict(lr=1e-3, weight_decay=0.1, beta1=0.5, one_minus_beta1=0.5, one_minus_beta2=0.01)
    decay = (1.0 - torch.tensor(h["lr"]) * h["weight_decay"]).item()
    gf = g.float() if scale is None else g.float() / scale
    c = torch.sign(m.float() * 0.5 + 0.5 * gf)
    want_p = (p.float() * decay + (-h["lr"]) * c).to(dtype)
    want_m = m.float().lerp(gf, 0.01).to(dtype)
    cuts = [0, 1000, 5000, 5003, n]  # chunks inside one run, and chunks across runs
    for whole in (True, False):
        grads = [g.clone()] if whole else [g[a:b].clone() for a, b in zip(cuts, cuts[1:])]
        segments = [(0, n, grads[0])] if whole else [(a, b, t) for (a, b), t in zip(zip(cuts, cuts[1:]), grads)]
        p1, m1 = p.clone(), m.clone()
        cpu._lion_chunked(p1, m1, segments, h, None if scale is None else torch.tensor(scale))
        assert torch.equal(p1, want_p) and torch.equal(m1, want_m), f"{len(segments)} runs"
        assert torch.equal(torch.cat(grads), gf.to(dtype))  # the unscaled gradient left where it lies
    if scale is None:
        assert int((c == 0).sum()) >= n // 5  # the cancellations are there, and left the parameter as decayed


@pytest.mark.parametrize("opt", list(OPTS))
def test_a_launch_that_fails_counts_no_step(opt, monkeypatch):
    """A kernel that raises leaves the step counts as they were."""
    case = Case(opt, torch.float32, "groups-and-steps")
    before = case.meta.steps.clone()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    cpu.fused_sgd_steps(torch.float32)  # found once, before the kernel is broken (the answer is cached)

    for name in ("_fused_adamw_", "_fused_sgd_", "lerp", "mul", "addcmul"):  # the first call of each optimizer
        monkeypatch.setattr(torch, name, broken)
    monkeypatch.setattr(torch.Tensor, "addcmul_", broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        case.launch("cpu")
    assert torch.equal(case.meta.steps, before)


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("kept", [True, False], ids=["kept-grad", "released-grad"])
def test_runs_are_kept_for_the_next_step_with_its_gradients_in_the_same_places(opt, kept, monkeypatch):
    """A launch reading gradients in place finds its runs (their bounds and the slices of the gradient buffer
    between the gradients) again at the next step whose gradients of their own belong to the same parameters,
    new tensors as they are, where the gradient buffer is never released (its storage cannot be resized); with
    other parameters' gradients, or a buffer zero_grad() may release, they are made anew. The results are the
    reference's at every step."""
    if kept:  # the gradient buffer in a mapping of its own (flat_zeros), as the CPU's of 2 MiB and more
        monkeypatch.setattr(layout, "HUGE_PAGE", 1)
    ours = Case(opt, torch.float32, "in-place", grad="kept" if kept else True)
    assert ours.buf.grad.untyped_storage().resizable() is not kept
    ref = ours.clone()
    gen = torch.Generator().manual_seed(5)

    def entries():
        return {k: v for k, v in ours.meta.cuts.items() if k[0] == "segments"}

    for step, every in enumerate([2, 2, 3]):  # every other gradient in place twice, then every third
        ours.grads = [torch.randn(sh, generator=gen) if i % every else None for i, sh in enumerate(SHAPES)]
        ref.grads = [None if g is None else g.clone() for g in ours.grads]
        ours.sources = GradSources.of(ours.buf, ours.grads, store=False)
        ref.sources = GradSources.of(ref.buf, ref.grads, store=False)
        before = entries()
        ours.launch("cpu")
        ref.launch("torch")
        compare(ours, ref, f"{opt}, step {step}")
        ref.load(ours)
        after = entries()
        if not kept:
            assert not after
        elif step == 1:  # the same places: the entries of step 0 (one per piece), not made again
            assert after.keys() == before.keys() and all(after[k] is before[k] for k in after)
        else:
            assert len(after) > len(before) and all(after[k] is before[k] for k in before)


def test_the_checks_kept_keep_no_tensor_alive():
    """The tensors a launch was checked with are kept as weak references: a gradient the caller (or an in-backward
    bucket, or flat=False) drops after the launch is freed."""
    import gc
    import weakref

    case = Case("adamw", torch.float32, "uniform")
    grad = case.buf.grad.clone()
    dropped = weakref.ref(grad)
    functional.adamw(case.buf.data, grad, *case.buf.states.values(), hparams=case.hparams, meta=case.meta,
                     backend="cpu")  # fmt: skip
    del grad
    gc.collect()
    assert dropped() is None


def test_a_launch_with_other_tensors_than_the_last_is_checked_again():
    """The checks of a launch's buffers are skipped only for the very tensors that passed them last."""
    case = Case("adamw", torch.float32, "uniform")
    case.launch("cpu")
    assert case.meta.checked is not None
    spoiled = case.buf.data.clone().to(torch.float64)
    with pytest.raises(ValueError, match="every buffer of a launch has the parameters' dtype"):
        functional.adamw(case.buf.data, spoiled, *case.buf.states.values(), hparams=case.hparams, meta=case.meta,
                         backend="cpu")  # fmt: skip
    strided = torch.zeros(2 * case.buf.numel)[::2]
    with pytest.raises(ValueError, match="flat, contiguous 1-D buffers"):
        functional.adamw(strided, case.buf.grad, *case.buf.states.values(), hparams=case.hparams, meta=case.meta,
                         backend="cpu")  # fmt: skip


def test_slices_are_found_again_at_the_next_step_however_many_pieces(monkeypatch):
    """The parameters' and states' slices of each piece are kept for the next step (one lookup per piece), also when
    per-parameter step counts cut a buffer into hundreds of pieces, and the slices kept stay within SLICES_MAX."""
    n = 300
    buf = FlatBuffer([torch.zeros(64) for _ in range(n)], [0] * n, ADAMW.state_names)
    buf.grad.normal_()
    buf.meta.steps.copy_(torch.arange(n) % 2)  # every parameter a piece of its own
    buf.meta.uniform = False
    hparams = torch.tensor([ADAMW.row(OPTS["adamw"][1][0])])

    def launch():
        functional.adamw(buf.data, buf.grad, *buf.states.values(), hparams=hparams, meta=buf.meta, backend="cpu")

    launch()
    kept = {k: v[1] for k, v in buf.meta.cuts.items()}
    assert len(kept) == n and buf.meta.cut_slices == 3 * n
    launch()
    assert {k: v[1] for k, v in buf.meta.cuts.items()} == kept  # the same lists: none made again
    assert all(buf.meta.cuts[k][1] is v for k, v in kept.items())
    monkeypatch.setattr(cpu, "SLICES_MAX", 100)
    buf.meta.steps.copy_(torch.arange(n) // 2 % 2)  # pieces of two parameters: new entries, kept to 100 slices
    for _ in range(2):
        launch()
        assert 0 < buf.meta.cut_slices <= 100 and buf.meta.cut_slices == 3 * len(buf.meta.cuts)


# ------------------------------------------------------------------------------------------------ pieces
def runs_by_element(meta, numel):
    """``reference.runs`` spelled out element by element: each element's parameter, group, steps, flag."""
    owner = torch.repeat_interleave(meta.param_of_granule.long(), ALIGN)[:numel]
    out = []
    for i, p in enumerate(owner.tolist()):
        on = meta.active is None or bool(meta.active[p])
        key = (int(meta.param_group[p]), float(meta.steps[p]), on, p)
        if out and out[-1][1] == key[:3] and out[-1][2] == i:
            out[-1][2] = i + 1
        else:
            out.append([i, key[:3], i + 1])
    return [(s, e, k[0], k[1]) for s, k, e in out if k[2]]


def test_runs_cut_a_launch_where_group_steps_or_flag_change():
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 14, (), generator=gen))
        sizes = [int(x) for x in torch.randint(0, 140, (n,), generator=gen)]
        groups = [int(x) for x in torch.randint(0, 3, (n,), generator=gen)]
        buf = FlatBuffer([torch.zeros(s) for s in sizes], groups, grad=False)
        buf.meta.steps.copy_(torch.randint(0, 2, (n,), generator=gen).float())
        if trial % 2:
            buf.meta.active = torch.randint(0, 2, (n,), generator=gen).to(torch.uint8)
        buf.meta.uniform = False
        got = reference.runs(buf.meta, buf.numel)
        assert [(s, e, g, st) for s, e, g, st in got] == runs_by_element(buf.meta, buf.numel), (sizes, groups)
        if n > 2:  # a slice of the parameters, as an in-backward bucket launches
            first, stop = 1, n - 1
            s, e = buf.starts[first], buf.starts[stop]
            meta = StepMeta(buf.meta.param_of_granule[s // ALIGN : e // ALIGN], buf.meta.param_group, buf.meta.steps,
                            buf.meta.counter, buf.meta.active, first=first, stop=stop)  # fmt: skip
            assert reference.runs(meta, e - s) == runs_by_element(meta, e - s), (sizes, groups)


@pytest.mark.parametrize("opt, kernel", [("adamw", "_fused_adamw_"), ("sgd", "_fused_sgd_")])
def test_one_fused_call_per_piece(opt, kernel, monkeypatch):
    """A buffer of one param group takes one call of torch's fused kernel whatever its number of parameters (torch's
    fused optimizers loop over the tensors); two groups alternating take one per run."""
    calls = []
    real = getattr(torch, kernel)

    def counted(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    cpu.fused_sgd_steps(torch.float32)  # found once, before counting
    monkeypatch.setattr(torch, kernel, counted)
    make = {"adamw": lambda g: flatopt.AdamW(g), "sgd": lambda g: flatopt.SGD(g, lr=0.1, momentum=0.9)}[opt]

    def fresh():
        params = [nn.Parameter(torch.randn(7)) for _ in range(300)]
        for p in params:
            p.grad = torch.randn(7)
        return params

    o = make(fresh())
    assert o.backend == "cpu"
    o.step()
    assert calls == [1]
    calls.clear()
    params = fresh()
    make([{"params": params[0::2]}, {"params": params[1::2], "weight_decay": 0.5}]).step()
    assert calls == [1, 1]  # the layout puts each group's parameters together
    calls.clear()
    params = fresh()
    o3 = make([{"params": params[:150]}, {"params": params[150:], "weight_decay": 0.5}])
    params[3].grad = None  # the run is cut around a parameter that is not stepped
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) received no gradient before the first step"):
        o3.step()
    assert calls == [1, 1, 1]


# ------------------------------------------------------------------------------------------- optimizers
def model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(23, 67), nn.Tanh(), nn.Linear(67, 300), nn.Tanh(), nn.Linear(300, 5)).to(dtype)


def groups_of(m, **second):
    return [
        {"params": [m[0].weight, m[2].weight, m[4].weight]},
        {"params": [m[0].bias, m[2].bias, m[4].bias], **second},
    ]


CONFIGS = {
    "adamw": (flatopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, eps=1e-6), dict(lr=3e-3)),
    "adamw-maximize": (flatopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.9), maximize=True),
                       dict(weight_decay=0.0)),
    "sgd-nesterov": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                     dict(lr=0.01)),
    "sgd-dampening": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, maximize=True),
                      dict(momentum=0.0)),
    "sgd-plain": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, weight_decay=0.1), dict(lr=0.02)),
    "sgd-momentum": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01),
                     dict(weight_decay=0.0)),
    "lion": (flatopt.Lion, LionReference, dict(lr=1e-3, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0)),
}  # fmt: skip


def torch_kwargs(name, dtype):
    """torch.optim's fused kernels, as flatopt's: for low precision its math in float32, rounded once. Not torch's
    fused SGD for bfloat16/float16, which leaves most parameters unchanged in torch 2.13 (see flatopt.cpu):
    foreach, which rounds every operation to bfloat16, with the looser tolerance below."""
    if name == "lion":
        return {}
    if name.startswith("sgd") and dtype in (torch.bfloat16, torch.float16) and not cpu.fused_sgd_steps(dtype):
        return dict(foreach=True)
    return dict(fused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_many_steps_match_torch_optim_and_the_torch_backend(name, dtype):
    """30 steps of a small MLP with two param groups; some steps lose the gradient of a parameter (not stepped, as
    torch.optim does) and one is skipped by found_inf through GradScaler's arguments. float32 and float64 follow
    their own trajectories; bfloat16 ones (where one rounding changes the next forward pass) restart every step from
    the CPU backend's values."""
    ours_cls, theirs_cls, kw, second = CONFIGS[name]
    m_cpu, m_torch, m_ref = model(dtype), model(dtype), model(dtype)
    o_cpu = ours_cls(groups_of(m_cpu, **second), **kw)
    o_torch = ours_cls(groups_of(m_torch, **second), **kw, backend="torch")
    o_ref = theirs_cls(groups_of(m_ref, **second), **kw, **torch_kwargs(name, dtype))
    assert o_cpu.backend == "cpu"
    scaled = name != "lion" and "foreach" not in torch_kwargs(name, dtype)  # GradScaler's arguments: fused only
    gen = torch.Generator().manual_seed(1)
    # torch.optim's foreach and the Lion reference round every operation to bfloat16, flatopt once
    looser = dtype == torch.bfloat16 and (name == "lion" or "foreach" in torch_kwargs(name, dtype))
    tol = dict(atol=1e-2, rtol=5e-2) if looser else TOL[dtype]
    for step in range(30):
        x = torch.randn(9, 23, generator=gen).to(dtype)
        for m, o in ((m_cpu, o_cpu), (m_torch, o_torch), (m_ref, o_ref)):
            o.zero_grad()
            loss = m(x).square().mean() * (-1.0 if kw.get("maximize") else 1.0)  # a maximum to climb to
            (loss * 8.0 if scaled else loss).backward()
            if step % 7 == 3:
                m[2].bias.grad = None
            if scaled:
                o.grad_scale = torch.tensor(8.0)
                o.found_inf = torch.tensor(1.0 if step == 11 else 0.0)
            o.step()
        for (n, a), b, c in zip(m_cpu.named_parameters(), m_torch.parameters(), m_ref.parameters()):
            close(a, b, f"step {step}, {n} against backend='torch'", **TOL[dtype])
            close(a, c, f"step {step}, {n} against {theirs_cls.__name__}", **tol)
            if a.grad is not None:
                close(a.grad, c.grad, f"step {step}, {n}.grad (unscaled)", atol=1e-4, rtol=1e-2)
        for a, b, c in zip(m_cpu.parameters(), m_torch.parameters(), m_ref.parameters()):
            for key, value in o_ref.state.get(c, {}).items():
                if torch.is_tensor(value) and value.numel() > 1:
                    close(o_cpu.state[a][key], o_torch.state[b][key], f"step {step}, state {key}", **TOL[dtype])
                    close(o_cpu.state[a][key], value, f"step {step}, state {key}", **tol)
                elif key == "step":
                    assert float(o_cpu.state[a][key]) == float(value), f"step {step}: step count"
        if dtype == torch.bfloat16:  # every step from the same values, as test_dtypes steps: one step's roundings
            with torch.no_grad():
                for a, b, c in zip(m_cpu.parameters(), m_torch.parameters(), m_ref.parameters()):
                    b.copy_(a)
                    c.copy_(a)
                    for key, value in o_ref.state.get(c, {}).items():
                        if torch.is_tensor(value) and value.numel() > 1:
                            value.copy_(o_cpu.state[a][key])
                            o_torch.state[b][key].copy_(o_cpu.state[a][key])


def test_in_backward_mode_steps_as_step_mode():
    """In-backward mode launches the CPU backend over buckets (slices of the buffer) as their gradients arrive."""
    m1, m2 = model(torch.float32), model(torch.float32)
    o1 = flatopt.AdamW(groups_of(m1, lr=3e-3), lr=1e-2, weight_decay=0.1)
    o2 = flatopt.AdamW(groups_of(m2, lr=3e-3), lr=1e-2, weight_decay=0.1, in_backward=True, bucket_size=500)
    assert o1.backend == o2.backend == "cpu"
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        x = torch.randn(9, 23, generator=gen)
        o1.zero_grad()
        m1(x).square().mean().backward()
        o1.step()
        m2(x).square().mean().backward()
        o2.step()  # in-backward mode: ends the optimizer step the backward pass already applied
        for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
            close(b, a, f"step {step}, {n}", **TOL[torch.float32])


# ------------------------------------------------------------------------------------------ torch's SGD
@pytest.mark.parametrize("first", [False, True], ids=["later", "first-step"])
@pytest.mark.parametrize("wd", [0.0, 0.01], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_sgd_rounds_as_documented(dtype, wd, first):
    """_sgd_low_precision's roundings, element by element: the buffer ``g + momentum * buf`` (``g`` on a first
    step) rounded, then ``+ weight_decay * p`` rounded, then ``p - lr * buf`` rounded, each computed in float32 with
    float32 scalars (a momentum of 0.9 rounded to bfloat16 would be 0.8984 and miss almost every element)."""
    gen = torch.Generator().manual_seed(5)
    p, g, b = (torch.randn(4099, generator=gen).to(dtype) for _ in range(3))
    lr, momentum = 0.01, 0.9
    b1 = g.float() if first else g.float() + momentum * b.float()
    b1 = b1.to(dtype)
    b2 = (b1.float() + wd * p.float()).to(dtype) if wd else b1
    p2 = (p.float() + (-lr) * b2.float()).to(dtype)
    h = dict(lr=lr, weight_decay=wd, one_minus_dampening=1.0, nesterov=0.0, grad_sign=1.0, momentum=momentum)
    assert cpu._low_precision_steps(h, momentum, first, None)
    cpu._sgd_low_precision(p, g, b, h, momentum, first)
    assert torch.equal(b, b2)
    assert torch.equal(p, p2)


def test_low_precision_sgd_takes_the_groups_it_can(monkeypatch):
    """bfloat16 SGD with momentum (with or without weight decay), or with neither momentum nor weight decay, steps
    through addcmul; dampening after the first step, Nesterov momentum, maximize, grad_scale and weight decay without
    momentum go through the float32 copies, which round once."""
    taken = []
    real = cpu._sgd_low_precision
    monkeypatch.setattr(cpu, "_sgd_low_precision", lambda *a: taken.append(round(a[3]["lr"], 3)) or real(*a))
    params = [nn.Parameter(torch.randn(70).bfloat16()) for _ in range(7)]
    groups = [
        dict(lr=0.1, momentum=0.9),
        dict(lr=0.2, momentum=0.9, weight_decay=0.01),
        dict(lr=0.3),
        dict(lr=0.4, momentum=0.9, dampening=0.5),  # taken on the first step only
        dict(lr=0.5, momentum=0.9, nesterov=True),
        dict(lr=0.6, momentum=0.9, maximize=True),
        dict(lr=0.7, weight_decay=0.01),
    ]
    opt = flatopt.SGD([{"params": [p], **kw} for p, kw in zip(params, groups)], lr=1.0)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(70).bfloat16()
        taken.clear()
        opt.step()
        assert sorted(taken) == ([0.1, 0.2, 0.3, 0.4] if step == 0 else [0.1, 0.2, 0.3]), step


def test_fused_sgd_check_recognises_a_kernel_that_leaves_the_parameters(monkeypatch):
    """fused_sgd_steps compares torch's kernel with the rule's math: a kernel that stores nothing is refused, one that
    computes the rule is taken; where none is taken for the buffers nor for float32, the launch is the reference's."""

    def by_the_rule(params, grads, bufs, *, momentum, dampening, weight_decay, lr, nesterov, maximize,
                    is_first_step, grad_scale=None, found_inf=None):  # fmt: skip
        p, g, b = params[0], grads[0], bufs[0]
        hp = dict(lr=lr, momentum=momentum, one_minus_dampening=1 - dampening, weight_decay=weight_decay,
                  nesterov=float(nesterov), grad_sign=-1.0 if maximize else 1.0)  # fmt: skip
        hp = {k: torch.tensor(v) for k, v in hp.items()}
        new_p, new_b = SGD.math(
            p.float(), g.float(), b.float(), steps=torch.tensor(0.0 if is_first_step else 1.0), **hp
        )
        p.copy_(new_p)
        b.copy_(new_b)

    cpu.fused_sgd_steps.cache_clear()
    try:
        monkeypatch.setattr(torch, "_fused_sgd_", lambda params, grads, bufs, **kw: None)
        assert not cpu.fused_sgd_steps(torch.float32) and not cpu.fused_sgd_steps(torch.bfloat16)
        ours, ref = Case("sgd", torch.bfloat16, "groups-and-steps"), Case("sgd", torch.bfloat16, "groups-and-steps")
        ours.launch("cpu")
        ref.launch("torch")
        compare(ours, ref, "no fused kernel taken")
        cpu.fused_sgd_steps.cache_clear()
        monkeypatch.setattr(torch, "_fused_sgd_", by_the_rule)
        assert cpu.fused_sgd_steps(torch.bfloat16)
    finally:
        cpu.fused_sgd_steps.cache_clear()


# ---------------------------------------------------------------------------------- default and refusals
def test_the_default_on_the_cpu_is_the_cpu_backend():
    for make in (flatopt.AdamW, flatopt.SGD, flatopt.Lion):
        assert make(nn.Linear(3, 2)).backend == "cpu"
        assert make(nn.Linear(3, 2), flat=False).backend == "cpu"
        assert make(nn.Linear(3, 2), backend="torch").backend == "torch"


def test_cpu_backend_refuses_parameters_on_other_devices():
    meta = [nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match=r"backend='cpu' runs on CPU tensors, and some parameters are on meta; use"):
        flatopt.AdamW(meta, flat=False, backend="cpu")
    assert flatopt.AdamW(meta, flat=False).backend == "torch"  # the default elsewhere than CPU and CUDA


@pytest.mark.requires_cuda
def test_cpu_backend_refuses_cuda_parameters():
    model_ = nn.Linear(3, 2).cuda()
    before = [p.detach().clone() for p in model_.parameters()]
    with pytest.raises(ValueError, match=r"backend='cpu' runs on CPU tensors, and some parameters are on cuda:0"):
        flatopt.AdamW(model_, backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model_.parameters(), before))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda t: t.view(-1, 2)[:, 0], r"flat, contiguous 1-D buffers in place; grad has shape \(\d+,\) and strides"),
        (lambda t: t.reshape(2, -1), r"grad has shape \(2, \d+\)"),
        (lambda t: t.double(), r"grad is torch.float64 of \d+ elements, the parameters torch.float32"),
        (lambda t: t[:-64], r"grad is torch.float32 of \d+ elements, the parameters torch.float32 of \d+"),
    ],
    ids=["strided", "2-d", "dtype", "length"],
)
@pytest.mark.parametrize("opt", list(OPTS))
def test_a_buffer_it_cannot_step_in_place_is_refused_before_anything_changes(opt, spoil, message):
    case = Case(opt, torch.float32, "groups-and-steps")
    tensors = case.tensors()
    before = [t.clone() for t in tensors] + [case.meta.steps.clone()]
    bad = spoil(tensors[1])
    with pytest.raises(ValueError, match=message):
        getattr(cpu, f"{rule_name(opt)}_step")(tensors[0], bad, *tensors[2:], hparams=case.hparams, meta=case.meta)
    for old, new in zip(before, tensors + [case.meta.steps]):
        assert torch.equal(old, new)


@pytest.mark.requires_cuda
def test_a_buffer_on_another_device_is_refused():
    case = Case("adamw", torch.float32, "uniform")
    p, g, m, v = case.tensors()
    with pytest.raises(ValueError, match=r"backend='cpu' steps CPU tensors, and grad is on cuda"):
        cpu.adamw_step(p, g.cuda(), m, v, hparams=case.hparams, meta=case.meta)
