"""In-backward mode against torch.optim where the two part ways easily: a backward pass that raised and
is retried, a refused backward pass, gradients set by hand, gradient hooks registered after the
optimizer, and backward passes nested in another one (reentrant activation checkpointing). Each
case either matches torch.optim stepping a copy of the same model, or is refused before anything
changes: no parameter or state updated, no gradient left in ``.grad``."""

import contextlib
import copy
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatopt

TORCH_TOL = dict(atol=2e-6, rtol=2e-5)  # float32: flatopt's kernels against torch.optim's for-loop

PAIRS = {
    "adamw": (
        lambda ps, **k: flatopt.AdamW(ps, lr=1e-2, weight_decay=0.1, **k),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ),
    "sgd": (
        lambda ps, **k: flatopt.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, **k),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
    ),
}
# With bucket_size=512 the weights (64 elements or more) are buckets of their own, stepped straight from
# their gradients, and the biases share one bucket; with the default size everything shares one bucket.
BUCKETS = [512, None]


class Trip(torch.autograd.Function):
    """Identity whose backward raises ``error`` (when given): a backward pass that fails half way."""

    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.error is not None:
            raise ctx.error
        return g, None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.error = None  # raised by the backward pass between b and c when set

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(Trip.apply(h, self.error))


def pair(opt, **kwargs):
    """A model and a copy: torch.optim steps the first, flatopt in in-backward mode the second."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    make_ours, make_theirs = PAIRS[opt]
    return model, make_theirs(model.parameters()), twin, make_ours(twin, in_backward=True, **kwargs)


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def assert_matches_torch(ours, theirs, opt_ours, opt_theirs, step):
    """Parameters and every state tensor torch.optim keeps (its step counts included)."""
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, **TORCH_TOL, msg=lambda m: f"step {step}, {name}: {m}")
        for key, value in opt_theirs.state.get(q, {}).items():
            mine = opt_ours.state[p][key]
            torch.testing.assert_close(
                mine.float(), value.float(), **TORCH_TOL, msg=lambda m: f"step {step}, {name}.{key}: {m}"
            )


def torch_step(model, opt, batch):
    loss_of(model, batch).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------- a backward pass that raised


def fail(model, batch, cause):
    """A backward pass of ``model`` that raises half way (after c's gradients arrived), from ``cause``."""
    if cause == "user hook":

        def hook(p):
            raise ValueError("a user hook failed")

        handle = model.c.weight.register_post_accumulate_grad_hook(hook)
        with pytest.raises(ValueError, match="a user hook failed"):
            loss_of(model, batch).backward()
        handle.remove()
        return
    model.error = KeyboardInterrupt() if cause == "interrupt" else RuntimeError("out of memory (simulated)")
    with pytest.raises(type(model.error)):
        loss_of(model, batch).backward()
    model.error = None


@pytest.mark.parametrize("cause", ["function", "interrupt", "user hook"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_zero_grad_after_a_backward_that_raised_lets_the_retry_match_torch(opt, cause):
    """The documented recovery once the loop has called step(): zero_grad(), then the same backward
    again. With one bucket the failed pass stepped nothing, so the result equals torch.optim's after
    the same failure, zero_grad() and retry; the passes after it are not refused as a "second backward"."""
    model, theirs, twin, ours = pair(opt)
    data = batches(4)
    for step, batch in enumerate(data, 1):
        if step == 2:
            for m, o in ((model, theirs), (twin, ours)):
                fail(m, batch, cause)
                o.zero_grad()
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)
    assert all(p.grad is None for p in twin.parameters())


@pytest.mark.parametrize("bucket_size", BUCKETS)
@pytest.mark.parametrize("cause", ["function", "user hook"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_step_after_a_backward_that_raised_steps_what_it_left_as_torch(opt, cause, bucket_size):
    """step() instead of zero_grad() after the failed pass: torch.optim steps the gradients that pass had
    accumulated (c's). flatopt had moved them into a bucket it had not stepped (the biases' shared bucket with
    bucket_size=512, the only bucket with the default size) or stepped c.weight's bucket already: either way
    every gradient the failed pass delivered is stepped once, and training then matches torch.optim."""
    model, theirs, twin, ours = pair(opt, bucket_size=bucket_size)
    data = batches(4)
    for step, batch in enumerate(data, 1):
        if step == 2:
            for m, o in ((model, theirs), (twin, ours)):
                fail(m, batch, cause)
                o.step()
                o.zero_grad()
            assert_matches_torch(twin, model, ours, theirs, "after the failed pass")
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)
    assert all(p.grad is None for p in twin.parameters())


def test_a_retry_after_buckets_were_stepped_goes_on_training():
    """With one bucket per weight, the failed pass had stepped c.weight before it raised: that update
    stays (it cannot be undone), and zero_grad() then the retry work as documented."""
    model, theirs, twin, ours = pair("adamw", bucket_size=512)
    data = batches(3)
    torch_step(twin, ours, data[0])
    fail(twin, data[1], "function")
    ours.zero_grad()
    torch_step(twin, ours, data[1])
    torch_step(twin, ours, data[2])
    steps = {name: float(ours.state[p]["step"]) for name, p in twin.named_parameters()}
    assert steps["c.weight"] == 4.0, "c.weight was stepped by the failed pass and by the three others"
    assert {s for name, s in steps.items() if name != "c.weight"} == {3.0}


@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_retry_without_zero_grad_is_refused_until_zero_grad(opt):
    """Retrying at once would add the new gradients to what the failed pass left; the retry is refused,
    changes nothing, and is refused again until zero_grad() (or step()) drops the failed pass."""
    model, theirs, twin, ours = pair(opt)
    data = batches(3)
    torch_step(model, theirs, data[0])
    torch_step(twin, ours, data[0])
    fail(model, data[1], "function")
    theirs.zero_grad()
    fail(twin, data[1], "function")
    before = [p.detach().clone() for p in twin.parameters()]
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"after the previous one raised.*opt\.zero_grad\(\) before"):
            loss_of(twin, data[1]).backward()
        assert all(p.grad is None for p in twin.parameters()), "the refused pass left a gradient"
        assert all(torch.equal(p.detach(), b) for p, b in zip(twin.parameters(), before))
    ours.zero_grad()
    for step, batch in enumerate(data[1:], 2):
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)


def test_a_retry_refused_with_a_layer_frozen_since_the_layout_gives_flatopts_message():
    """The refusal of a retry arms a tensor hook on the parameters to see the next pass's first gradient; a
    parameter frozen since the layout gets none (torch refuses a hook on it, "cannot register a hook on a tensor
    that doesn't require gradient"), and the refusal is flatopt's."""
    model, theirs, twin, ours = pair("adamw")
    data = batches(2)
    torch_step(twin, ours, data[0])
    twin.a.requires_grad_(False)
    fail(twin, data[1], "function")
    with pytest.raises(RuntimeError, match=r"after the previous one raised.*opt\.zero_grad\(\) before"):
        loss_of(twin, data[1]).backward()
    ours.zero_grad()
    loss_of(twin, data[1]).backward()
    ours.step()


@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_pass_refused_over_kept_zero_gradients_leaves_them_zero_and_the_retry_runs(opt):
    """After zero_grad(set_to_none=False) the .grad tensors are kept zeros (as in torch.optim's loop); a pass
    refused at its first gradient (a hyper-parameter found invalid) that autograd had added to one of them leaves
    it zero again, and once the value is fixed the same pass runs, with no zero_grad(), as torch.optim's step."""
    model, theirs, twin, ours = pair(opt)
    data = batches(3)
    for m, o in ((model, theirs), (twin, ours)):
        with o.no_step() if o is ours else contextlib.nullcontext():
            loss_of(m, data[0]).backward()
        o.zero_grad(set_to_none=False)
    key, bad = ("betas", (1.5, 0.999)) if opt == "adamw" else ("momentum", -1.0)
    good = ours.param_groups[0][key]
    ours.param_groups[0][key] = bad

    def first_layer(m):  # a pass through part of the model: its first gradient is not the one the optimizer watches
        return m.a(data[1][0]).square().mean()

    with pytest.raises(ValueError, match="Invalid"):
        first_layer(twin).backward()
    assert all(p.grad is None or not p.grad.any() for p in twin.parameters()), "the refused pass left a gradient"
    ours.param_groups[0][key] = good
    for m, o in ((model, theirs), (twin, ours)):
        first_layer(m).backward()
        o.step()
        o.zero_grad()
    assert_matches_torch(twin, model, ours, theirs, 1)


# ---------------------------------------------------------------------- a refused backward pass


@pytest.mark.parametrize("bucket_size", BUCKETS)
@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_refused_second_backward_leaves_nothing_behind(opt, bucket_size):
    """A second backward pass without step() (or zero_grad()) in between is refused at its first gradient: no
    gradient stays in .grad for a later pass or step() to apply, and training then matches torch.optim
    run without the refused pass (the loop calls no zero_grad(), which in-backward mode does not need)."""
    model, theirs, twin, ours = pair(opt, bucket_size=bucket_size)
    data = batches(4)
    for step, batch in enumerate([data[0], data[1], data[3]], 1):
        torch_step(model, theirs, batch)
        loss_of(twin, batch).backward()
        if step == 2:
            after = [p.detach().clone() for p in twin.parameters()]
            refused = r"second backward pass started with neither opt\.step\(\) nor opt\.zero_grad\(\)"
            with pytest.raises(RuntimeError, match=refused):
                loss_of(twin, data[2]).backward()
            assert [n for n, p in twin.named_parameters() if p.grad is not None] == [], "a gradient was left"
            assert all(torch.equal(p.detach(), a) for p, a in zip(twin.parameters(), after))
        ours.step()
        assert_matches_torch(twin, model, ours, theirs, step)


# ---------------------------------------------------------------------- gradients set by hand


@pytest.mark.parametrize("bucket_size", BUCKETS)
@pytest.mark.parametrize("opt", list(PAIRS))
def test_gradients_set_by_hand_are_stepped_by_step(opt, bucket_size):
    """torch.autograd.grad(), then p.grad = g and step(): stepped as torch.optim steps them."""
    model, theirs, twin, ours = pair(opt, bucket_size=bucket_size)
    for step, batch in enumerate(batches(3), 1):
        for m, o in ((model, theirs), (twin, ours)):
            params = list(m.parameters())
            for p, g in zip(params, torch.autograd.grad(loss_of(m, batch), params)):
                p.grad = g
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)
    assert flatopt.inspect(ours).engine.launches > 0


