"""How gradients reach the step on the CPU (flatopt.grads.GradLanding.copy_on_cpu and direct_on_cpu off, as
outside the tests).

No hook copies a gradient of its own into the flat buffer as it arrives: ``.grad`` holds autograd's tensor, also
after ``step()``, which copies the small ones into their slots with one batched copy and steps the others where
they lie (``IN_PLACE_MIN`` elements and more). No layer is covered by default; with ``direct_grads=True`` covered
layers write into the buffer. Checked against torch.optim's fused CPU kernels (and the Lion reference) over many
steps, with accumulation, ``zero_grad(set_to_none=False)``, a parameter without a gradient, clipping (flatopt's
and torch's), GradScaler's arguments and a master-weight buffer.
"""

import pytest
import torch
from conftest import TOL, LionReference
from torch import nn

import flatopt
from flatopt.engines.step import IN_PLACE_MIN

pytestmark = pytest.mark.cpu_gradient_policy


class Model(nn.Module):
    """A Linear (covered with direct_grads=True), a large weight of its own (read in place) and a small bias (copied
    in). ``width`` 400: the weight of its own has 160,000 elements."""

    def __init__(self, dtype=torch.float32, seed=0, width=400):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(8, width).to(dtype)
        self.mix = nn.Parameter((torch.randn(width, width, generator=gen) * 0.05).to(dtype))
        self.shift = nn.Parameter((torch.randn(width, generator=gen) * 0.1).to(dtype))
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(width, 8, generator=gen) * 0.3)
            self.proj.bias.zero_()

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return (torch.tanh(h @ self.mix + self.shift) ** 2).mean()


assert Model().mix.numel() >= IN_PLACE_MIN > Model().shift.numel()

PAIRS = {
    "adamw": (flatopt.AdamW, lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw), dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (flatopt.SGD, lambda ps, **kw: torch.optim.SGD(ps, fused=True, **kw), dict(lr=0.05, momentum=0.9)),
    "lion": (flatopt.Lion, LionReference, dict(lr=1e-3, weight_decay=0.1)),
}


def batches(n, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=gen).to(device) for _ in range(n)]


def device_of(model):
    return next(model.parameters()).device


def close(a, b, what, **tol):
    torch.testing.assert_close(a, b, **(tol or TOL[torch.float32]), msg=lambda m: f"{what}: {m}")


def check_same(m1, o1, m2, o2, step):
    """Parameters, gradients and every state tensor of (model, optimizer) ``m1, o1`` against ``m2, o2``'s."""
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        close(a, b, f"step {step}, {n}")
        close(a.grad, b.grad, f"step {step}, {n}.grad")
    for a, b in zip(m1.parameters(), m2.parameters()):
        for key, value in o2.state[b].items():
            if torch.is_tensor(value) and value.numel() > 1:
                close(o1.state[a][key], value, f"step {step}, state {key}")


def in_buffer(opt, t):
    """Whether ``t`` lies in one of ``opt``'s flat gradient buffers."""
    from benchmarks.harness import internals

    for buf in internals(opt).buffers:
        lo = buf.grad.data_ptr()
        if lo <= t.data_ptr() < lo + buf.grad.numel() * buf.grad.element_size():
            return True
    return False


