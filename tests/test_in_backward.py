"""In-backward mode (``in_backward=True``): parameters stepped from post-accumulate-grad hooks, in
buckets, during backward. It must equal step mode, bundle launches, bound the gradient memory it
holds, and refuse what cannot work in one pass before it changes anything where it can."""

import copy
import warnings

import pytest
import torch
from conftest import Net, device_for, loss_fn, make_batch, param_groups, pretend_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatopt

OPTIMIZERS = {
    "adamw": lambda ps, **k: flatopt.AdamW(ps, lr=1e-2, weight_decay=0.1, **k),
    "sgd": lambda ps, **k: flatopt.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, **k),
    "lion": lambda ps, **k: flatopt.Lion(ps, lr=1e-3, weight_decay=0.1, **k),
}
EXACT = dict(atol=1e-6, rtol=0.0)  # fp32: the same kernel math on the same gradients


def assert_models_equal(ours, theirs, opt_ours, opt_theirs, step):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"step {step}, {name}: {m}")
        for key, value in opt_theirs.state.get(q, {}).items():
            mine = opt_ours.state[p][key]
            torch.testing.assert_close(mine, value, **EXACT, msg=lambda m: f"step {step}, {name}.{key}: {m}")


def train_both(make, model, steps=10, groups=False, sched=None, skip_unused=False, bucket_size=None, forward=None):
    """Train ``model`` in step mode and a copy in in-backward mode on the same batches, comparing."""
    device = next(model.parameters()).device
    twin = copy.deepcopy(model)
    forward = forward or loss_fn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused-parameter warning is tested on its own
        params = (lambda m: param_groups(m, weight_decay=0.1)) if groups else (lambda m: m.parameters())
        ref = make(params(model), skip_unused=skip_unused)
        ours = make(params(twin), skip_unused=skip_unused, in_backward=True, bucket_size=bucket_size)
        scheds = [sched(ref), sched(ours)] if sched else []
        gen = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            batch = make_batch(gen, device=device)
            forward(model, batch).backward()
            ref.step()
            ref.zero_grad()
            forward(twin, batch).backward()
            ours.step()
            ours.zero_grad()
            for s in scheds:
                s.step()
            assert_models_equal(twin, model, ours, ref, step)
    return twin, ours


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("bucket_size", [1, 200, None])
def test_matches_step_mode(backend, opt, bucket_size):
    """Tied (embedding/head), frozen, unused and channels_last parameters, two param groups."""
    torch.manual_seed(0)
    model = Net().to(device_for(backend))
    twin, ours = train_both(
        lambda ps, **k: OPTIMIZERS[opt](ps, backend=backend, **k), model, groups=True, bucket_size=bucket_size
    )
    for p in twin.parameters():
        assert p.grad is None, "in-backward mode keeps no gradient after backward"
    assert flatopt.inspect(ours).engine.launches == 10 * len(flatopt.inspect(ours).engine.buckets)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_skip_unused_matches_step_mode(opt):
    torch.manual_seed(0)
    twin, ours = train_both(OPTIMIZERS[opt], Net(), skip_unused=True, bucket_size=64)
    assert "exp_avg" not in ours.state_dict()["state"].get(len(list(twin.parameters())) - 1, {})
    assert not ours.state_dict()["state"].keys() - {i for i, p in enumerate(twin.parameters()) if p.requires_grad}


def test_scheduler_changes_lr_every_step():
    torch.manual_seed(0)
    sched = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=20)  # noqa: E731
    _, ours = train_both(OPTIMIZERS["adamw"], Net(), sched=sched, steps=12, bucket_size=100)
    assert ours.param_groups[0]["lr"] != ours.defaults["lr"]