@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_no_step_pass_after_a_stepped_pass_is_refused_leaving_nothing(opt):
    """torch.optim would step the gradients of both passes together at the next step(); the first pass's are already
    applied and freed. The no_step() pass is refused at its first gradient, before autograd adds it to .grad; after
    zero_grad() the loop goes on as torch.optim's."""
    model, theirs, twin, ours = pair(opt)
    data = batches(3)
    torch_step(model, theirs, data[0])
    loss_of(twin, data[0]).backward()  # stepped
    values = [p.detach().clone() for p in twin.parameters()]
    with pytest.raises(RuntimeError, match=r"a backward pass under opt.no_step\(\) started after a pass that alr"):
        with ours.no_step():
            loss_of(twin, data[1]).backward()
    assert all(torch.equal(p, v) for p, v in zip(twin.parameters(), values)), "a refused pass updated a parameter"
    assert all(p.grad is None for p in twin.parameters()), "a refused pass left a gradient"
    ours.zero_grad()
    theirs.zero_grad()
    for step, batch in enumerate(data[1:], 2):
        with ours.no_step():
            loss_of(twin, batch).backward()  # accumulated, stepped by step()
        ours.step()
        ours.zero_grad()
        torch_step(model, theirs, batch)
        assert_matches_torch(twin, model, ours, theirs, step)