@pytest.mark.parametrize("direct", [None, True], ids=["default", "direct_grads"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_large_gradients_are_stepped_where_autograd_left_them(name, direct):
    """By default no layer is covered on the CPU (the Linear's gradients are autograd's tensors, read or gathered
    by step()); with direct_grads=True the Linear writes into the buffer. Either way: torch.optim's numbers."""
    ours_cls, theirs_cls, kw = PAIRS[name]
    m1, m2 = Model(), Model()
    mine = {} if direct is None else dict(direct_grads=direct)  # the default: the keyword left out
    o1, o2 = ours_cls(m1, **kw, **mine), theirs_cls(list(m2.parameters()), **kw)
    assert o1.backend == "cpu"
    assert ("_compiled_call_impl" in m1.proj.__dict__) is bool(direct), "covered only when asked for"
    for step, x in enumerate(batches(12)):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).backward()
        mix_grad, shift_grad = m1.mix.grad, m1.shift.grad
        assert not in_buffer(o1, mix_grad) and not in_buffer(o1, shift_grad)  # no hook copied them
        # a covered layer writes there; an uncovered one's gradient is autograd's tensor, copied by step()
        assert in_buffer(o1, m1.proj.weight.grad) is bool(direct)
        for o in (o1, o2):
            o.step()
        assert m1.mix.grad is mix_grad, "the large gradient stays autograd's tensor"
        assert m1.shift.grad is shift_grad, "the small one, copied into its slot, stays in .grad too"
        check_same(m1, o1, m2, o2, step)


def check_accumulation(name, make, model=None):
    """Two micro-batches per step (autograd adds the second into the tensor it made), steps without zero_grad()
    (the same gradients read again), zero_grad(set_to_none=False) (every .grad a zeroed view, added into), and a
    parameter whose gradient is None (not stepped, as torch.optim): ``make(cls, model, **kw)`` builds flatopt's
    optimizer, ``model()`` the model (this file's Model)."""
    ours_cls, theirs_cls, kw = PAIRS[name]
    model = model or Model
    m1, m2 = model(), model()
    o1, o2 = make(ours_cls, m1, **kw), theirs_cls(list(m2.parameters()), **kw)
    xs = batches(16, device=device_of(m1))
    for step in range(8):
        for m, o in ((m1, o1), (m2, o2)):
            if step % 4 != 3:  # every fourth step reads the last gradients again
                o.zero_grad(set_to_none=step % 4 != 2)
                m(xs[2 * step]).backward()
                m(xs[2 * step + 1]).backward()
            if step == 5:
                m.shift.grad = None
            o.step()
        for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
            close(a, b, f"step {step}, {n}")


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_accumulation_zeroing_and_a_missing_gradient(name):
    check_accumulation(name, lambda cls, m, **kw: cls(m, **kw))


def check_clipping(use, make, model=None):
    """opt.clip_grad_norm_() copies the gradients into the buffer first; torch.nn.utils.clip_grad_norm_ scales
    autograd's tensors, which the step then reads (``make`` and ``model``: as check_accumulation's)."""
    ours_cls, theirs_cls, kw = PAIRS["adamw"]
    model = model or Model
    m1, m2 = model(), model()
    o1, o2 = make(ours_cls, m1, **kw), theirs_cls(list(m2.parameters()), **kw)
    for step, x in enumerate(batches(6, device=device_of(m1))):
        norms = []
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            (m(x) * 50.0).backward()
            if use == "flatopt" and o is o1:
                norms.append(o.clip_grad_norm_(0.5))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            o.step()
        assert norms[1] > 0.5, "the gradients are clipped"
        close(norms[0], norms[1], f"step {step}, norm")
        for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
            close(a, b, f"step {step}, {n}")


@pytest.mark.parametrize("use", ["flatopt", "torch"])
def test_clipping_sees_the_gradients_where_they_lie(use):
    check_clipping(use, lambda cls, m, **kw: cls(m, **kw))


def check_grad_scale(m1, o1, dtype=torch.float32):
    """GradScaler's arguments (as torch's fused optimizers take them) given to ``o1``, which steps ``m1``: found_inf
    skips the step and leaves .grad scaled; otherwise the step divides by grad_scale and leaves the unscaled
    gradients in .grad, autograd's tensors included."""
    x = batches(1, device=device_of(m1))[0].to(dtype)
    o1.zero_grad()
    (m1(x) * 8.0).backward()
    scaled = {n: p.grad.clone() for n, p in m1.named_parameters()}
    before = {n: p.detach().clone() for n, p in m1.named_parameters()}
    o1.grad_scale, o1.found_inf = torch.tensor(8.0), torch.tensor(1.0)
    o1.step()
    for n, p in m1.named_parameters():
        assert torch.equal(p, before[n]) and torch.equal(p.grad, scaled[n]), f"{n}: found_inf skips"
    o1.grad_scale, o1.found_inf = torch.tensor(8.0), torch.tensor(0.0)
    o1.step()
    for n, p in m1.named_parameters():
        close(p.grad.float(), scaled[n].float() / 8.0, f"{n}.grad unscaled", atol=0, rtol=0)
        assert not torch.equal(p, before[n]), f"{n} stepped"


@pytest.mark.parametrize("master", [None, "remainder"])
def test_grad_scale_leaves_the_unscaled_gradient_in_grad(master):
    """With a master-weight buffer (stepped by the reference on the CPU) too."""
    dtype = torch.bfloat16 if master else torch.float32
    m1 = Model(dtype)
    check_grad_scale(m1, flatopt.AdamW(m1, lr=1e-2, **({"master_weights": master} if master else {})), dtype)


def test_low_precision_sgd_and_lion_step_gradients_in_place():
    """bfloat16 buffers: SGD's addcmul path and Lion's chunks over a piece cut around a gradient read in place."""
    for ours_cls, _, kw in (PAIRS["sgd"], PAIRS["lion"]):
        m1, m2 = Model(torch.bfloat16), Model(torch.bfloat16)
        o1 = ours_cls(m1, **kw)
        o2 = ours_cls(m2, **kw, backend="torch")  # the reference: every gradient gathered into the buffer
        for step, x in enumerate(batches(3)):
            for m, o in ((m1, o1), (m2, o2)):
                o.zero_grad()
                m(x.bfloat16()).backward()
            mix_grad = m1.mix.grad
            o1.step()
            o2.step()
            assert m1.mix.grad is mix_grad
            for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
                close(a.float(), b.float(), f"{ours_cls.__name__} step {step}, {n}", atol=2**-7, rtol=1.6e-2)
                with torch.no_grad():
                    b.copy_(a)  # one step's roundings each time


def test_the_first_pass_hooks_leave_nothing_behind():
    """Until the first step a hook per parameter records which ones received a gradient; after it, an uncovered
    parameter carries no hook table at all (an emptied table would still cost autograd a call into Python per
    parameter per backward), while hooks of the caller's stay and run."""
    model = Model()
    calls = []
    model.shift.register_hook(lambda g: calls.append("shift"))  # the caller's: kept
    opt = flatopt.SGD(model, lr=0.1, direct_grads=True)  # proj covered: its hooks are of another kind
    for _ in range(2):
        opt.zero_grad()
        model(batches(1)[0]).backward()
        opt.step()
    assert calls == ["shift", "shift"]
    assert model.mix._backward_hooks is None and model.mix._post_accumulate_grad_hooks is None
    assert len(model.shift._backward_hooks) == 1 and model.shift._post_accumulate_grad_hooks is None
    for p in model.proj.parameters():  # covered: a post-accumulate-grad hook, whose emptied table torch keeps
        assert p._backward_hooks is None and not p._post_accumulate_grad_hooks


@pytest.mark.parametrize("direct", [None, False, True])
def test_direct_grads_given_explicitly(direct):
    """direct_grads=None is the default (nothing covered on the CPU), False covers nothing, True covers the Linear;
    None is accepted in every mode, as a default forwarded by a configuration layer would be."""
    model = Model()
    opt = flatopt.AdamW(model, direct_grads=direct)  # kept: an optimizer collected takes its patches along
    assert ("_compiled_call_impl" in model.proj.__dict__) is bool(direct)
    del opt
    for kw in (dict(in_backward=True), dict(flat=False)):
        flatopt.AdamW(Model(), direct_grads=None, **kw)  # the default, spelled out
        with pytest.raises(ValueError, match="direct_grads applies to step mode with flat=True"):
            flatopt.AdamW(Model(), direct_grads=True, **kw)


def test_the_default_covers_the_layers_whose_slots_are_on_a_gpu():
    """LandingSlots.install(cpu=False), what direct_grads=None does on the CPU's policy: a layer whose weight's slot
    is on the CPU is left to torch, one on another device is covered (the buffer's device faked here: the CPU
    tests have no GPU)."""
    from flatopt.landing import LandingSlots
    from flatopt.layout import FlatBuffer

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    bufs = [FlatBuffer(list(m.parameters()), [0, 0], grad=True) for m in model]
    slots = LandingSlots(bufs)
    slots._on_cpu[1] = False  # as if the second layer's buffer were on a GPU
    try:
        assert slots.install(model, cpu=False) == ["1"]
        assert set(slots.covered) == set(model[1].parameters())
    finally:
        slots.uninstall()
    assert slots.install(model, cpu=True) == ["0", "1"]
    slots.uninstall()


# ------------------------------------------------------------------------------------------------------ the lane
def lane_decisions(opt):
    """The CPU lane's answer at every step from now on (flatopt.engines.cpu_lane: True where it stepped)."""
    lane, answers = opt.engine.lane, []
    real = lane.step

    def step(eng, in_place_min):
        answers.append(real(eng, in_place_min))
        return answers[-1]

    lane.step = step
    return answers


def check_identical(m1, o1, m2, o2, step):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), f"step {step}: {n} differs"
    sd1, sd2 = o1.state_dict()["state"], o2.state_dict()["state"]
    for i, entry in sd2.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(sd1[i][key]), torch.as_tensor(value)), f"step {step}: {i} {key}"


