"""``direct_grads="gather"``: no layer is covered and no hook copies a gradient in, on any device; ``step()`` reads
every gradient where autograd left it (the Triton kernel gathers them through a table of addresses and stores none
into the flat gradient buffer, which stays released), as the CPU backend reads the large ones by default.

Run with the Triton backend (under the interpreter on the CPU) and the GPU's landing policy (tests/conftest.py:
released storage, copying hooks and covered layers wherever they are not turned off), against torch.optim's fused
kernels (and the Lion reference) over many steps, with accumulation, ``zero_grad(set_to_none=False)``, a parameter
without a gradient, clipping (flatopt's and torch's) and GradScaler's arguments.
"""

import warnings

import pytest
import torch
from conftest import TRITON_SKIP, device_for
from test_cpu_gradients import PAIRS, batches, check_accumulation, check_clipping, check_grad_scale, check_same
from test_cpu_gradients import Model as CpuModel

import flatopt

pytestmark = TRITON_SKIP
DEVICE = device_for("triton")  # a CUDA GPU when there is one, else the CPU under the interpreter


def Model():
    """test_cpu_gradients' model at a width the interpreter steps quickly (the Triton kernel gathers any size)."""
    return CpuModel(width=40).to(DEVICE)


def gathering(cls, model, backend="triton", **kw):
    opt = cls(model, backend=backend, direct_grads="gather", **kw)
    landing = flatopt.inspect(opt).engine.landing
    assert landing.gathers and not landing.handles, "no hook copies a gradient in"
    assert not landing.slots.covered and "_compiled_call_impl" not in model.proj.__dict__, "no layer is covered"
    return opt


@pytest.fixture
def acquired(monkeypatch):
    """How many times a released gradient storage was brought back (LandingSlots.acquire allocating). The storage's
    own size is no witness under the Triton interpreter, which resizes the storages of the tensors it is given."""
    from flatopt.landing import LandingSlots

    count = [0]
    acquire = LandingSlots.acquire

    def counting(self, b=None):
        allocated = acquire(self, b)
        count[0] += bool(allocated)
        if allocated and b is not None:
            count.append(b)  # which buffer, after the count
        return allocated

    monkeypatch.setattr(LandingSlots, "acquire", counting)
    return count


@pytest.mark.parametrize("name", list(PAIRS))
def test_the_step_reads_every_gradient_where_autograd_left_it(name, acquired):
    """Every .grad stays autograd's tensor through step(), the flat gradient buffer is never brought back, and the
    parameters and states follow torch.optim's."""
    ours_cls, theirs_cls, kw = PAIRS[name]
    m1, m2 = Model(), Model()
    o1, o2 = gathering(ours_cls, m1, **kw), theirs_cls(list(m2.parameters()), **kw)
    for step, x in enumerate(batches(8, device=DEVICE)):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).backward()
        grads = {n: p.grad for n, p in m1.named_parameters()}
        for o in (o1, o2):
            o.step()
        assert acquired == [0], f"step {step}: the gradient storage was brought back"
        for n, p in m1.named_parameters():
            assert p.grad is grads[n], f"step {step}: {n}.grad is no longer autograd's tensor"
        check_same(m1, o1, m2, o2, step)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_accumulation_zeroing_and_a_missing_gradient(name):
    """Two micro-batches, steps without zero_grad(), zero_grad(set_to_none=False) (the views in .grad, added into
    and read from the buffer) and a parameter without a gradient (test_cpu_gradients.check_accumulation)."""
    check_accumulation(name, gathering, Model)


@pytest.mark.parametrize("use", ["flatopt", "torch"])
def test_clipping(use):
    """opt.clip_grad_norm_() copies the gradients into the buffer first (and the step reads them there);
    torch.nn.utils.clip_grad_norm_ scales autograd's tensors, which the step then gathers."""
    check_clipping(use, gathering, Model)


def test_grad_scale_leaves_the_unscaled_gradient_in_grad(acquired):
    """The kernel writes the unscaled gradient back into autograd's tensor, not into the buffer, which stays
    released (test_cpu_gradients.check_grad_scale)."""
    m1 = Model()
    check_grad_scale(m1, gathering(flatopt.AdamW, m1, lr=1e-2))
    assert acquired == [0], "the gradient storage was brought back"


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_grad_scale_on_the_other_backends(backend):
    """The CPU backend and the torch reference leave the unscaled gradients in .grad too (the reference gathers
    them into the buffer, unscales them there and puts them back)."""
    m1 = Model().cpu()
    check_grad_scale(m1, gathering(flatopt.AdamW, m1, backend=backend, lr=1e-2))


def test_a_buffer_brought_back_is_released_by_the_next_step_that_reads_none_of_it():
    """opt.clip_grad_norm_() copies the gradients into the buffer; when model.zero_grad() (what Hugging Face's
    Trainer calls) rather than the optimizer's resets them, the next step, which reads every gradient in place,
    releases the storage again instead of holding it beside autograd's gradients for good."""
    m = Model()
    opt = gathering(flatopt.AdamW, m, lr=1e-2)
    slots = flatopt.inspect(opt).engine.landing.slots
    xs = batches(3, device=DEVICE)
    opt.zero_grad()
    m(xs[0]).backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    assert slots._released == [False], "clip_grad_norm_ copies the gradients into the buffer"
    for x in xs[1:]:
        m.zero_grad()
        m(x).backward()
        opt.step()
        assert slots._released == [True], "the step read none of the buffer: its storage is released"


def test_a_gradient_copied_in_brings_back_its_own_buffer_only(acquired):
    """Two buffers (float32 and float64 parameters): a float64 parameter without a gradient has its slot zeroed,
    which brings back the float64 buffer; the float32 one, whose gradients are all read in place, stays released."""
    m = Model()
    m.extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64, device=DEVICE))  # never used: no gradient
    opt = gathering(flatopt.SGD, m, lr=0.1, skip_unused=False)
    buffers = flatopt.inspect(opt).buffers
    f64 = [b.dtype for b in buffers].index(torch.float64)
    for x in batches(3, device=DEVICE):
        opt.zero_grad()
        m(x).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the first step names the parameter that received no gradient
            opt.step()
    assert set(acquired[1:]) == {f64}, acquired


def test_direct_grads_refuses_a_landing_it_does_not_know():
    with pytest.raises(ValueError, match=r"direct_grads='gathered' is not a landing; expected None \(the default\), "
                                         r"True, False or 'gather'"):  # fmt: skip
        flatopt.AdamW(Model(), direct_grads="gathered")
    with pytest.raises(ValueError, match="direct_grads applies to step mode with flat=True"):
        flatopt.AdamW(Model(), direct_grads="gather", in_backward=True)