def test_a_step_pre_hook_after_a_stepped_pass_warns_once_that_it_came_too_late():
    """A step pre-hook runs at step(): after a pass that stepped the parameters and freed their gradients it finds
    none to change (torch.optim's would transform this step's), which step() says once, at the user's line. A
    step() with gradients still in .grad (no_step()), or with no hook, says nothing."""
    import warnings

    model, theirs, twin, ours = pair("adamw")
    seen = []
    batch = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ours.no_step():
            loss_of(twin, batch).backward()
        handle = ours.register_step_pre_hook(lambda o, a, k: seen.append([p.grad is None for p in twin.parameters()]))
        ours.step()  # the gradients accumulated under no_step(): still in .grad when the hook ran
        ours.zero_grad()
    assert seen == [[False] * 6]
    warned = []
    for _ in range(2):
        loss_of(twin, batch).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours.step()
        ours.zero_grad()
        warned.append([w for w in caught if "step pre-hook" in str(w.message)])
    assert seen[1:] == [[True] * 6] * 2, "the hook ran after the pass had freed the gradients"
    assert [len(w) for w in warned] == [1, 0], warned
    assert warned[0][0].filename == __file__, "the warning points at the user's step() line"
    handle.remove()


@pytest.mark.filterwarnings("ignore:.*received no gradient before the first step")
@pytest.mark.parametrize("opt", list(PAIRS))
def test_gradients_set_by_hand_on_some_parameters_step_those_with_skip_unused(opt):
    """torch.optim steps only the parameters whose .grad is set; so does skip_unused=True."""
    model, theirs, twin, ours = pair(opt, skip_unused=True, bucket_size=512)
    for step, batch in enumerate(batches(3), 1):
        for m, o in ((model, theirs), (twin, ours)):
            params = [m.a.weight, m.c.bias]
            for p, g in zip(params, torch.autograd.grad(loss_of(m, batch), params)):
                p.grad = g
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)
    torch.manual_seed(0)
    untouched = MLP()
    assert not torch.equal(twin.a.weight, untouched.a.weight), "a parameter with a gradient was not stepped"
    assert torch.equal(twin.b.weight, untouched.b.weight), "a parameter without a gradient was stepped"


@pytest.mark.parametrize("opt", list(PAIRS))
def test_torch_autograd_grad_over_the_parameters_is_not_a_backward_pass_of_the_optimizer(opt):
    """torch.autograd.grad() over the parameters (a gradient penalty, a norm to log) runs their tensor hooks but adds
    nothing to .grad and runs no post-accumulate-grad hook: before and after a stepped pass, and while passes are
    refused after one that raised, it is neither stepped nor refused, and training matches torch.optim."""
    model, theirs, twin, ours = pair(opt)
    data = batches(4)
    for step, batch in enumerate(data[:3], 1):
        for m, o in ((model, theirs), (twin, ours)):
            torch.autograd.grad(loss_of(m, batch), list(m.parameters()))
            loss_of(m, batch).backward()
            torch.autograd.grad(loss_of(m, batch), list(m.parameters()))
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)
    fail(twin, data[3], "function")
    with pytest.raises(RuntimeError, match=r"after the previous one raised"):
        loss_of(twin, data[3]).backward()
    grads = torch.autograd.grad(loss_of(twin, data[3]), list(twin.parameters()))
    assert all(g is not None for g in grads)
    ours.zero_grad()
    theirs.zero_grad()
    torch_step(model, theirs, data[3])
    torch_step(twin, ours, data[3])
    assert_matches_torch(twin, model, ours, theirs, 4)


