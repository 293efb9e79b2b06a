"""Gradients born in the flat buffer, through the optimizer (flatopt.landing's own tests are test_landing.py):
covered layers of the model write their gradients into the flat gradient buffer during backward, the other
parameters' gradients are copied in by hook, zero_grad() frees the buffer, and training matches torch.optim."""

import copy
import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import flatopt
from flatopt.demo import CharTransformer, lm_loss

sys.path.insert(0, str(Path(__file__).parent))
from bytecount import StorageWrites  # noqa: E402

SAME = dict(rtol=0.0, atol=0.0)
TOL = dict(rtol=1e-6, atol=1e-7)  # flatopt against torch.optim: the same formula, float32, another order
HP = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


class ConvNet(nn.Module):
    """Convolutions and batch norms (not covered: their gradients are copied in), then a covered Linear head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


def transformer():
    return CharTransformer(vocab_size=13, seq_len=8, dim=16, layers=2, heads=2)


def batch(kind, gen):
    if kind == "transformer":
        x = torch.randint(0, 13, (3, 8), generator=gen)
        return x, torch.randint(0, 13, (3, 8), generator=gen)
    return torch.randn(4, 3, 6, 6, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def loss_of(kind, model, data):
    if kind == "transformer":
        return lm_loss(model, *data)
    x, y = data
    return nn.functional.cross_entropy(model(x), y)


def build(kind):
    torch.manual_seed(0)
    model = transformer() if kind == "transformer" else ConvNet()
    ref = transformer() if kind == "transformer" else ConvNet()
    ref.load_state_dict(model.state_dict())
    return model, ref


def covered_params(opt):
    return flatopt.inspect(opt).landing.slots.covered


def grad_storage(opt):
    return flatopt.inspect(opt).buffers[0].grad.untyped_storage()


@pytest.mark.parametrize("kind", ["transformer", "convnet"])
def test_training_matches_torch_and_covered_gradients_are_written_in_place(kind):
    """12 steps, every third of 2 micro-batches, along flatopt's trajectory: at each step torch.optim.AdamW
    starts from flatopt's parameters and state (a state_dict round trip), so that gradients near zero (a
    bias before a norm) cannot amplify rounding into two trajectories. Every .grad equals torch's bit for
    bit after backward and is a view into the flat buffer; the step matches torch's. During backward
    nothing is copied into the gradient buffer but the gradients of uncovered layers (by their hooks): the
    covered layers' bytes are written by the ops that compute them."""
    model, ref = build(kind)
    opt = flatopt.AdamW(model, **HP)
    opt_ref = torch.optim.AdamW(ref.parameters(), **HP)
    covered = covered_params(opt)
    assert covered and len(covered) < len(list(model.parameters()))  # some covered, some copied
    uncovered_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p not in covered)
    covered_bytes = sum(p.numel() * p.element_size() for p in covered)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        ref.load_state_dict(model.state_dict())
        if step:
            opt_ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch keeps tensors it is given
        opt.zero_grad()
        opt_ref.zero_grad()
        assert grad_storage(opt).nbytes() == 0, f"step {step}: zero_grad() left the gradient storage allocated"
        for i in range(2 if step % 3 == 0 else 1):
            data = batch(kind, gen)
            with StorageWrites(flatopt.inspect(opt).buffers[0].grad) as writes:
                loss_of(kind, model, data).backward()
            loss_of(kind, ref, data).backward()
            copied = writes.bytes("copy_")
            assert copied <= uncovered_bytes, f"step {step}: {copied} bytes copied, {writes.ops()}"
            if i == 0:  # the first micro-batch writes every covered gradient afresh
                assert writes.bytes() - copied >= covered_bytes, f"step {step}: {writes.ops()}"
        buf = flatopt.inspect(opt).buffers[0]
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.untyped_storage().data_ptr() == grad_storage(opt).data_ptr(), f"{name}: not in the buffer"
            view = next(v for r, v in zip(buf.params, buf.grad_views) if r is p)
            assert p.grad.data_ptr() == view.data_ptr(), f"{name}: at the wrong place"
            torch.testing.assert_close(p.grad, q.grad, **SAME, msg=lambda m: f"step {step}, {name}.grad: {m}")
        opt.step()
        opt_ref.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")
            for key, value in opt_ref.state[q].items():
                torch.testing.assert_close(
                    opt.state[p][key], value, **TOL, msg=lambda m: f"step {step}, {name} {key}: {m}"
                )


