"""``direct_grads="gather"``: no layer is covered and no hook copies a gradient in, on any device; ``step()`` reads
every gradient where autograd left it (the Triton kernel gathers them through a table of addresses and stores none
into the flat gradient buffer, which stays released), as the CPU backend reads the large ones by default.

Run with the Triton backend (under the interpreter on the CPU) and the GPU's landing policy (tests/conftest.py:
released storage, copying hooks and covered layers wherever they are not turned off), against torch.optim's fused
kernels (and the Lion reference) over many steps, with accumulation, ``zero_grad(set_to_none=False)``, a parameter
without a gradient, clipping (flatopt's and torch's) and GradScaler's arguments.
"""

import pytest
from conftest import TRITON_SKIP, device_for
from test_cpu_gradients import PAIRS, batches, check_accumulation, check_clipping, check_grad_scale, check_same
from test_cpu_gradients import Model as CpuModel

import flatopt

pytestmark = TRITON_SKIP
DEVICE = device_for("triton")  # a CUDA GPU when there is one, else the CPU under the interpreter


def Model():
    """test_cpu_gradients' model at a width the interpreter steps quickly (the Triton kernel gathers any size)."""
    return CpuModel(width=40).to(DEVICE)


def gathering(cls, model, **kw):
    opt = cls(model, backend="triton", direct_grads="gather", **kw)
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


def test_direct_grads_refuses_a_landing_it_does_not_know():
    with pytest.raises(ValueError, match=r"direct_grads='gathered' is not a landing; expected None \(the default\), "
                                         r"True, False or 'gather'"):  # fmt: skip
        flatopt.AdamW(Model(), direct_grads="gathered")
    with pytest.raises(ValueError, match="direct_grads applies to step mode with flat=True"):
        flatopt.AdamW(Model(), direct_grads="gather", in_backward=True)