# ---------------------------------------------------------------------- hooks registered after the optimizer


@pytest.mark.parametrize("bucket_size", BUCKETS)
@pytest.mark.parametrize("opt", list(PAIRS))
def test_hooks_registered_after_the_optimizer_run_before_the_step(opt, bucket_size):
    """Per-parameter clipping (in place, and by assigning p.grad) and a logging hook, registered on the
    model after the optimizer: they see each gradient before it is stepped, as with torch.optim."""
    model, theirs, twin, ours = pair(opt, bucket_size=bucket_size)

    def clip(p):  # a post-accumulate-grad hook returns None
        p.grad.clamp_(-0.02, 0.02)

    def halve(p):
        p.grad = p.grad * 0.5

    logs = {}
    for key, m in (("theirs", model), ("ours", twin)):
        log = logs[key] = []
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(clip)
            p.register_post_accumulate_grad_hook(lambda p, log=log: log.append(p.grad.norm().item()))
        m.b.weight.register_post_accumulate_grad_hook(halve)
    for step, batch in enumerate(batches(3), 1):
        torch_step(model, theirs, batch)
        loss_of(twin, batch).backward()
        assert all(p.grad is None for p in twin.parameters()), "in-backward mode keeps no gradient"
        ours.step()
        assert_matches_torch(twin, model, ours, theirs, step)
    assert sorted(logs["ours"]) == pytest.approx(sorted(logs["theirs"]), rel=1e-6, abs=0)
    assert len(logs["ours"]) == 3 * 6


@pytest.mark.filterwarnings("ignore:.*received no gradient before the first step")
@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_hook_that_drops_the_gradient_leaves_the_parameter_unstepped_with_skip_unused(opt):
    """A hook after the optimizer's that sets p.grad = None: torch.optim skips the parameter, and so
    does skip_unused=True."""
    model, theirs, twin, ours = pair(opt, skip_unused=True, bucket_size=512)

    def drop(p):
        p.grad = None

    for m in (model, twin):
        m.c.bias.register_post_accumulate_grad_hook(drop)
    for step, batch in enumerate(batches(3), 1):
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)
    torch.manual_seed(0)
    assert torch.equal(twin.c.bias, MLP().c.bias), "c.bias had no gradient and was stepped"


# ---------------------------------------------------------------------- reentrant activation checkpointing


class Checkpointed(nn.Module):
    """The head is a checkpointed segment: its gradients, the first of the backward pass, come from
    the nested backward pass reentrant checkpointing runs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.use_reentrant = True

    def forward(self, x):
        return checkpoint(self.head, torch.tanh(self.inp(x)), use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("bucket_size", BUCKETS)
def test_reentrant_checkpointing_is_refused_before_any_update(bucket_size):
    torch.manual_seed(0)
    model = Checkpointed()
    twin = copy.deepcopy(model)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ours = flatopt.AdamW(twin, lr=1e-2, weight_decay=0.1, in_backward=True, bucket_size=bucket_size)
    data = batches(3)
    for _ in range(2):  # refused again after a step(), with the same message
        with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False.*in_backward=False"):
            loss_of(twin, data[0]).backward()
        assert [n for n, p in twin.named_parameters() if p.grad is not None] == [], "a gradient was left"
        ours.step()
    for p, q in zip(twin.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), "a parameter was updated"
    assert {float(ours.state[p]["step"]) for p in twin.parameters()} == {0.0}
    assert flatopt.inspect(ours).engine.launches == 0
    # Nothing was left behind: with use_reentrant=False the optimizer trains as torch.optim does.
    model.use_reentrant = twin.use_reentrant = False
    for step, batch in enumerate(data, 1):
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)


class Tail(nn.Module):
    """A checkpointed segment followed by layers outside it: the tail's gradients, the first of the backward
    pass, come from the outer pass before the segment's nested pass runs. With a small bucket_size the
    tail's weights are buckets of their own, complete as soon as their gradients arrive."""

    def __init__(self):
        super().__init__()
        self.body = Checkpointed()
        self.tail = nn.Sequential(nn.Linear(4, 64, bias=False), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x):
        return self.tail(torch.tanh(self.body(x)))

    def checkpointing(self, reentrant):
        self.body.use_reentrant = reentrant