def test_covered_layers_run_no_python_per_parameter_in_backward():
    """After the first step, a covered parameter has no post-accumulate-grad hook of flatopt's and no tensor
    hook: its gradient is written by its layer's backward; uncovered ones keep the copying hook."""
    model, _ = build("transformer")
    base = {p: len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()}
    opt = flatopt.AdamW(model, **HP)
    gen = torch.Generator().manual_seed(0)
    lm_loss(model, *batch("transformer", gen)).backward()
    opt.step()
    covered = covered_params(opt)
    for name, p in model.named_parameters():
        hooks = len(p._post_accumulate_grad_hooks or ())
        if p in covered:
            assert hooks == base[p] and not p._backward_hooks, f"{name}: a hook left on a covered parameter"
        else:
            assert hooks == base[p] + 1, f"{name}: the copying hook is missing"
    assert {type(m) for m in model.modules() if any(p in covered for p in m.parameters(recurse=False))} == {
        nn.Linear,
        nn.Embedding,
    }


def test_param_groups_land_directly_when_the_model_is_named():
    """The usual decay / no-decay groups: with model=, the covered layers land in place; without it there is
    no module to cover and every gradient is copied in by hook. Both train alike."""
    results = []
    for kwargs in ({"model": True}, {}):
        model, _ = build("transformer")
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
        opt = flatopt.AdamW(groups, **HP, **({"model": model} if kwargs else {}))
        assert bool(covered_params(opt)) == bool(kwargs)
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            opt.zero_grad()
            data = batch("transformer", gen)
            with StorageWrites(flatopt.inspect(opt).buffers[0].grad) as writes:
                lm_loss(model, *data).backward()
            opt.step()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        assert (writes.bytes("copy_") < total) == bool(kwargs), writes.ops()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **SAME)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        flatopt.AdamW(nn.Linear(2, 2).parameters(), model="not a model")


def test_direct_grads_false_copies_every_gradient():
    model, ref = build("transformer")
    opt = flatopt.AdamW(model, direct_grads=False, **HP)
    assert not covered_params(opt)
    gen = torch.Generator().manual_seed(3)
    opt.zero_grad()
    with StorageWrites(flatopt.inspect(opt).buffers[0].grad) as writes:
        lm_loss(model, *batch("transformer", gen)).backward()
    assert writes.bytes("copy_") == sum(p.numel() * p.element_size() for p in model.parameters())


class Scaled(nn.Linear):
    """A user's Linear subclass: not covered (its forward may differ)."""

    def forward(self, x):
        return super().forward(x) * 0.5