class Blocks(nn.Module):
    def __init__(self, n=6, dim=24, use_reentrant=None):
        super().__init__()
        self.inp = nn.Linear(3 * 7 * 7 + 5, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.out = nn.Linear(dim, 19)
        self.use_reentrant = use_reentrant

    def forward(self, img, tokens):
        h = torch.tanh(self.inp(torch.cat([img.flatten(1), tokens.float()], dim=1)))
        for block in self.blocks:
            if self.use_reentrant is None:
                h = torch.tanh(block(h))
            else:
                h = checkpoint(lambda x, b=block: torch.tanh(b(x)), h, use_reentrant=self.use_reentrant)
        return self.out(h)


def test_non_reentrant_checkpointing_matches_step_mode():
    torch.manual_seed(0)
    train_both(OPTIMIZERS["adamw"], Blocks(use_reentrant=False), bucket_size=600)


def test_reentrant_checkpointing_is_refused():
    torch.manual_seed(0)
    model = Blocks(use_reentrant=True)
    opt = OPTIMIZERS["adamw"](model, in_backward=True)
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        loss_fn(model, make_batch(gen)).backward()
    assert flatopt.inspect(opt).engine.task is None and flatopt.inspect(opt).engine.held == 0, (
        "the failed pass left state behind"
    )
    # The optimizer is left usable: the same model without checkpointing trains normally afterwards.
    model.use_reentrant = None
    loss_fn(model, make_batch(gen)).backward()


def test_launches_bounded_by_buckets_and_memory_by_bucket_size():
    """300 parameters in a chain: launches per backward equal the number of buckets (a few), and
    the staging gradient held at once never exceeds one bucket, since gradients arrive in order."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(150)])
    bucket = 4096
    opt = flatopt.SGD(model, lr=1e-3, momentum=0.9, in_backward=True, bucket_size=bucket)
    ib = flatopt.inspect(opt).engine
    padded = flatopt.inspect(opt).buffers[0].numel  # each 16-element bias takes a 64-element slot
    assert len(ib.buckets) <= padded // bucket + 2
    x = torch.randn(8, 16)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
    assert ib.launches == 3 * len(ib.buckets) < 300
    assert 0 < ib.peak_held <= bucket
    assert ib.held == 0


def test_large_parameter_is_stepped_from_its_own_gradient_without_a_copy():
    """A parameter that fills its bucket exactly (numel a multiple of 64) is stepped straight from
    p.grad: no staging gradient is allocated."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    twin = copy.deepcopy(model)
    ref = flatopt.AdamW(model, lr=1e-2)
    opt = flatopt.AdamW(twin, lr=1e-2, in_backward=True, bucket_size=64 * 64)
    x = torch.randn(4, 64)
    for step in range(1, 4):
        model(x).sum().backward()
        ref.step()
        ref.zero_grad()
        twin(x).sum().backward()
        opt.step()  # steps nothing more: the next backward pass is a new step
        assert_models_equal(twin, model, opt, ref, step)
    assert len(flatopt.inspect(opt).engine.buckets) == 2
    assert flatopt.inspect(opt).engine.peak_held == 0


def test_large_parameters_get_their_own_buckets_and_small_ones_share():
    """Wide layers with biases: each weight is stepped from its own gradient (no staging), the
    biases share one bucket, and the result equals step mode."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    twin = copy.deepcopy(model)
    ref = flatopt.AdamW(model, lr=1e-2)
    opt = flatopt.AdamW(twin, lr=1e-2, in_backward=True, bucket_size=8192)
    x = torch.randn(4, 64)
    for step in range(1, 4):
        model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
        twin(x).square().mean().backward()
        opt.zero_grad()  # drops nothing (in-backward mode leaves no gradient): the next backward pass is a new step
        assert_models_equal(twin, model, opt, ref, step)
    ib = flatopt.inspect(opt).engine
    assert [len(b.params) for b in ib.buckets] == [1] * 6 + [6]
    assert ib.launches == 3 * 7
    assert ib.peak_held == 6 * 64  # only the biases' bucket was ever staged


def test_gradient_accumulation_with_no_step_matches_step_mode():
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = OPTIMIZERS["adamw"](model.parameters())
        ours = OPTIMIZERS["adamw"](twin.parameters(), in_backward=True, bucket_size=128)
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 5):
            batches = [make_batch(gen) for _ in range(3)]
            for b in batches:
                loss_fn(model, b).backward()
            ref.step()
            ref.zero_grad()
            with ours.no_step():
                for b in batches[:-1]:
                    loss_fn(twin, b).backward()
            loss_fn(twin, batches[-1]).backward()
            ours.step()
            ours.zero_grad()
            assert_models_equal(twin, model, ours, ref, step)


@pytest.mark.parametrize("called", ["nothing", "step", "zero_grad"])
def test_accumulation_without_no_step_is_refused_before_the_second_update(called):
    """A loop that accumulates over micro-batches without saying so: the second backward pass is refused at its
    first gradient, before it updates anything, in the first window (no step() called yet) as in later ones."""
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["sgd"](model, in_backward=True)
    gen = torch.Generator().manual_seed(1)
    if called != "nothing":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(model, make_batch(gen)).backward()
        getattr(opt, called)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn(model, make_batch(gen)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    steps = {float(s["momentum_buffer"].abs().sum()) for s in opt.state.values()}
    with pytest.raises(
        RuntimeError,
        match=r"second backward pass started with neither opt.step\(\) nor opt.zero_grad\(\).*"
        r"gradient_accumulation_steps.*accumulation_steps=k.*opt.no_step\(\)",
    ):
        loss_fn(model, make_batch(gen)).backward()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert {float(s["momentum_buffer"].abs().sum()) for s in opt.state.values()} == steps
    assert all(p.grad is None for p in model.parameters()), "the refused pass left a gradient"


def test_several_ranks_are_refused_at_construction(monkeypatch):
    model = Net()
    ptrs = [p.data_ptr() for p in model.parameters()]
    pretend_ranks(monkeypatch, 2)
    with pytest.raises(
        RuntimeError, match=r"in_backward=True\) cannot train with several distributed ranks"
    ) as excinfo:
        OPTIMIZERS["adamw"](model, in_backward=True)
    assert [p.data_ptr() for p in model.parameters()] == ptrs, "the failed constructor rebound parameters"
    assert "allow_several_ranks=True" in str(excinfo.value)
    pretend_ranks(monkeypatch, 1)  # one rank: nothing to average
    OPTIMIZERS["adamw"](model, in_backward=True)


def test_several_ranks_that_share_no_parameters_are_allowed_when_the_caller_says_so(monkeypatch):
    torch.manual_seed(0)
    model = Net()
    pretend_ranks(monkeypatch, 2)
    opt = OPTIMIZERS["adamw"](model, in_backward=True, allow_several_ranks=True)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn(model, make_batch(torch.Generator().manual_seed(1))).backward()
    assert flatopt.inspect(opt).engine.launches > 0
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_process_group_started_after_construction_is_refused_at_the_first_gradient(monkeypatch):
    """The check runs again when a backward pass begins, before anything is stepped: the gradients
    stay in p.grad and the parameters are unchanged."""
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["adamw"](model, in_backward=True)
    gen = torch.Generator().manual_seed(1)
    before = [p.detach().clone() for p in model.parameters()]
    pretend_ranks(monkeypatch, 4)
    with pytest.raises(RuntimeError, match=r"several distributed ranks \(4 here\).*in_backward=False with DDP"):
        loss_fn(model, make_batch(gen)).backward()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert flatopt.inspect(opt).engine.launches == 0 and flatopt.inspect(opt).engine.task is None


def test_grad_scaler_is_refused():
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["adamw"](model, in_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler.scale(loss_fn(model, make_batch(gen))).backward()
    with pytest.raises(RuntimeError, match="cannot be used with torch.amp.GradScaler"):
        scaler.step(opt)


def test_global_norm_clipping_after_an_unclipped_pass_is_refused():
    """opt.clip_grad_norm_() after a backward pass that applied its gradients: they are gone, and an optimizer
    built without max_grad_norm cannot say by what they were clipped (tests/test_in_backward_frameworks.py
    covers clipping in backward)."""
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["adamw"](model, in_backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn(model, make_batch(torch.Generator().manual_seed(1))).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"cannot clip the gradients.*Pass max_grad_norm=1.0"):
        opt.clip_grad_norm_(1.0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_backward=True, flat=False), r"in_backward=True, flat=False"),
        (dict(bucket_size=1024), "bucket_size applies to in_backward=True only"),
        (dict(in_backward=True, bucket_size=0), "Invalid bucket_size: 0"),
        (dict(in_backward=True, bucket_size=2.5), "Invalid bucket_size: 2.5"),
    ],
)
def test_conflicting_arguments(kwargs, match):
    model = Net()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        flatopt.AdamW(model, **kwargs)
    assert [p.data_ptr() for p in model.parameters()] == before


def test_unused_parameters_warn_once_at_the_end_of_the_first_backward():
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["adamw"](model, in_backward=True)
    gen = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) received no gradient.*'unused\.weight', 'unused\.bias'"):
        loss_fn(model, make_batch(gen)).backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model, make_batch(gen)).backward()
        opt.step()


def test_state_dict_round_trip_with_torch_optim():
    """5 steps in in-backward mode, saved, loaded into torch.optim.AdamW, 5 more: equal to 10 steps
    of torch.optim.AdamW; and the reverse direction (every parameter stepped: skip_unused=False, and
    torch.optim given zero gradients)."""
    torch.manual_seed(0)
    base = Net()
    for direction in ("to_torch", "from_torch"):
        ref, model = copy.deepcopy(base), copy.deepcopy(base)
        for m in (ref, model):
            for q in m.parameters():
                if q.requires_grad:
                    q.grad = torch.zeros_like(q)
        theirs = torch.optim.AdamW(param_groups(ref, weight_decay=0.1))
        gen_ref, gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if direction == "to_torch":
                first = flatopt.AdamW(
                    param_groups(model, weight_decay=0.1), in_backward=True, bucket_size=100, skip_unused=False
                )
            else:
                first = torch.optim.AdamW(param_groups(model, weight_decay=0.1))
            for _ in range(5):
                loss_fn(ref, make_batch(gen_ref)).backward()
                theirs.step()
                theirs.zero_grad(set_to_none=False)
                loss_fn(model, make_batch(gen)).backward()
                first.step()
                first.zero_grad(set_to_none=False)
            sd = copy.deepcopy(first.state_dict())
            model2 = copy.deepcopy(model)
            if direction == "to_torch":
                for q in model2.parameters():
                    if q.requires_grad:
                        q.grad = torch.zeros_like(q)
                second = torch.optim.AdamW(param_groups(model2, weight_decay=0.1))
            else:
                second = flatopt.AdamW(
                    param_groups(model2, weight_decay=0.1), in_backward=True, bucket_size=100, skip_unused=False
                )
            second.load_state_dict(sd)
            for step in range(6, 11):
                loss_fn(ref, make_batch(gen_ref)).backward()
                theirs.step()
                theirs.zero_grad(set_to_none=False)
                loss_fn(model2, make_batch(gen)).backward()
                second.step()
                second.zero_grad(set_to_none=False)
                for (name, p), q in zip(model2.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(
                        p, q, atol=2e-6, rtol=2e-5, msg=lambda m: f"{direction} {step} {name}: {m}"
                    )


def test_step_and_zero_grad_are_harmless_and_data_stays_in_the_buffer():
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS["lion"](model, in_backward=True)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn(model, make_batch(gen)).backward()
    after_backward = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    for p, b in zip(model.parameters(), after_backward):
        assert torch.equal(p.detach(), b), "step() after an in-backward update must not step again"
    buf = flatopt.inspect(opt).buffers[0]
    for p in buf.params:
        s, e = buf.index[p]
        assert buf.data.data_ptr() <= p.data_ptr() < buf.data.data_ptr() + e * buf.data.element_size()


def test_every_micro_batch_under_no_step_then_step_applies_the_sum():
    """torch.optim's accumulate-then-step: with every backward under no_step(), opt.step() steps the
    accumulated gradients."""
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = OPTIMIZERS["sgd"](model.parameters())
        ours = OPTIMIZERS["sgd"](twin.parameters(), in_backward=True, bucket_size=256)
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 4):
            batches = [make_batch(gen) for _ in range(3)]
            for b in batches:
                loss_fn(model, b).backward()
            ref.step()
            ref.zero_grad()
            with ours.no_step():
                for b in batches:
                    loss_fn(twin, b).backward()
            ours.step()
            assert all(p.grad is None for p in twin.parameters()), "step() consumed the accumulated gradients"
            ours.zero_grad()
            assert_models_equal(twin, model, ours, ref, step)


def test_zero_grad_after_no_step_drops_the_accumulated_gradients():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = flatopt.AdamW(model, lr=0.1, in_backward=True)
    with opt.no_step():
        model(torch.randn(2, 5)).sum().backward()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("out of memory (simulated)")


def test_a_backward_that_raised_is_dropped_by_zero_grad_and_training_goes_on():
    """An exception in the middle of backward (out of memory, say) leaves a pass that never ended;
    the usual retry (zero_grad, backward again) must work and match step mode from there on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=True, bucket_size=8)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="simulated"):
        model[2](Boom.apply(model[1](model[0](x)))).sum().backward()
    opt.zero_grad()
    assert flatopt.inspect(opt).engine.task is None
    model(x).sum().backward()  # the retry: no "nested backward" error
    opt.step()
    steps = {float(opt.state[p]["step"]) for p in model.parameters()}
    assert steps <= {1.0, 2.0}  # the failed pass's finished buckets stay stepped


def test_an_in_backward_optimizer_gone_takes_its_hooks_with_it():
    """The hooks hold no reference to the optimizer: once it is garbage collected, backward steps nothing."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    base = [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()]
    opt = OPTIMIZERS["adamw"](model, in_backward=True)
    assert [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()] != base
    del opt
    gc.collect()
    assert [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()] == base
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 4)).sum().backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)), "a parameter was stepped"