def tail_pair(opt, **kwargs):
    torch.manual_seed(0)
    model = Tail()
    twin = copy.deepcopy(model)
    make_ours, make_theirs = PAIRS[opt]
    return model, make_theirs(model.parameters()), twin, make_ours(twin, in_backward=True, **kwargs)


def snapshot(model, opt):
    """The parameters and every state value of ``opt``, copied."""
    params = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in model.parameters()]
    return params, states


def assert_unchanged(model, opt, before, what):
    params, states = before
    for (name, p), q, state in zip(model.named_parameters(), params, states):
        assert torch.equal(p.detach(), q), f"{what}: {name} was updated"
        assert opt.state[p].keys() == state.keys(), f"{what}: the state keys of {name} changed"
        for k, v in state.items():
            same = torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
            assert same, f"{what}: {name}'s state {k!r} changed"


@pytest.mark.parametrize("bucket_size", [64, 512])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_reentrant_checkpointing_after_layers_outside_it_is_refused_before_any_update(opt, bucket_size):
    """The tail's buckets fill before the checkpointed segment's nested pass runs: the pass is refused at
    its first gradient, from the checkpointing node in its graph, before any bucket is stepped. Nothing is
    left behind: no gradient, no state, and after zero_grad() a loop without reentrant checkpointing trains
    as torch.optim does."""
    model, theirs, twin, ours = tail_pair(opt, bucket_size=bucket_size)
    before = snapshot(twin, ours)
    data = batches(4)
    with pytest.raises(RuntimeError, match=r"by CheckpointFunction's backward.*use_reentrant=False.*No parameter was"):
        loss_of(twin, data[0]).backward()
    assert_unchanged(twin, ours, before, "the refused pass")
    assert [n for n, p in twin.named_parameters() if p.grad is not None] == [], "a gradient was left"
    engine = flatopt.inspect(ours).engine
    assert engine.launches == 0 and engine.held == 0 and engine.task is None
    ours.zero_grad()
    model.checkpointing(False)
    twin.checkpointing(False)
    for step, batch in enumerate(data[1:], 1):
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("bucket_size", [64, 512])
def test_reentrant_checkpointing_on_cuda_is_refused_before_any_update(bucket_size):
    """On CUDA the autograd engine runs the gradient hooks on the device's worker thread, not on the thread
    that called backward(): the pass's roots are read from that caller's frames (flatopt.engines.nesting)."""
    torch.manual_seed(0)
    twin = Tail().cuda()
    ours = flatopt.AdamW(twin, lr=1e-2, weight_decay=0.1, in_backward=True, bucket_size=bucket_size)
    before = snapshot(twin, ours)
    x, y = (t.cuda() for t in batches(1)[0])
    out, threads = twin(x), set()
    out.register_hook(lambda g: threads.add(threading.get_ident()))
    with pytest.raises(RuntimeError, match=r"by CheckpointFunction's backward.*use_reentrant=False.*No parameter was"):
        nn.functional.mse_loss(out, y).backward()
    assert threads and threading.get_ident() not in threads, "the backward pass ran on the calling thread"
    assert_unchanged(twin, ours, before, "the refused pass")
    assert [n for n, p in twin.named_parameters() if p.grad is not None] == [], "a gradient was left"
    engine = flatopt.inspect(ours).engine
    assert engine.launches == 0 and engine.held == 0 and engine.task is None


def test_reentrant_checkpointing_in_the_stepping_pass_of_a_window_is_refused_before_any_update():
    """With accumulation_steps=2 the second pass steps the window; run with reentrant checkpointing, it is
    refused at its first gradient, before the tail's buckets are stepped, and the window's gradients stay in
    .grad; after zero_grad() windows without reentrant checkpointing train as torch.optim does."""
    model, theirs, twin, ours = tail_pair("adamw", bucket_size=64, accumulation_steps=2)
    before = snapshot(twin, ours)
    data = batches(6)
    twin.checkpointing(False)
    loss_of(twin, data[0]).backward()
    twin.checkpointing(True)
    with pytest.raises(RuntimeError, match=r"accumulation_steps=2\): .*use_reentrant=False.*No parameter was updated"):
        loss_of(twin, data[1]).backward()
    assert_unchanged(twin, ours, before, "the refused pass")
    assert flatopt.inspect(ours).engine.launches == 0
    ours.zero_grad()
    assert all(p.grad is None for p in twin.parameters())
    model.checkpointing(False)
    twin.checkpointing(False)
    for step in (1, 2):
        for m, o in ((model, theirs), (twin, ours)):
            for batch in data[2 * step : 2 * step + 2]:
                loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)