class LoRA(nn.Module):
    """A frozen base Linear with a trainable low-rank update, as LoRA wrappers do."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Linear(base.in_features, rank, bias=False)
        self.b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).t()


def patched():
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(6, 6), nn.Tanh(), LoRA(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 6))
    parametrize.register_parametrization(model[4], "weight", Symmetric())
    return model


def test_patched_and_wrapped_layers_train_like_torch():
    """A Linear subclass and a parametrized Linear are left to torch (copied in by hook); LoRA's inner Linears
    are plain and covered. 8 steps match torch.optim.AdamW."""
    model, ref = patched(), patched()
    ref.load_state_dict(model.state_dict())
    opt = flatopt.AdamW(model, **HP)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP)
    covered = covered_params(opt)
    assert model[0].weight not in covered and model[2].a.weight in covered and model[2].b.weight in covered
    assert model[4].parametrizations.weight.original not in covered
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        x = torch.randn(5, 6, generator=gen)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_trains_like_torch(reentrant):
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
            self.head = nn.Linear(6, 1)

        def forward(self, x):
            return self.head(checkpoint(self.inner, x, use_reentrant=reentrant))

    torch.manual_seed(0)
    model, ref, probe = Checkpointed(), Checkpointed(), Checkpointed()
    ref.load_state_dict(model.state_dict())
    opt, opt_ref = flatopt.AdamW(model, **HP), torch.optim.AdamW(ref.parameters(), **HP)
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        x = torch.randn(4, 6, generator=gen, requires_grad=reentrant)  # reentrant needs an input that requires grad
        probe.load_state_dict(model.state_dict())
        probe.zero_grad()
        for m, o in ((model, opt), (ref, opt_ref), (probe, None)):
            if o is not None:
                o.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), probe.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **SAME, msg=lambda m: f"step {step}, {name}.grad: {m}")
        opt.step()
        opt_ref.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")


def test_a_step_without_any_gradient_changes_nothing():
    """zero_grad() released the buffer and no backward ran: every .grad is None, so step() changes nothing
    (as torch.optim), and the buffer stays released; with skip_unused=False it comes back zeroed and every
    parameter is stepped with a zero gradient (weight decay and momentum apply), as after
    zero_grad(set_to_none=False)."""
    model = nn.Linear(4, 3)
    keep = nn.Linear(4, 3)
    keep.load_state_dict(model.state_dict())
    opt = flatopt.SGD(model, lr=0.1, momentum=0.9, weight_decay=0.1)
    opt_keep = flatopt.SGD(keep, lr=0.1, momentum=0.9, weight_decay=0.1, skip_unused=False)
    for m, o in ((model, opt), (keep, opt_keep)):
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    opt.zero_grad()
    opt_keep.zero_grad()
    assert grad_storage(opt).nbytes() == 0
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
        opt_keep.step()
    for p, b, m in zip(model.parameters(), before, momentum):
        assert torch.equal(p.detach(), b) and p.grad is None
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
    for p, b in zip(keep.parameters(), before):
        assert not torch.equal(p.detach(), b), "skip_unused=False steps with a zero gradient"
        assert not p.grad.any()


def test_an_optimizer_gone_leaves_the_model_plain():
    """Deleting the optimizer removes its patches and hooks: the model runs torch's own layers again."""
    model, _ = build("transformer")
    base = [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()]
    opt = flatopt.AdamW(model, **HP)
    lm_loss(model, *batch("transformer", torch.Generator().manual_seed(6))).backward()
    opt.step()
    assert any("_compiled_call_impl" in m.__dict__ for m in model.modules())
    del opt  # no reference cycle: freed at once, before any collection by the garbage collector
    assert not any("_compiled_call_impl" in m.__dict__ for m in model.modules())
    gc.collect()
    assert [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()] == base


