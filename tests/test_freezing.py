"""Freezing a parameter after the optimizer was created. torch.optim skips a parameter whose .grad is
None; flatopt settles a None .grad into a zeroed view at every step, so it refuses to go on silently stepping a
frozen parameter (unless skip_unused=True, which steps only parameters that received a gradient)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import flatopt


def make(in_backward=False, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    return model, flatopt.AdamW(model, lr=1e-2, weight_decay=0.1, in_backward=in_backward, **kw)


def train(model, opt, steps, x):
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("in_backward", [False, True])
def test_freezing_the_first_layer_is_refused_at_the_next_step(in_backward):
    model, opt = make(in_backward)
    x = torch.randn(4, 6)
    train(model, opt, 3, x)
    model[0].requires_grad_(False)
    before = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"have requires_grad=False now: '0\.weight'\..*skip_unused=True"):
        train(model, opt, 1, x)
    assert torch.equal(model[0].weight.detach(), before)


def test_freezing_a_middle_layer_is_found_by_check_bindings():
    model, opt = make()
    x = torch.randn(4, 6)
    train(model, opt, 2, x)
    model[2].requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'2\.weight', '2\.bias'"):
        opt.check_bindings()


def test_with_skip_unused_a_frozen_parameter_stays_put_as_with_torch():
    model, opt = make(skip_unused=True)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            if step == 3:
                model[0].requires_grad_(False)
                ref[0].requires_grad_(False)
            for m, o in ((model, opt), (ref, opt_ref)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
