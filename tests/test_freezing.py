"""Freezing, unfreezing and editing ``param_groups`` after the optimizer was created.

torch.optim steps what its groups hold whose ``.grad`` is not None, at every step. flatopt does the
same: a parameter frozen later gets no gradient and is not stepped; one that starts requiring grad or
is appended to a group's params list joins the flat buffers at the next step (values, gradients and
every state kept); one removed from a group leaves them. Bad edits are refused before anything
changes.
"""

import copy
import warnings

import pytest
import torch
from optim_inputs import assert_matches
from torch import nn

import flatopt

TOL = dict(atol=1e-6, rtol=1e-5)


def make(in_backward=False, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    return model, flatopt.AdamW(model, lr=1e-2, weight_decay=0.1, in_backward=in_backward, **kw)


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def train_both(pairs, steps, x, events=None, compare=True):
    """Train each (model, optimizer) pair the same way; ``events[step](pairs)`` runs before that step.
    Compares every pair's parameters and states with the last pair's (torch.optim's) after each step."""
    for step in range(steps):
        if events and step in events:
            events[step](pairs)
        for m, o in pairs:
            o.zero_grad()
            m(x).square().mean().backward()
            quiet(o.step)
        if compare:
            assert_same(pairs, step)


def assert_same(pairs, step):
    (model, opt), (ref, ref_opt) = pairs[0], pairs[-1]
    held = {q for group in ref_opt.param_groups for q in group["params"]}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=name: f"step {step}, {name}: {m}")
        if q not in held:  # torch.optim keeps the state of a parameter removed from its groups; flatopt drops it
            assert p not in opt.state, f"step {step}, {name}: state kept for a parameter the groups do not hold"
            continue
        for key, value in ref_opt.state.get(q, {}).items():
            mine = opt.state[p][key]
            if key == "step":
                assert float(mine) == float(value), f"step {step}, {name}: step {float(mine)} != {float(value)}"
            else:
                torch.testing.assert_close(mine, value, **TOL, msg=lambda m, n=name: f"step {step}, {n}.{key}: {m}")


def pair(in_backward=False, frozen=(), **kw):
    """flatopt and torch.optim over copies of one model, with the layers ``frozen`` at construction."""
    model, _ = make()
    for i in frozen:
        model[i].requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1, in_backward=in_backward, **kw)
    return [(model, opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("layer", [0, 2, 4], ids=["first", "middle", "last"])
def test_a_parameter_frozen_later_is_no_longer_stepped(in_backward, layer):
    """Frozen at step 3 (first, middle or last of the buffer): not stepped from the very next step on, no
    weight decay and no state change, as torch.optim (its .grad is None after zero_grad())."""
    pairs = pair(in_backward)

    def freeze(pairs):
        for m, _ in pairs:
            m[layer].requires_grad_(False)

    x = torch.randn(4, 6)
    train_both(pairs, 3, x)
    before = pairs[0][0][layer].weight.detach().clone()
    train_both(pairs, 3, x, {0: freeze})
    assert torch.equal(pairs[0][0][layer].weight.detach(), before)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("layer", [0, 2], ids=["first", "middle"])
def test_a_parameter_unfrozen_later_is_trained_from_the_next_step(layer, in_backward):
    """Frozen at construction (left out of the buffers) and unfrozen at step 3, progressive unfreezing: it
    joins the flat buffers and is stepped from the next step on, its state starting at step 0 as in
    torch.optim; the others keep their values and states."""
    pairs = pair(in_backward, frozen=[layer])
    (model, opt) = pairs[0]
    assert not any(p is q for p in model[layer].parameters() for q in flatopt.inspect(opt).buffers[0].params)

    def unfreeze(pairs):
        for m, _ in pairs:
            m[layer].requires_grad_(True)

    x = torch.randn(4, 6)
    train_both(pairs, 6, x, {3: unfreeze})
    assert float(opt.state[model[layer].weight]["step"]) == 3.0
    assert float(opt.state[model[0 if layer else 2].weight]["step"]) == 6.0
    (buf,) = flatopt.inspect(opt).buffers
    for p in model.parameters():  # every parameter lives in the new buffer
        s, _ = buf.index[p]
        assert p.data_ptr() == buf.data[s:].data_ptr()
    opt.check_bindings()


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
def test_built_and_laid_out_again_under_inference_mode_as_torch(in_backward):
    """An optimizer created under torch.inference_mode(), then a progressive unfreezing whose step() and
    zero_grad() run under it (torch.optim allows both): the flat buffers are normal tensors, so the model goes on
    training (inference tensors in p.data could not be saved for backward) as torch.optim's."""
    model, _ = make()
    model[2].requires_grad_(False)
    ref = copy.deepcopy(model)
    with torch.inference_mode():
        opt = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1, in_backward=in_backward)
    assert not any(p.is_inference() for p in model.parameters())
    pairs = [(model, opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))]
    x = torch.randn(4, 6)
    for step in range(4):
        if step == 2:
            for m, _ in pairs:
                m[2].requires_grad_(True)
        for m, o in pairs:
            m(x).square().mean().backward()
            with torch.inference_mode():
                quiet(o.step)
                o.zero_grad()
        assert not any(p.is_inference() for p in model.parameters()), step
        assert_same(pairs, step)


