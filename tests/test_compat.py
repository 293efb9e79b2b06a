"""flatopt against torch.optim (and a Lion reference written from the paper) over many steps:
parameters and every state tensor, several groups, tied, frozen and unused parameters, a
channels_last weight, schedulers, tensor lr, GradScaler with an injected inf."""

import copy
import itertools
import warnings

import pytest
import torch
from conftest import LionReference, Net, assert_same, device_for, loss_fn, make_batch, param_groups

import flatopt


def materialize_grads(model):
    """Zero .grad tensors on every trainable parameter: torch.optim then steps parameters that
    get no gradient with a zero gradient, as flatopt does with skip_unused=False."""
    for q in model.parameters():
        if q.requires_grad:
            q.grad = torch.zeros_like(q)


def compare_states(ours, theirs, model, ref, step):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), step, name)
        for key, value in theirs.state.get(q, {}).items():
            mine = ours.state[p][key]
            if key == "step":
                assert float(mine) == float(value), f"step {step}, {name}: step count {float(mine)} != {float(value)}"
            else:
                assert_same(mine, value, step, f"{name}.{key}")


def train_pair(device, make_ours, make_theirs, steps=10, skip_unused=True, sched=None, check_every_step=True):
    """Train a model with flatopt and a copy with the reference from one initialisation, comparing.
    ``skip_unused=False``: the reference gets zero gradients where the model gets none, and both zero
    their gradients with set_to_none=False (flatopt's ``skip_unused=False`` steps them so)."""
    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    if not skip_unused:
        materialize_grads(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused-parameter warning has a test of its own
        ours = make_ours(model)
        theirs = make_theirs(ref)
        scheds = [sched(ours), sched(theirs)] if sched else []
        gen = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            batch = make_batch(gen, device=device)
            for m, opt in ((model, ours), (ref, theirs)):
                loss_fn(m, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=skip_unused)
            for s in scheds:
                s.step()
            if check_every_step or step == steps:
                compare_states(ours, theirs, model, ref, step)
    return model, ref, ours, theirs


def test_adamw_matches_torch(backend):
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)
    train_pair(
        device_for(backend),
        lambda m: flatopt.AdamW(param_groups(m, **kw), backend=backend),
        lambda m: torch.optim.AdamW(param_groups(m, **kw)),
        steps=12,
    )


def test_adamw_maximize_and_tensor_lr(backend):
    train_pair(
        device_for(backend),
        lambda m: flatopt.AdamW(m, lr=torch.tensor(3e-3), maximize=True, backend=backend),
        lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(3e-3), maximize=True),
    )


SGD_FLAGS = [
    dict(momentum=mom, dampening=damp, nesterov=nest, weight_decay=wd, maximize=mx)
    for mom, damp, nest, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.05), (False, True))
    if not (nest and (mom == 0 or damp != 0))
]


@pytest.mark.parametrize("flags", SGD_FLAGS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_sgd_matches_torch(backend, flags):
    train_pair(
        device_for(backend),
        lambda m: flatopt.SGD(param_groups(m, lr=0.05, **flags), lr=0.05, backend=backend, **flags),
        lambda m: torch.optim.SGD(param_groups(m, lr=0.05, **flags), lr=0.05, **flags),
        steps=10,
        check_every_step=False,
    )


def test_lion_matches_paper_reference(backend):
    kw = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.5)
    train_pair(
        device_for(backend),
        lambda m: flatopt.Lion(param_groups(m, **kw), backend=backend),
        lambda m: LionReference(param_groups(m, **kw)),
        steps=12,
    )


@pytest.mark.parametrize("skip_unused", [True, False], ids=["default", "skip_unused=False"])
@pytest.mark.parametrize("opt", ["adamw", "sgd", "lion"])
def test_unused_parameters_as_torch(backend, opt, skip_unused):
    """By default parameters without a gradient are left alone (no decay, no state, no step count), as
    torch.optim leaves parameters whose .grad is None; skip_unused=False steps them with a zero gradient,
    as torch.optim does after zero_grad(set_to_none=False) once they have a zero .grad."""
    make = {
        "adamw": (lambda ps, **k: flatopt.AdamW(ps, lr=1e-2, **k), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
        "sgd": (
            lambda ps, **k: flatopt.SGD(ps, lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.1, **k),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.1),
        ),
        "lion": (
            lambda ps, **k: flatopt.Lion(ps, lr=1e-3, weight_decay=0.1, **k),
            lambda ps: LionReference(ps, 1e-3, weight_decay=0.1),
        ),
    }[opt]
    kw = {} if skip_unused else dict(skip_unused=False)
    model, ref, ours, theirs = train_pair(
        device_for(backend),
        lambda m: make[0](m.parameters(), backend=backend, **kw),
        lambda m: make[1](m.parameters()),
        skip_unused=skip_unused,
    )
    if skip_unused:
        assert ours.state_dict()["state"].keys() == theirs.state_dict()["state"].keys()


