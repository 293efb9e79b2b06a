"""optimizer.clip_grad_norm_ over the flat gradient buffers against torch.nn.utils.clip_grad_norm_."""

import copy
import math

import pytest
import torch
from conftest import Net, loss_fn, make_batch

import flatopt


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize(
    "norm_type, max_norm",
    [(2.0, 0.05), (1.0, 0.3), (math.inf, 0.01), (2.0, 1e3), (0.0, 1.0), (-math.inf, 0.01), (0.5, 1.0)],
)
def test_matches_torch_clip_grad_norm(flat, norm_type, max_norm):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = flatopt.AdamW(model, lr=1e-2, flat=flat)
    batch = make_batch(torch.Generator().manual_seed(1))
    loss_fn(model, batch).backward()
    loss_fn(ref, batch).backward()
    trainable = [q for q in ref.parameters() if q.grad is not None]
    expected = torch.nn.utils.clip_grad_norm_(trainable, max_norm, norm_type)
    total = opt.clip_grad_norm_(max_norm, norm_type)
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    if flat:
        buf = flatopt.inspect(opt).buffers[0]
        kept = [p.grad.data_ptr() == ptr for p, (_, ptr) in zip(buf.params, buf.expected) if p.grad is not None]
        assert kept and all(kept), "views kept"


@pytest.mark.parametrize("flat", [True, False])
def test_a_parameter_frozen_after_backward_is_clipped_with_the_others(flat):
    """A layer frozen while it holds a .grad is still stepped (torch.optim steps any .grad), so
    opt.clip_grad_norm_() counts and clips its gradient, as torch's function over the parameters step() steps."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = flatopt.SGD(model, lr=0.1, flat=flat)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = make_batch(torch.Generator().manual_seed(1))
    for m in (model, ref):
        loss_fn(m, batch).backward()
        next(m.children()).requires_grad_(False)
    expected = torch.nn.utils.clip_grad_norm_([q for q in ref.parameters() if q.grad is not None], 0.05)
    torch.testing.assert_close(opt.clip_grad_norm_(0.05), expected, atol=1e-6, rtol=1e-5)
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_nonfinite_norm_raises_when_asked():
    model = Net()
    opt = flatopt.SGD(model, lr=0.1)
    loss_fn(model, make_batch(torch.Generator().manual_seed(1))).backward()
    model.proj.weight.grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)