def test_a_closure_given_to_step_under_inference_mode_runs_in_it_as_in_torch():
    """step(closure) under torch.inference_mode(): the optimizer's own work runs outside it (above), the closure in
    the caller's mode, as torch.optim runs it (where its backward fails: inference mode records no graph)."""
    seen = {}
    builds = {"flatopt": lambda m: flatopt.SGD(m, lr=0.1), "torch": lambda m: torch.optim.SGD(m.parameters(), lr=0.1)}
    for name, build in builds.items():
        model = nn.Linear(6, 2)
        opt = build(model)

        def closure():
            seen[name] = torch.is_inference_mode_enabled()
            return model(torch.randn(4, 6)).square().mean()

        with torch.inference_mode():
            opt.step(closure)
    assert seen == {"flatopt": True, "torch": True}


def test_unfreezing_keeps_every_state_and_gradient():
    """The re-layout copies values, states, step counts and pending gradients into the new buffers: a step
    after unfreezing (with gradients accumulated before it) is the same as torch.optim's."""
    pairs = pair(frozen=[2])
    x = torch.randn(4, 6)
    train_both(pairs, 3, x)
    for m, _ in pairs:  # a backward before unfreezing, another after: both land in .grad
        m(x).square().mean().backward()
        m[2].requires_grad_(True)
        m(x).square().mean().backward()
    for _, o in pairs:
        quiet(o.step)
    assert_same(pairs, 3)
    train_both(pairs, 2, x)