def test_unused_parameters_warn_once_with_names():
    torch.manual_seed(0)
    model = Net()
    opt = flatopt.AdamW(model, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with pytest.warns(
        UserWarning, match=r"2 parameter\(s\) received no gradient.*: 'unused\.weight', 'unused\.bias'\."
    ):
        loss_fn(model, make_batch(gen)).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model, make_batch(gen)).backward()
        opt.step()


def test_scheduler_changes_lr_and_betas_every_step(backend):
    sched = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=20)  # noqa: E731
    train_pair(
        device_for(backend),
        lambda m: flatopt.AdamW(m, lr=1e-2, backend=backend),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        steps=12,
        sched=sched,
    )
    train_pair(
        device_for(backend),
        lambda m: flatopt.SGD(m, lr=1e-2, momentum=0.9, backend=backend),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
        steps=12,
        sched=sched,
        check_every_step=False,
    )


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_grad_scaler_with_injected_inf(backend, opt):
    """GradScaler drives flatopt through the fused path (grad_scale/found_inf in the kernel);
    torch.optim through unscale_ + a skipped step. Everything must agree, and the step with an
    inf must change no parameter, state or step count."""
    make = {
        "adamw": (
            lambda m: flatopt.AdamW(m, lr=1e-2, backend=backend),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        ),
        "sgd": (
            lambda m: flatopt.SGD(m, lr=0.05, momentum=0.9, backend=backend),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        ),
    }[opt]
    device = device_for(backend)
    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = make[0](model), make[1](ref)
        scalers = [torch.amp.GradScaler(device, init_scale=2.0**10) for _ in range(2)]
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 9):
            batch = make_batch(gen, device=device)
            before = [p.detach().clone() for p in model.parameters()]
            for m, o, scaler in zip((model, ref), (ours, theirs), scalers):
                scaler.scale(loss_fn(m, batch)).backward()
                if step == 4:
                    m.proj.weight.grad[0, 0] = float("inf")
                scaler.step(o)
                scaler.update()
                o.zero_grad(set_to_none=False)
            if step == 4:
                for p, b in zip(model.parameters(), before):
                    assert torch.equal(p.detach(), b), "a step with found_inf changed a parameter"
            assert scalers[0].get_scale() == scalers[1].get_scale()
            compare_states(ours, theirs, model, ref, step)
    if opt == "adamw":
        assert float(ours.state[model.proj.weight]["step"]) == 7.0


@pytest.mark.parametrize("direction", ["torch_to_flatopt", "flatopt_to_torch"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_state_dict_round_trip_with_torch(backend, direction, opt, tmp_path):
    """Train 5 steps with one library, save, load into the other, train 5 more: identical to
    training 10 steps with torch.optim."""
    make = {
        "adamw": (
            lambda m: flatopt.AdamW(param_groups(m, weight_decay=0.1), backend=backend),
            lambda m: torch.optim.AdamW(param_groups(m, weight_decay=0.1)),
        ),
        "sgd": (
            lambda m: flatopt.SGD(param_groups(m), lr=0.05, momentum=0.9, nesterov=True, backend=backend),
            lambda m: torch.optim.SGD(param_groups(m), lr=0.05, momentum=0.9, nesterov=True),
        ),
    }[opt]
    device = device_for(backend)
    torch.manual_seed(0)
    base = Net().to(device)
    ref = copy.deepcopy(base)
    materialize_grads(ref)
    first, second = (make[1], make[0]) if direction == "torch_to_flatopt" else (make[0], make[1])
    gen = torch.Generator().manual_seed(1)
    ref_gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = make[1](ref)
        model = copy.deepcopy(base)
        materialize_grads(model)
        opt1 = first(model)
        for _ in range(5):
            for m, o, g in ((model, opt1, gen), (ref, reference, ref_gen)):
                loss_fn(m, make_batch(g, device=device)).backward()
                o.step()
                o.zero_grad(set_to_none=False)
        torch.save({"model": model.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ckpt.pt")
        ckpt = torch.load(tmp_path / "ckpt.pt", map_location=device)
        model2 = copy.deepcopy(base)
        model2.load_state_dict(ckpt["model"])
        materialize_grads(model2)
        opt2 = second(model2)
        opt2.load_state_dict(ckpt["opt"])
        for step in range(6, 11):
            for m, o, g in ((model2, opt2, gen), (ref, reference, ref_gen)):
                loss_fn(m, make_batch(g, device=device)).backward()
                o.step()
                o.zero_grad(set_to_none=False)
            compare_states(opt2, reference, model2, ref, step)