def test_reentrant_checkpointing_whose_roots_cannot_be_found_is_refused_at_the_nested_pass(monkeypatch):
    """Where the pass's roots cannot be read (torch's engine call not found, as for a backward pass started
    from C++), the nested pass is seen at its first gradient, from the hook's frames; buckets the tail filled
    before it were stepped, and the message counts them."""
    from flatopt.engines import nesting

    monkeypatch.setattr(nesting, "_ENGINE_RUN", None)
    torch.manual_seed(0)
    model = Tail()
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=True, bucket_size=64)
    last = model.tail[2].weight.detach().clone()
    with pytest.raises(
        RuntimeError, match=r"by CheckpointFunction's backward.*[1-9]\d* parameter\(s\) stepped earlier"
    ):
        model(torch.randn(3, 8)).square().mean().backward()
    assert not torch.equal(model.tail[2].weight.detach(), last), (
        "the tail's last weight, a bucket of its own, was stepped"
    )
    assert all(p.grad is None for p in model.parameters())
    assert flatopt.inspect(opt).engine.task is None and flatopt.inspect(opt).engine.held == 0


def test_reentrant_checkpointing_under_no_step_then_step_matches_torch():
    """Under no_step() nothing is stepped during backward: the gradients accumulate in .grad, nested
    passes included, and step() steps them."""
    torch.manual_seed(0)
    model = Checkpointed()
    twin = copy.deepcopy(model)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ours = flatopt.AdamW(twin, lr=1e-2, weight_decay=0.1, in_backward=True, bucket_size=512)
    data = batches(4)
    for step in (1, 2):
        for m, o in ((model, theirs), (twin, ours)):
            with ours.no_step():
                for batch in data[2 * step - 2 : 2 * step]:
                    loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)


# ---------------------------------------------------------------------- what a refused or failed pass leaves in .grad


def grads_of(model):
    """Every parameter's .grad, copied (None where it has none)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_grads_equal(model, expected, what):
    for name, p in model.named_parameters():
        want = expected[name]
        if want is None:
            assert p.grad is None, f"{what}: {name} has a .grad, where it had none"
        else:
            assert p.grad is not None, f"{what}: {name}'s .grad was dropped"
            assert torch.equal(p.grad, want), f"{what}: {name}'s .grad changed"


@pytest.mark.parametrize("watched", [True, False])
@pytest.mark.parametrize("bucket_size", BUCKETS)
@pytest.mark.parametrize("cause", ["function", "user hook"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_step_after_a_refused_retry_steps_what_the_failed_pass_left_as_torch(opt, cause, bucket_size, watched):
    """A retry without zero_grad() after a failed pass is refused; the refusal takes nothing away from the failed
    pass, so opt.step() then steps every gradient the failed pass delivered, as torch.optim steps them (the
    user hook defers c.weight's gradient: the failed pass left it in .grad). ``watched=False``: the retry's first
    gradient (c.bias) is not the one whose tensor hook sees a pass begin, so autograd has set it in .grad when the
    pass is refused; the failed pass had taken c.bias's gradient from .grad, so the refusal sets it back to None."""
    model, theirs, twin, ours = pair(opt, bucket_size=bucket_size)
    data = batches(4)
    torch_step(model, theirs, data[0])
    torch_step(twin, ours, data[0])
    fail(model, data[1], cause)
    theirs.step()
    theirs.zero_grad()
    fail(twin, data[1], cause)
    if not watched:
        flatopt.inspect(ours).engine._arm(twin.a.weight)  # the last gradient of a pass
    left = grads_of(twin)
    before = [p.detach().clone() for p in twin.parameters()]
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"after the previous one raised.*opt\.zero_grad\(\) before"):
            loss_of(twin, data[2]).backward()
        assert_grads_equal(twin, left, "the refused retry")
        assert all(torch.equal(p.detach(), b) for p, b in zip(twin.parameters(), before))
    ours.step()
    ours.zero_grad()
    assert_matches_torch(twin, model, ours, theirs, "step() after the refused retry")
    for step, batch in enumerate(data[2:], 3):
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)


def checkpointed_pair(opt, shape, **kwargs):
    """``tail``: the pass's first gradients come from layers after the checkpointed segment (refused at the outer
    pass's first gradient); ``segment``: from inside it (refused at the nested pass's first gradient)."""
    torch.manual_seed(0)
    model = Tail() if shape == "tail" else Checkpointed()
    twin = copy.deepcopy(model)
    make_ours, make_theirs = PAIRS[opt]
    return model, make_theirs(model.parameters()), twin, make_ours(twin, in_backward=True, **kwargs)


def set_reentrant(model, reentrant):
    (model.body if isinstance(model, Tail) else model).use_reentrant = reentrant