@pytest.mark.parametrize("skip_unused", [True, False], ids=["skip-unused", "zero-for-unused"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
def test_a_parameter_appended_to_a_group_is_trained_and_one_removed_is_not(in_backward, skip_unused):
    """opt.param_groups[0]["params"] is the truth, as in torch.optim: a parameter appended to it is stepped
    from the next step on, one removed is no longer stepped (and leaves the flat buffers: its data is a
    tensor of its own again, and its state is gone). skip_unused=False steps the parameters of the groups that
    received no gradient, not one removed from them (in in-backward mode, the pass after the removal steps the
    parameters still laid out, the removed one among them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    first = [model[0].weight, model[0].bias, model[2].weight]
    opt = flatopt.AdamW(first, lr=1e-2, weight_decay=0.1, in_backward=in_backward, skip_unused=skip_unused)
    ref_of = dict(zip(model.parameters(), ref.parameters()))
    ref_opt = torch.optim.AdamW([ref_of[p] for p in first], lr=1e-2, weight_decay=0.1)
    pairs = [(model, opt), (ref, ref_opt)]

    def append(pairs):
        opt.param_groups[0]["params"].append(model[4].weight)
        ref_opt.param_groups[0]["params"].append(ref_of[model[4].weight])

    def remove(pairs):
        del opt.param_groups[0]["params"][1]  # model[0].bias
        del ref_opt.param_groups[0]["params"][1]

    x = torch.randn(4, 6)
    train_both(pairs, 6, x, {2: append, 4: remove})
    assert float(opt.state[model[4].weight]["step"]) == 4.0
    assert model[0].bias not in opt.state
    buffers = flatopt.inspect(opt).buffers
    assert all(model[0].bias is not p for b in buffers for p in b.params)
    at, end = model[0].bias.data_ptr(), model[0].bias.data_ptr() + model[0].bias.nbytes
    assert all(end <= b.data.data_ptr() or b.data.data_ptr() + b.data.nbytes <= at for b in buffers), "still in one"
    sd = opt.state_dict()  # a checkpoint of what the groups hold now, loadable by torch.optim
    torch.optim.AdamW([ref_of[p] for p in opt.param_groups[0]["params"]]).load_state_dict(sd)


def _remove_bias(opt, model):
    del opt.param_groups[0]["params"][1]  # the first layer's bias


def _append_bias(opt, model):
    opt.param_groups[0]["params"].append(model[2].bias)


def _move_weight(opt, model):
    params = opt.param_groups[0]["params"]
    del params[next(i for i, p in enumerate(params) if p is model[2].weight)]
    opt.param_groups[1]["params"].append(model[2].weight)


def _swap_groups(opt, model):
    a, b = opt.param_groups
    a["params"], b["params"] = b["params"], a["params"]


EDITS = {"remove": _remove_bias, "append": _append_bias, "move": _move_weight, "swap": _swap_groups}


@pytest.mark.parametrize("skip_unused", [True, False], ids=["skip-unused", "zero-for-unused"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_param_groups_edited_between_zero_grad_and_backward_in_backward(edit, skip_unused):
    """In in-backward mode the pass right after an edit of param_groups still runs over the old layout (the
    buffers are laid out anew at the next step() or zero_grad(), not during backward). As torch.optim steps the
    groups' parameters only, each once per step(): a parameter removed is not stepped by that pass; one appended,
    or moved to another group, keeps its gradient in .grad, and step() steps it with its new group's
    hyper-parameters, without stepping again those the pass stepped, with or without skip_unused (which steps
    the parameters without a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    w0, b0, w2, b2 = model.parameters()

    def groups(ps):
        p = list(ps)
        return [{"params": [p[0], p[1], p[2]]}, {"params": [], "lr": 0.05, "weight_decay": 0.0}]

    opt = flatopt.AdamW(
        groups(model.parameters()), lr=1e-2, weight_decay=0.1, in_backward=True, skip_unused=skip_unused
    )
    ref_opt = torch.optim.AdamW(groups(ref.parameters()), lr=1e-2, weight_decay=0.1)
    pairs = [(model, opt), (ref, ref_opt)]
    x = torch.randn(4, 6)
    for step in range(4):
        for m, o in pairs:
            o.zero_grad()
            if step == 1:
                EDITS[edit](o, m)
            m(x).square().mean().backward()
            quiet(o.step)
        assert_same(pairs, step)


def test_a_parameter_repeated_before_a_backward_pass_is_refused_by_it_in_backward():
    """What step() refuses when it lays the groups out (a parameter listed twice), in-backward mode refuses at the
    first gradient of the pass that follows the edit, before it steps anything."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=True)
    x = torch.randn(4, 6)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt.param_groups[0]["params"].append(model[0].weight)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter '0\.weight' appears more than once"):
        model(x).square().mean().backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("when", ["after-backward", "before-backward"])
def test_param_groups_edited_after_a_stepped_pass_warn_at_step_in_backward(when):
    """A pass in in-backward mode steps the parameters as the groups stand when it runs; torch.optim's step()
    applies an edit made between backward() and step() to that step. step() says so (the edit takes effect from
    the next pass); an edit made before the pass is followed by it, and step() says nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=True)
    x = torch.randn(4, 6)
    for step in range(2):
        opt.zero_grad()
        if when == "before-backward" and step == 1:
            del opt.param_groups[0]["params"][1]
        model(x).square().mean().backward()
        if when == "after-backward" and step == 1:
            del opt.param_groups[0]["params"][1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        edited = [w for w in caught if "edited after a backward pass" in str(w.message)]
        assert len(edited) == (step == 1 and when == "after-backward"), [str(w.message) for w in caught]
        assert all(w.filename == __file__ for w in edited)  # at the caller's line


def test_a_params_list_replaced_is_followed():
    pairs = pair()
    (model, opt), (ref, ref_opt) = pairs

    def replace(pairs):
        opt.param_groups[0]["params"] = tuple(model[2].parameters())
        ref_opt.param_groups[0]["params"] = list(ref[2].parameters())

    train_both(pairs, 4, torch.randn(4, 6), {2: replace})
    assert [p.shape for p in flatopt.inspect(opt).buffers[0].params] == [(6, 6), (6,)]


def test_nothing_changed_keeps_the_buffers():
    """Detection costs identity tests only: steps with nothing changed keep the same buffers."""
    model, opt = make()
    x = torch.randn(4, 6)
    buffers = list(flatopt.inspect(opt).buffers)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        quiet(opt.step)
    assert flatopt.inspect(opt).buffers == buffers


@pytest.mark.parametrize(
    "edit, error, match",
    [
        ("twice", ValueError, r"'2\.weight' appears more than once in opt\.param_groups"),
        ("complex", ValueError, r"does not support complex parameters"),
        ("not a tensor", TypeError, r"holds a str in its params"),
        ("new group", RuntimeError, r"has 2 groups, and the optimizer was laid out for 1.*add_param_group"),
    ],
)
def test_bad_edits_are_refused_before_anything_changes(edit, error, match):
    model, opt = make()
    x = torch.randn(4, 6)
    opt.zero_grad()
    model(x).sum().backward()
    quiet(opt.step)
    opt.zero_grad()
    model(x).sum().backward()
    group = opt.param_groups[0]
    if edit == "twice":
        group["params"].append(model[2].weight)
    elif edit == "complex":
        group["params"].append(nn.Parameter(torch.ones(3, dtype=torch.complex64)))
    elif edit == "not a tensor":
        group["params"].append("weight")
    else:
        opt.param_groups.append({**group, "params": [nn.Parameter(torch.ones(3))]})
    before = [p.detach().clone() for p in model.parameters()]
    states = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    with pytest.raises(error, match=match):
        opt.step()
    with pytest.raises(error, match=match):  # zero_grad() follows param_groups too
        opt.zero_grad()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(opt.state[model[0].weight][k], v) for k, v in states.items())


@pytest.mark.parametrize("layer", [0, 2], ids=["first-layer", "middle-layer"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
def test_with_skip_unused_false_freezing_is_refused(in_backward, layer):
    """skip_unused=False steps parameters whose .grad is None with a zero gradient: a parameter frozen after
    construction would go on being stepped, so the binding check refuses it and changes nothing, at the first step
    or pass after the freeze wherever the parameter lies in its buffer (not only at the ends, which the sampled
    check looks at)."""
    model, opt = make(in_backward, skip_unused=False)
    x = torch.randn(4, 6)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model[layer].requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=rf"have requires_grad=False now: '{layer}\.weight', .*Drop skip_unused=False"
    ):
        model(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("edit", ["unfreeze", "append", "remove"])
def test_in_backward_edits_between_zero_grad_and_backward(edit):
    """In-backward mode lays the parameters out again between passes (at step() or zero_grad()), not during
    backward: an edit made after zero_grad() takes effect in the very pass that follows all the same, as in
    torch.optim. A removed parameter is not stepped by the pass; an unfrozen or appended one keeps its
    gradient in .grad, which step() steps."""
    pairs = pair(True, frozen=[2] if edit == "unfreeze" else ())
    (model, opt), (ref, ref_opt) = pairs
    if edit == "append":  # the last layer starts outside the optimizers' groups
        for o in (opt, ref_opt):
            del o.param_groups[0]["params"][-2:]
        opt.zero_grad()
        quiet(opt.step)  # laid out again without them
    x = torch.randn(4, 6)
    train_both(pairs, 2, x)
    for m, o in pairs:
        o.zero_grad()
        if edit == "unfreeze":
            m[2].requires_grad_(True)
        elif edit == "append":
            o.param_groups[0]["params"] += list(m[4].parameters())
        else:
            del o.param_groups[0]["params"][0]  # model[0].weight
        m(x).square().mean().backward()
        quiet(o.step)
    assert_same(pairs, 2)
    train_both(pairs, 2, x)


LOADED_FROZEN = {  # name -> (flatopt's class, torch.optim's, arguments, momentum while B is frozen)
    "AdamW": (flatopt.AdamW, torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1), None),
    "SGD": (flatopt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2), None),
    "SGD_momentum_off": (flatopt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2), 0.0),
}


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("kind", list(LOADED_FROZEN))
def test_a_parameter_frozen_when_a_checkpoint_is_loaded_resumes_from_it_when_unfrozen(kind, in_backward):
    """Resuming a staged fine-tune: A and B trained, the state saved, B frozen, a new optimizer over [A, B] loads
    the state, steps A, then B is unfrozen. torch.optim keeps B's loaded state (AdamW's step count with its
    moments, SGD's momentum buffer) and goes on from it; so does flatopt, which lays B out only when it is
    unfrozen. With momentum 0 in the loaded group, B's buffer waits for momentum's return."""
    ours_cls, theirs_cls, kwargs, momentum_off = LOADED_FROZEN[kind]
    gen = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(5, generator=gen), torch.randn(4, generator=gen)
    grads = [(torch.randn(5, generator=gen), torch.randn(4, generator=gen)) for _ in range(8)]
    sides = []
    for make in (lambda ps: ours_cls(ps, in_backward=in_backward, **kwargs), lambda ps: theirs_cls(ps, **kwargs)):
        a, b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
        opt = make([a, b])
        for step, (ga, gb) in enumerate(grads[:3]):
            if step == 2 and momentum_off is not None:
                opt.param_groups[0]["momentum"] = momentum_off
            a.grad, b.grad = ga.clone(), gb.clone()
            opt.step()
            opt.zero_grad()
        saved = copy.deepcopy(opt.state_dict())
        b.requires_grad_(False)
        opt = make([a, b])
        opt.load_state_dict(saved)
        sides.append((opt, a, b))
    (ours, a, b), (theirs, a2, b2) = sides
    pairs = [("A", a, a2), ("B", b, b2)]
    assert_matches(ours, theirs, pairs, "right after the load")
    for step, (ga, gb) in enumerate(grads[3:]):
        if step == 1:
            b.requires_grad_(True)
            b2.requires_grad_(True)
        if step == 3 and momentum_off is not None:
            ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.9
        for p, g in ((a, ga), (a2, ga)) + (((b, gb), (b2, gb)) if step >= 1 else ()):
            p.grad = g.clone()
        quiet(ours.step)
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
        assert_matches(ours, theirs, pairs, f"step {step} after the load")