def test_model_zero_grad_then_a_backward_reaching_covered_layers_only_steps_no_stale_gradient():
    """model.zero_grad() (not the optimizer's) sets every .grad to None without releasing anything; a backward
    that reaches only covered layers writes their slots afresh, and a parameter it does not reach (between
    them in the buffer) must be stepped with a zero gradient, not with what its view held before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    keep = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    keep.load_state_dict(model.state_dict())
    opt = flatopt.SGD(model, lr=0.1)
    opt_keep = flatopt.SGD(keep, lr=0.1)
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (keep, opt_keep)):
        m(x).sum().backward()  # every parameter gets a gradient
        o.step()
    model.zero_grad()
    opt_keep.zero_grad(set_to_none=False)
    for m in (model, keep):
        (m[2](m[0](x))).sum().backward()  # the LayerNorm is skipped: no gradient for it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
        opt_keep.step()
    for (name, p), q in zip(model.named_parameters(), keep.parameters()):
        torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"{name}: {m}")


def test_a_sparse_embedding_in_a_model_named_beside_param_groups_is_refused():
    model = nn.Sequential(nn.Embedding(5, 3, sparse=True), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="does not support sparse gradients.*'0' has sparse=True"):
        flatopt.AdamW([{"params": list(model.parameters())}], model=model)


@pytest.mark.parametrize("mode", [dict(in_backward=True), dict(flat=False)])
@pytest.mark.parametrize("option", ["direct_grads", "model"])
def test_landing_options_outside_step_mode_are_named(mode, option):
    """A landing option given a value is refused outside step mode; None, the default spelled out, is not."""
    model = nn.Linear(3, 2)
    value = {"direct_grads": False, "model": model}[option]
    with pytest.raises(ValueError, match=f"{option} applies to step mode with flat=True"):
        flatopt.AdamW(model, **mode, **{option: value})
    flatopt.AdamW(nn.Linear(3, 2), **mode, **{option: None})


def test_a_second_optimizer_takes_the_model_and_the_first_writes_nothing():
    """A second optimizer over the same model (here copying every gradient in) lays the parameters out in its
    own buffers: the first optimizer's covered layers no longer write into the buffer it had."""
    model, _ = build("transformer")
    first = flatopt.AdamW(model, **HP)
    lm_loss(model, *batch("transformer", torch.Generator().manual_seed(7))).backward()
    first.step()
    second = flatopt.AdamW(model, direct_grads=False, **HP)
    gen = torch.Generator().manual_seed(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm_loss(model, *batch("transformer", gen)).backward()
        second.step()  # its first step removes the hooks it keeps until then (a tensor hook sends torch's way)
    with StorageWrites(flatopt.inspect(first).buffers[0].grad) as writes:
        second.zero_grad()
        lm_loss(model, *batch("transformer", gen)).backward()
        second.step()
    assert not writes.writes, writes.ops()
    for name, p in model.named_parameters():
        assert p.grad.untyped_storage().data_ptr() == grad_storage(second).data_ptr(), name
    del first


def test_each_captured_step_holds_the_gradient_storage_until_released():
    """Two graphs that recorded the gradient buffer's address: releasing one must not let zero_grad() free
    the storage the other still replays into."""
    model = nn.Linear(4, 3)
    opt = flatopt.AdamW(model)
    engine = flatopt.inspect(opt).engine
    engine.hold_grads()
    engine.hold_grads()
    engine.hold_grads(False)
    opt.zero_grad()
    assert grad_storage(opt).nbytes() > 0, "released while a captured step still holds it"
    engine.hold_grads(False)
    opt.zero_grad()
    assert grad_storage(opt).nbytes() == 0


@pytest.mark.parametrize("how", ["construction", "after_step", "set_to_none_false", "unused"])
def test_a_grad_the_caller_keeps_stays_readable_after_zero_grad(how):
    """A .grad kept by the caller holds the gradient storage through zero_grad(): reading it afterwards must
    not touch released memory (a crash). Whatever put the .grad there: the constructor, a step (settling), a
    zero_grad(set_to_none=False), or the zeroing of a parameter that received no gradient."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt = flatopt.AdamW(model)
    x = torch.randn(2, 4)
    if how != "construction":
        if how == "set_to_none_false":
            opt.zero_grad(set_to_none=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (model[1](model[0](x)) if how == "unused" else model(x)).sum().backward()
            opt.step()
    kept = {name: p.grad for name, p in model.named_parameters()}
    expected = {name: g.clone() for name, g in kept.items()}
    opt.zero_grad()
    assert grad_storage(opt).nbytes() > 0, "released while the caller holds a .grad"
    for name, g in kept.items():
        torch.testing.assert_close(g, expected[name], **SAME, msg=lambda m: f"{name}: {m}")
    del kept, g
    opt.zero_grad()
    assert grad_storage(opt).nbytes() == 0, "not released once nothing holds it"


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_forward_patched_on_the_instance_is_the_one_run(when):
    """accelerate's hooks and user monkeypatches replace a module's forward on the instance: that forward
    runs, whether it was set before the optimizer covered the layer or after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    inner = model[0]

    def doubled(x):
        return 2 * nn.Linear.forward(inner, x)

    if when == "before":
        inner.forward = doubled
    opt = flatopt.AdamW(model)
    if when == "after":
        inner.forward = doubled
    x = torch.randn(4, 3)
    with torch.no_grad():
        expected = model[1](2 * nn.functional.linear(x, inner.weight, inner.bias))
    out = model(x)
    torch.testing.assert_close(out, expected, **SAME)
    out.sum().backward()
    opt.step()  # the patched layer's gradient arrives by the copying hook


def test_a_forward_patched_on_the_class_is_the_one_run(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = flatopt.AdamW(model)
    original = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: 3 * original(self, x))
    x = torch.randn(4, 3)
    with torch.no_grad():
        expected = 3 * nn.functional.linear(3 * nn.functional.linear(x, model[0].weight, model[0].bias),
                                            model[1].weight, model[1].bias)  # fmt: skip
    torch.testing.assert_close(model(x), expected, **SAME)
    del opt


def test_a_captured_step_that_fails_lets_go_of_the_gradient_storage(monkeypatch):
    """capture() holds the gradient storage for the graph it records; when it fails (here: no GPU), the hold
    is let go, and zero_grad() frees the storage again."""
    from flatopt import capture

    model = nn.Linear(4, 3)
    opt = flatopt.AdamW(model)
    monkeypatch.setattr(capture, "check_capturable", lambda opt: None)  # get past the GPU check on the CPU
    monkeypatch.setattr(capture.CapturedStep, "_record", lambda self, *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        opt.capture(lambda: None)
    opt.zero_grad()
    assert grad_storage(opt).nbytes() == 0, "a failed capture kept holding the storage"