@pytest.mark.parametrize("shape", ["tail", "segment"])
@pytest.mark.parametrize("how", ["accumulation_steps", "no_step"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_pass_refused_after_accumulated_micro_batches_leaves_their_gradients_as_they_were(opt, how, shape):
    """A pass with reentrant checkpointing, after a micro-batch accumulated by an accumulation window (the refused
    pass would be the window's second micro-batch) or under no_step() (it would step): refused at its first
    gradient, and every parameter's .grad still holds the micro-batch's gradient, that of the parameter whose
    gradient came first included. step() then steps the micro-batch as torch.optim does."""
    kwargs = dict(accumulation_steps=3) if how == "accumulation_steps" else {}
    model, theirs, twin, ours = checkpointed_pair(opt, shape, bucket_size=64, **kwargs)
    data = batches(8)
    for m in (model, twin):
        set_reentrant(m, False)
    loss_of(model, data[0]).backward()
    if how == "no_step":
        with ours.no_step():
            loss_of(twin, data[0]).backward()
    else:
        loss_of(twin, data[0]).backward()
    window = grads_of(twin)
    assert all(g is not None for g in window.values())
    before = snapshot(twin, ours)
    set_reentrant(twin, True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False.*No parameter was updated"):
            loss_of(twin, data[1]).backward()
        assert_grads_equal(twin, window, "the refused pass")
        assert_unchanged(twin, ours, before, "the refused pass")
    set_reentrant(twin, False)
    theirs.step()
    theirs.zero_grad()
    ours.step()
    ours.zero_grad()
    assert_matches_torch(twin, model, ours, theirs, "step() after the refused pass")
    for step in (1, 2):  # windows of three micro-batches, the last one stepping
        for m, o in ((model, theirs), (twin, ours)):
            micro = data[3 * step - 1 : 3 * step + 2]
            if how == "no_step" and o is ours:
                with ours.no_step():
                    for batch in micro[:-1]:
                        loss_of(m, batch).backward()
            else:
                for batch in micro[:-1]:
                    loss_of(m, batch).backward()
            loss_of(m, micro[-1]).backward()
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)


@pytest.mark.parametrize("edit", ["lr", "state"])
@pytest.mark.parametrize("how", ["step", "no_step"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_an_invalid_edit_found_by_a_backward_pass_changes_no_gradient(opt, how, edit):
    """An invalid hyper-parameter or opt.state edit is found at the first gradient of the next backward pass, which
    raises. Before the gradient reaches .grad: every .grad is as it was (none after step(), the micro-batch's after
    one under no_step()), nothing is updated, and once the edit is undone the same pass trains as torch.optim."""
    model, theirs, twin, ours = pair(opt)
    data = batches(4)
    torch_step(model, theirs, data[0])
    torch_step(twin, ours, data[0])
    if how == "no_step":
        loss_of(model, data[1]).backward()
        with ours.no_step():
            loss_of(twin, data[1]).backward()
    left = grads_of(twin)
    group, state = ours.param_groups[0], ours.state[twin.a.weight]
    key = next(k for k, v in state.items() if torch.is_tensor(v) and v.shape == twin.a.weight.shape)
    saved = group["lr"] if edit == "lr" else state[key]
    if edit == "lr":
        group["lr"] = -1.0
    else:
        state[key] = torch.zeros(3, 3)
    before = snapshot(twin, ours)  # the edit included
    for _ in range(2):
        with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0" if edit == "lr" else r"shape \(3, 3\)"):
            loss_of(twin, data[2]).backward()
        assert_grads_equal(twin, left, "the pass that raised")
        assert_unchanged(twin, ours, before, "the pass that raised")
    if edit == "lr":
        group["lr"] = saved
    else:
        state[key] = saved
    for step, batch in enumerate(data[2:], 2):
        torch_step(model, theirs, batch)
        torch_step(twin, ours, batch)
        assert_matches_torch(twin, model, ours, theirs, step)


@pytest.mark.filterwarnings("ignore:.*received no gradient before the first step")
@pytest.mark.parametrize("recovery", ["zero_grad", "step"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_micro_batch_that_raised_is_remembered_and_its_retry_refused(opt, k, recovery):
    """With accumulation_steps=k, a micro-batch whose backward pass raised leaves its gradients in .grad, as
    torch.optim does; a retry without zero_grad() or step() is refused, leaving .grad as it was, rather than
    being counted in the window (which would step it a pass early). zero_grad() or step() then recover as with
    torch.optim."""
    model, theirs, twin, ours = pair(opt, accumulation_steps=k)
    data = batches(2 + 2 * k)
    for m in (model, twin):
        fail(m, data[0], "function")
    left = grads_of(twin)
    for name, g in grads_of(model).items():
        assert (g is None) == (left[name] is None), name
        if g is not None:
            torch.testing.assert_close(left[name], g, atol=0, rtol=0)
    before = snapshot(twin, ours)
    for _ in range(k):
        with pytest.raises(RuntimeError, match=r"after the previous one raised.*opt\.zero_grad\(\) before"):
            loss_of(twin, data[1]).backward()
        assert_grads_equal(twin, left, "the refused retry")
        assert_unchanged(twin, ours, before, "the refused retry")
    for o in (theirs, ours):
        if recovery == "step":
            o.step()
        o.zero_grad()
    assert_matches_torch(twin, model, ours, theirs, f"{recovery}() after the refused retry")
    for step in (1, 2):
        for m, o in ((model, theirs), (twin, ours)):
            for batch in data[2 + k * (step - 1) : 2 + k * step]:
                loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)


@pytest.mark.parametrize("opt", list(PAIRS))
def test_a_refused_pass_whose_first_gradient_was_added_to_the_window_says_so(opt):
    """A micro-batch of a window through the whole model (its first gradient, tail.2.bias's, is the one whose
    tensor hook sees the next pass begin), then a pass through the checkpointed body alone: its first gradient,
    head.2.bias's, is added to that parameter's .grad by autograd before any hook of the optimizer sees the pass.
    The refusal cannot take it out: the message names the parameter and says to call zero_grad(), every other
    .grad holds the window's gradient, passes are refused until zero_grad(), and after it training matches
    torch.optim."""
    model, theirs, twin, ours = checkpointed_pair(opt, "tail", bucket_size=64, accumulation_steps=3)
    data = batches(8)
    for m in (model, twin):
        set_reentrant(m, False)
    loss_of(twin, data[0]).backward()
    window = grads_of(twin)
    before = snapshot(twin, ours)
    set_reentrant(twin, True)
    x, _ = data[1]
    with pytest.raises(
        RuntimeError, match=r"use_reentrant=False.*head\.2\.bias.*in \.grad now holds this pass's.*zero_grad"
    ):
        twin.body(x).square().mean().backward()
    set_reentrant(twin, False)
    changed = [n for n, p in twin.named_parameters() if not torch.equal(p.grad, window[n])]
    assert changed == ["body.head.2.bias"], changed
    assert_unchanged(twin, ours, before, "the refused pass")
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"after the previous one raised.*opt\.zero_grad\(\) before"):
            loss_of(twin, data[1]).backward()
        assert_unchanged(twin, ours, before, "the refused pass")
    assert [n for n, p in twin.named_parameters() if not torch.equal(p.grad, window[n])] == changed
    ours.zero_grad()
    for step in (1, 2):
        for m, o in ((model, theirs), (twin, ours)):
            for batch in data[3 * step - 1 : 3 * step + 2]:
                loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
        assert_matches_torch(twin, model, ours, theirs, step)


# ---------------------------------------------------------------------- version counters


@pytest.mark.parametrize("skip_unused", [False, True], ids=["zero-for-unused", "skip-unused"])
@pytest.mark.parametrize("bucket_size", BUCKETS)
def test_a_step_in_backward_counts_as_an_in_place_update_of_the_parameters_it_steps(bucket_size, skip_unused):
    """As in step mode, and as torch.optim's for-loop and foreach steps called from a post-accumulate-grad hook:
    each parameter a launch steps has its version counter bumped, so that a backward through a graph saved before
    the step raises torch's error instead of mixing old activations with new weights. A parameter without a
    gradient is bumped where it is stepped (with a zero gradient), not with skip_unused."""
    torch.manual_seed(0)
    model = MLP()
    model.register_parameter("unused", nn.Parameter(torch.randn(3)))
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=True, bucket_size=bucket_size, skip_unused=skip_unused)
    loss = loss_of(model, batches(1)[0])
    versions = {n: p._version for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="received no gradient"):
        loss.backward(retain_graph=True)  # every parameter stepped by now
    assert opt.state[model.a.weight]["step"] == 1
    for n, p in model.named_parameters():
        bumped = n != "unused" or not skip_unused
        assert (p._version > versions[n]) == bumped, f"{n}: version {versions[n]} -> {p._version}"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---------------------------------------------------------------------- zero_grad(set_to_none=False)


class Branchy(nn.Module):
    """MLP whose ``side`` layer is used only while ``use_side`` is set (a branch not taken later)."""

    def __init__(self):
        super().__init__()
        self.a, self.side, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.use_side = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_side:
            h = h + torch.tanh(self.side(h))
        return self.c(h)


@pytest.mark.parametrize("event", ["branch-not-taken", "frozen"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_zero_grad_keeping_zeros_steps_what_torch_optim_steps(opt, event):
    """After zero_grad(set_to_none=False) torch.optim's loop holds a zero .grad for every parameter that had a
    gradient, and steps it at every step whether a pass reached it or not (weight decay, moments decaying, the
    step count), also once it was frozen. In-backward mode frees the gradients it applies, and steps those
    parameters at the end of each pass all the same; after a zero_grad(set_to_none=True) they are not stepped."""
    torch.manual_seed(0)
    model = Branchy()
    twin = copy.deepcopy(model)
    make_ours, make_theirs = PAIRS[opt]
    theirs, ours = make_theirs(model.parameters()), make_ours(twin, in_backward=True)
    for step, batch in enumerate(batches(6)):
        for m, o in ((model, theirs), (twin, ours)):
            if step == 1:
                if event == "frozen":
                    m.side.requires_grad_(False)
                else:
                    m.use_side = False
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad(set_to_none=step == 3)  # kept as zeros but after step 3
        assert_matches_torch(twin, model, ours, theirs, step)
    if opt == "adamw":  # stepped at steps 0-3 (a zero .grad at 1-3), not after the zero_grad(set_to_none=True)
        assert float(ours.state[twin.side.weight]["step"]) == float(theirs.state[model.side.weight]["step"]) == 4.0