# what a step does before step() (after zero_grad() and backward, but where it says otherwise), and whether the lane
# takes it: a first step (it names the parameters without a gradient), and any step that is not a loop's ordinary one,
# go the general way
EVENTS = [
    ("first step", False),
    ("ordinary", True),
    ("a parameter without a gradient", False),
    ("ordinary", True),  # the mask of the step before dropped
    ("zero_grad(set_to_none=False)", False),
    ("ordinary", True),
    ("opt.state cleared", False),
    ("ordinary", True),
    ("a gradient of other strides", False),
    ("a gradient set to a view of the buffer", False),
    ("a new learning rate", True),
    ("momentum turned on", True),  # SGD's momentum buffer allocated: the lane finds its rows again
    ("ordinary", True),
]


def lane_pair(name, variant, kw):
    """Two models and optimizers alike: float32 in one group, bfloat16, or float32 in two groups of other learning
    rates (several pieces per launch)."""
    ours_cls = PAIRS[name][0]
    out = []
    for _ in range(2):
        m = Model(dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
        if variant == "groups":
            groups = [{"params": [m.mix], "lr": kw["lr"] * 2}, {"params": [m.shift, *m.proj.parameters()]}]
            out.append((m, ours_cls(groups, **kw)))
        else:
            out.append((m, ours_cls(m, **kw)))
    return out


@pytest.mark.parametrize("variant", ["fp32", "bf16", "groups"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_the_lane_steps_as_the_general_step_does_and_leaves_it_the_rest(name, variant):
    """With the CPU lane and without it (the general step alone), the same loop gives the same parameters, states
    and gradients bit for bit: the lane steps a loop's ordinary steps (a new learning rate included) with the same
    pieces of the CPU backend, and leaves every other step to the general path. ``.grad`` stays autograd's tensor,
    and the version counters count each step, as in the general step."""
    _, _, kw = PAIRS[name]
    kw = dict(kw, momentum=0.0) if name == "sgd" else kw
    (m1, o1), (m2, o2) = lane_pair(name, variant, kw)
    x_dtype = next(m1.parameters()).dtype
    assert o1.engine.lane is not None
    o2.engine.lane = None
    answers = lane_decisions(o1)
    for step, ((event, _), x) in enumerate(zip(EVENTS, batches(len(EVENTS)))):
        grads, versions = [], []
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=event != "zero_grad(set_to_none=False)")
            m(x.to(x_dtype)).backward()
            if event == "a parameter without a gradient":
                m.shift.grad = None
            elif event == "opt.state cleared":
                o.state.clear()
            elif event == "a gradient of other strides":
                m.mix.grad = m.mix.grad.t().contiguous().t()
            elif event == "a gradient set to a view of the buffer":  # another parameter's slot, by hand
                m.shift.grad = flatopt.inspect(o).buffers[0].grad[: m.shift.numel()].view_as(m.shift)
            elif event == "a new learning rate":
                for group in o.param_groups:
                    group["lr"] *= 0.5
            elif event == "momentum turned on" and name == "sgd":
                for group in o.param_groups:
                    group["momentum"] = 0.9
            before = [p.grad for p in m.parameters()]
            o.step()
            grads.append([p.grad is g for p, g in zip(m.parameters(), before)])
            versions.append([p._version for p in m.parameters()])
        check_identical(m1, o1, m2, o2, f"{step} ({event})")
        for a, b in zip(m1.parameters(), m2.parameters()):
            same = a.grad is None and b.grad is None or a.grad is not None and torch.equal(a.grad, b.grad)
            assert same, f"step {step} ({event}): .grad differs"
        assert grads[0] == grads[1] and versions[0] == versions[1], f"step {step} ({event})"
    assert answers == [lane for event, lane in EVENTS]


REFUSED = {
    "create_graph": "requires grad",
    "sparse": "sparse gradients",
    "dtype-large": r"\.grad of parameter 'mix' is torch\.float64 on cpu, the parameter torch\.float32",
    "dtype-small": r"\.grad of parameter 'shift' is torch\.float64 on cpu, the parameter torch\.float32",
}


@pytest.mark.parametrize("bad", list(REFUSED))
def test_the_lane_refuses_what_the_general_step_refuses_as_it_refuses_it(bad):
    """A sparse gradient, one with autograd history, or one of another dtype (its .data replaced: the .grad setter
    refuses that dtype), large (read in place) or small (copied in), after ordinary steps, in the step where a group
    turns SGD's momentum on: the lane leaves the step to the general path, which raises its error; both optimizers,
    with the lane and without it, are left alike and as they were (no momentum buffer allocated, the same
    parameters and state)."""
    pairs = []
    for lane in (True, False):
        m = Model()
        opt = flatopt.SGD(m, lr=1e-2, momentum=0.0)
        if not lane:
            opt.engine.lane = None
        for x in batches(3):
            opt.zero_grad()
            m(x).backward()
            opt.step()
        for group in opt.param_groups:
            group["momentum"] = 0.9
        opt.zero_grad()
        m(batches(1)[0]).backward(create_graph=bad == "create_graph")
        if bad == "sparse":
            m.shift.grad = m.shift.grad.to_sparse()
        elif bad.startswith("dtype"):
            p = m.mix if bad == "dtype-large" else m.shift
            p.grad.data = p.grad.double()
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(RuntimeError, match=REFUSED[bad]):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)), "a parameter changed"
        pairs.append((m, opt))
    (m1, o1), (m2, o2) = pairs
    check_identical(m1, o1, m2, o2, bad)
    states = [[list(b.states) for b in flatopt.inspect(o).buffers] for o in (o1, o2)]
    assert states[0] == states[1]


def test_step_counts_shared_after_a_step_go_on_counting():
    """``opt.state[p]["step"].share_memory_()`` (Hogwild-style sharing) moves the step counts' storage in place: the
    counts the CPU step reads and advances follow it."""
    m = Model()
    opt = flatopt.AdamW(m, lr=1e-2)
    for step, x in enumerate(batches(5)):
        opt.zero_grad()
        m(x).backward()
        opt.step()
        if step == 1:
            for p in m.parameters():
                opt.state[p]["step"].share_memory_()
    assert [float(opt.state[p]["step"]) for p in m.parameters()] == [5.0] * len(list(m.parameters()))


def test_the_lane_keeps_nothing_of_a_layout_it_left():
    """After add_param_group() lays the parameters out anew, the old buffers are freed (the lane held them)."""
    import gc
    import weakref

    m = Model()
    opt = flatopt.AdamW([m.mix, m.shift], lr=1e-2)
    answers = lane_decisions(opt)
    for x in batches(3):
        opt.zero_grad()
        m(x).backward()
        opt.step()
    assert answers[-1] is True
    old = weakref.ref(flatopt.inspect(opt).buffers[0].data)
    opt.add_param_group({"params": list(m.proj.parameters())})
    gc.collect()
    assert old() is None


def test_the_lane_looks_less_often_at_a_loop_it_cannot_take_and_comes_back():
    """A parameter that gets no gradient at every step: after MISSES steps the lane looks at the gradients only
    every EVERY-th step (the general step runs, with the general step's results); once every parameter has its
    gradient again, the lane takes the loop back within EVERY steps."""
    from flatopt.engines import cpu_lane

    m1, m2 = Model(), Model()
    o1, o2 = flatopt.AdamW(m1, lr=1e-2), flatopt.AdamW(m2, lr=1e-2)
    o2.engine.lane = None
    answers = lane_decisions(o1)
    looks = []
    real = cpu_lane.CpuLane._scan

    def scan(eng, rows, least):
        looks.append(eng.checked_steps)
        return real(eng, rows, least)

    o1.engine.lane._scan = scan
    unused, used = 40, 12
    for step, x in enumerate(batches(unused + used)):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).backward()
            if step < unused:
                m.shift.grad = None
            o.step()
        check_identical(m1, o1, m2, o2, step)
    every, misses = cpu_lane.EVERY, cpu_lane.MISSES
    first_looks = [s for s in looks if s < unused]
    assert len(first_looks) <= misses + unused // every + 1, looks
    assert not any(answers[:unused])
    back = answers.index(True, unused)
    assert back < unused + every and all(answers[back:]), answers
