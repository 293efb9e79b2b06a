"""How gradients reach the flat gradient buffer (flatopt.grads).

``zero_grad()`` (set_to_none=True, torch's default) sets every ``.grad`` to None and releases the
storage; covered layers write their gradients into their slots and a hook copies each other new
gradient in (tests/test_direct_grads.py covers the covered layers through the optimizer);
``zero_grad(set_to_none=False)`` zeroes the buffer and autograd adds into the views. Both must leave
the same buffers and train the same, bit for bit, and match torch.optim; ``.grad`` set to None or
replaced behind the optimizer's back is settled at the step; no gradient outlives its hook; the
hooks neither pile up nor outlive their optimizer.
"""

import contextlib
import copy
import gc
import re
import warnings
import weakref

import pytest
import torch
from torch import nn

import flatopt

SAME = dict(rtol=0.0, atol=0.0)
TOL = dict(rtol=1e-6, atol=1e-7)  # flatopt against torch.optim: the same formula, float32, another order
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)  # gradients at parameters that differ by TOL


class Tied(nn.Module):
    """A head tied to the embedding (one parameter, two uses), a layer used twice, a parameter reached
    only from the second micro-batch on, and a layer never used."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.late = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)

    def forward(self, idx, late=False):
        h = self.emb(idx)
        h = self.mid(torch.tanh(self.mid(h)))
        if late:
            h = self.late(h)
        return (h @ self.emb.weight.t()).logsumexp(-1).mean()


def hooks(model):
    """Post-accumulate-grad hooks per parameter."""
    return [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()]


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (4, 5), generator=g) for _ in range(n)]


def three(seed=0, skip_unused=False, **hp):
    """The same Tied model three times: flatopt with zero_grad(), flatopt with zero_grad(set_to_none=False),
    torch.optim.AdamW (to be zeroed with set_to_none=False). With ``skip_unused=False`` flatopt steps every
    parameter, and torch.optim's parameters start with zero gradients so that it does too; with
    ``skip_unused=True`` (the default of flatopt) neither steps a parameter whose .grad is None."""
    torch.manual_seed(seed)
    hp = {"lr": 1e-2, "weight_decay": 0.1, **hp}
    models = [Tied() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = [flatopt.AdamW(models[i], skip_unused=skip_unused, **hp) for i in (0, 1)]
    for p in models[2].parameters() if not skip_unused else ():
        p.grad = torch.zeros_like(p)
    opts.append(torch.optim.AdamW(models[2].parameters(), **hp))
    return models, opts


def assert_view(p, opt, what):
    buf = next(b for b in flatopt.inspect(opt).buffers if p in b.index)
    start = buf.index[p][0]
    assert p.grad is not None, f"{what}: .grad is None"
    # plain integers: a failing assertion must not print the buffer, whose storage may be released
    where, home = p.grad.untyped_storage().data_ptr(), buf.grad.untyped_storage().data_ptr()
    assert where == home, f"{what}: not in the buffer"
    offset, expected = p.grad.storage_offset(), buf.grad.storage_offset() + start
    assert offset == expected, f"{what}: at the wrong place"


@pytest.mark.filterwarnings("ignore:.*received no gradient")
@pytest.mark.parametrize("skip_unused", [True, False], ids=["default", "skip_unused=False"])
@pytest.mark.parametrize("micro", [1, 3])
def test_both_zero_grads_train_alike_and_match_torch(micro, skip_unused):
    """Over 8 steps of ``micro`` micro-batches (the late parameter gets its first gradient in the second):
    zero_grad() and zero_grad(set_to_none=False) leave the same gradient buffers and parameters and states,
    bit for bit, and match torch.optim. Between zero_grad() and step(), a .grad is None or its view; after
    the step, a view (by default, None where no gradient came, as in torch)."""
    (ours, keep, ref), (opt, opt_keep, opt_ref) = three(skip_unused=skip_unused)
    data = batches(8 * micro)
    for step in range(8):
        opt.zero_grad()
        opt_keep.zero_grad(set_to_none=False)
        opt_ref.zero_grad(set_to_none=False)
        assert all(p.grad is None for p in ours.parameters())
        for i in range(micro):
            x = data[step * micro + i]
            for m in (ours, keep, ref):
                m(x, late=i > 0).backward()
        for name, p in ours.named_parameters():
            if name.startswith("unused") or (micro == 1 and name.startswith("late")):
                assert p.grad is None, f"step {step}: {name} received no gradient, its .grad must be None"
            else:
                assert_view(p, opt, f"step {step}, {name}")
        opt.step()
        opt_keep.step()
        opt_ref.step()
        assert torch.equal(flatopt.inspect(opt).buffers[0].grad, flatopt.inspect(opt_keep).buffers[0].grad), (
            f"step {step}: gradient buffers"
        )
        for (name, p), q, r in zip(ours.named_parameters(), keep.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"step {step}, {name}: {m}")
            torch.testing.assert_close(p, r, **TOL, msg=lambda m: f"step {step}, {name} vs torch: {m}")
            if r.grad is None:
                assert p.grad is None and q.grad is None, f"step {step}, {name}: a .grad where torch has none"
                continue
            assert_view(p, opt, f"step {step}, {name} after step()")
            torch.testing.assert_close(
                p.grad, r.grad, **GRAD_TOL, msg=lambda m: f"step {step}, {name}.grad vs torch: {m}"
            )
        for key, value in flatopt.inspect(opt_keep).buffers[0].states.items():
            assert torch.equal(flatopt.inspect(opt).buffers[0].states[key], value), f"step {step}: state {key}"
    assert ours.unused.weight.grad is None if skip_unused else not ours.unused.weight.grad.any()


@pytest.mark.filterwarnings("ignore:.*received no gradient")
@pytest.mark.parametrize(
    "behind_the_back",
    [
        "model.zero_grad()",
        "module.zero_grad()",
        "p.grad = tensor",
        "zero_grad(set_to_none=False) then model.zero_grad()",
    ],
)
def test_grads_set_to_none_or_replaced_behind_the_optimizers_back(behind_the_back):
    """torch.optim takes a .grad however it got there; so does flatopt, copying it into the buffer at
    step(): model.zero_grad() instead of opt.zero_grad(), a submodule's zero_grad(), a .grad assigned
    a tensor of its own. The steps match those of opt.zero_grad() exactly."""
    (ours, keep, _), (opt, opt_keep, _) = three()
    for step, x in enumerate(batches(6)):
        if behind_the_back == "model.zero_grad()":
            ours.zero_grad()
        elif behind_the_back == "module.zero_grad()":
            opt.zero_grad(set_to_none=False)
            ours.mid.zero_grad()  # the middle of the buffer: step() checks only its ends at most steps
        elif behind_the_back.startswith("zero_grad(set_to_none=False)"):
            opt.zero_grad(set_to_none=False)
            ours.zero_grad()
        else:
            opt.zero_grad()
        opt_keep.zero_grad(set_to_none=False)
        for m in (ours, keep):
            m(x).backward()
        if behind_the_back == "p.grad = tensor":
            ours.mid.weight.grad = ours.mid.weight.grad.clone() * 2
            keep.mid.weight.grad.mul_(2)
        opt.step()
        opt_keep.step()
        for (name, p), q in zip(ours.named_parameters(), keep.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"step {step}, {name}: {m}")
            assert_view(p, opt, f"step {step}, {name}")
    opt.check_bindings(full=True)


@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_clip_grad_norm_and_grad_scaler_unscale_between_backward_and_step():
    """After zero_grad() the unused parameters' .grad is None until the step: torch's clip_grad_norm_ and
    GradScaler.unscale_ skip them, flatopt's clip_grad_norm_ settles them first; all agree with the
    zeroed-buffer way (torch's clip_grad_norm_ sums the norms of fewer tensors: to rounding)."""
    (ours, keep, _), (opt, opt_keep, _) = three()
    scalers = [torch.amp.GradScaler("cpu", init_scale=4.0) for _ in range(2)]
    for step, x in enumerate(batches(4)):
        opt.zero_grad()
        opt_keep.zero_grad(set_to_none=False)
        norms = []
        for m, o, sc in zip((ours, keep), (opt, opt_keep), scalers):
            sc.scale(m(x)).backward()
            sc.unscale_(o)
            norms.append(o.clip_grad_norm_(0.05) if step % 2 else nn.utils.clip_grad_norm_(m.parameters(), 0.05))
            sc.step(o)
            sc.update()
        torch.testing.assert_close(norms[0], norms[1], **TOL, msg=lambda m: f"step {step}: gradient norms: {m}")
        for (name, p), q in zip(ours.named_parameters(), keep.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")


def test_no_gradient_outlives_its_hook():
    """Each new gradient is copied into the buffer as it arrives and freed: after backward, none of the
    gradient tensors autograd produced is alive (flatopt holds one beyond its buffers at a time)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = flatopt.AdamW(model)
    produced = []
    for p in model.parameters():
        p.register_hook(lambda g: produced.append(weakref.ref(g)))  # runs before the gradient is accumulated
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    gc.collect()
    assert len(produced) == 6
    assert all(r() is None for r in produced), "a gradient autograd produced is still alive after backward"
    for p in model.parameters():
        assert_view(p, opt, "after backward")


@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_hooks_are_registered_once_and_go_with_their_optimizer():
    """One hook per parameter whatever the zero_grad()s; a second optimizer over the same parameters takes
    them over (the first one's hooks stay until it is gone but copy nothing into the buffers the parameters
    left); an optimizer that is garbage collected takes its hooks with it."""
    torch.manual_seed(0)
    model = Tied()
    base = hooks(model)
    opt = flatopt.AdamW(model, direct_grads=False)  # every parameter lands by hook
    model(batches(1)[0], late=True).backward()  # the first step removes the hooks that look for unused parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert hooks(model) == [n + 1 for n in base]
    for set_to_none in (True, False, True, False):  # the last keeps the storage, which the test reads below
        opt.zero_grad(set_to_none=set_to_none)
        assert hooks(model) == [n + 1 for n in base]
    second = flatopt.SGD(model, lr=0.1, direct_grads=False)
    left = [b.grad.clone() for b in flatopt.inspect(opt).buffers]
    for x in batches(2):
        second.zero_grad()
        model(x, late=True).backward()
        second.step()
    assert hooks(model) == [n + 2 for n in base]  # the first optimizer's hooks are still registered...
    for b, before in zip(flatopt.inspect(opt).buffers, left):  # ...and copied nothing into the buffers left
        assert torch.equal(b.grad, before)
    del left
    second.check_bindings(full=True)
    with pytest.raises(RuntimeError, match="was laid out by another flatopt optimizer"):
        opt.check_bindings(full=True)
    del opt, second
    gc.collect()
    assert hooks(model) == base


@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_add_param_group_moves_the_hooks_to_the_new_buffers():
    torch.manual_seed(0)
    model, extra = Tied(), nn.Linear(6, 6)
    ref, ref_extra = copy.deepcopy(model), copy.deepcopy(extra)
    opt = flatopt.AdamW(model.parameters(), lr=1e-2)
    opt_ref = flatopt.AdamW(ref.parameters(), lr=1e-2)
    for o, e in ((opt, extra), (opt_ref, ref_extra)):
        o.add_param_group({"params": list(e.parameters()), "lr": 3e-2})
    for step, x in enumerate(batches(3)):
        opt.zero_grad()
        opt_ref.zero_grad(set_to_none=False)
        for m, e in ((model, extra), (ref, ref_extra)):
            (m(x) + e(m.emb(x)).square().mean()).backward()
        opt.step()
        opt_ref.step()
        for (name, p), q in zip(list(model.named_parameters()) + list(extra.named_parameters()),
                                list(ref.parameters()) + list(ref_extra.parameters())):  # fmt: skip
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"step {step}, {name}: {m}")
    assert all(n == 1 for n in hooks(model) + hooks(extra))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_gradient_is_left_for_the_caller_and_refused_at_step():
    """A gradient with autograd history (backward(create_graph=True)) cannot live in the buffer: the hook
    leaves it in .grad, where a gradient penalty can still use it, and step() refuses it by name, changing
    nothing."""
    torch.manual_seed(0)
    model = Tied()
    opt = flatopt.AdamW(model)
    opt.zero_grad()
    model(batches(1)[0]).backward(create_graph=True)
    assert model.mid.weight.grad.requires_grad  # left as autograd made it
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"\.grad of parameter 'emb\.weight' requires grad.*create_graph"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert model.unused.weight.grad is None  # not settled: the refused step changed nothing
    for p in model.parameters():
        p.grad = None  # break the graph's reference cycle


def test_a_nan_gradient_does_not_poison_later_steps():
    """The flat clip multiplies the parameters' views only: a nan norm once leaves the buffer's padding at
    zero, so the next steps' norms are finite again (the padding is never zeroed by zero_grad() now)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))  # 15 and 4 elements: padded to 64 each
    ref = copy.deepcopy(model)
    opt, ref_opt = flatopt.AdamW(model, lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1)
    norms, ref_norms = [], []
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(2, 4, generator=g)
        if step == 0:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).sum().backward()
        ref.zero_grad()
        ref(x).sum().backward()
        norms.append(opt.clip_grad_norm_(1.0))
        ref_norms.append(nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        assert (
            not flatopt.inspect(opt)
            .buffers[0]
            .grad[flatopt.inspect(opt).buffers[0].index[model[0].weight][1] : 64]
            .any()
        ), "padding not zero"
        if torch.isfinite(norms[-1]):
            opt.step()
            ref_opt.step()
    assert torch.isnan(norms[0]) and torch.isnan(ref_norms[0])
    for step in (1, 2):
        torch.testing.assert_close(norms[step], ref_norms[step], **TOL, msg=lambda m: f"step {step}: {m}")


@pytest.mark.filterwarnings("ignore:.*received no gradient")
@pytest.mark.parametrize("how", ["replaced", "set to None"])
def test_a_grad_changed_after_backward_in_the_middle_of_a_buffer_is_seen_at_once(how):
    """zero_grad(set_to_none=False), backward, then the middle parameter's .grad replaced or set to None: the
    very next step uses what .grad says (every step compares every .grad with its view), as torch.optim does
    (with set_to_none=False, torch steps a None .grad's parameter not at all: compared with skip_unused)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    opt = flatopt.SGD(model, lr=0.1, skip_unused=how == "set to None")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(3, 4, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=False)
            m(x).sum().backward()
            if how == "replaced":
                m[1].weight.grad = m[1].weight.grad * -3.0
            else:
                m[1].weight.grad = None
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")
        if how == "replaced":
            assert_view(model[1].weight, opt, f"step {step}, after step()")
        else:  # skip_unused leaves a .grad that is None as None, as torch does
            assert model[1].weight.grad is None and ref[1].weight.grad is None


@pytest.mark.parametrize("between", ["nothing", "clip_grad_norm_", "check_bindings", "set_to_none=False", "scaler"])
def test_skip_unused_decides_from_grad_as_torch_does(between):
    """skip_unused=True steps exactly the parameters whose .grad is not None at step(), as torch.optim: one
    whose gradient was set by hand (no backward reached it) is stepped, one whose .grad was set to None
    after backward is not, one never used is not, also when clipping, check_bindings(), zero_grad(
    set_to_none=False) or GradScaler's unscale_ came between (they see the views zeroed, .grad stays None)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 4))  # [3]: never used
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = flatopt.AdamW(model, lr=0.1, weight_decay=0.1, skip_unused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    scalers = {id(o): torch.amp.GradScaler("cpu", init_scale=4.0) for o in (opt, ref_opt)}
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(3, 4, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=between != "set_to_none=False")
            loss = m[2](x).sum()  # only the last layer
            (scalers[id(o)].scale(loss) if between == "scaler" else loss).backward()
            if step % 2 == 0:
                m[1].weight.grad = torch.full_like(m[1].weight, 0.5)  # no backward reached it
            else:
                m[2].bias.grad = None  # backward reached it, then it was dropped
            if between == "clip_grad_norm_":
                (o.clip_grad_norm_ if o is opt else lambda n: nn.utils.clip_grad_norm_(m.parameters(), n))(0.3)
            elif between == "check_bindings" and o is opt:
                o.check_bindings()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if between == "scaler":
                    scalers[id(o)].unscale_(o)
                    nn.utils.clip_grad_norm_(m.parameters(), 0.3)
                    scalers[id(o)].step(o)
                    scalers[id(o)].update()
                else:
                    o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")
            assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: .grad None or not as in torch"
        assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()
        for i, state in ref_opt.state_dict()["state"].items():
            assert float(opt.state_dict()["state"][i]["step"]) == float(state["step"]), f"step {step}, param {i}"


def test_first_step_warning_names_the_parameters_stepped_without_a_gradient():
    """The warning names the parameters whose .grad is None at the first step (and those no backward wrote
    into): not one whose .grad was set by hand, and one whose .grad was dropped after backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    opt = flatopt.AdamW(model, skip_unused=True)
    model[2](torch.randn(3, 4)).sum().backward()
    model[1].weight.grad = torch.ones_like(model[1].weight)
    model[2].bias.grad = None
    with pytest.warns(UserWarning, match="received no gradient") as record:
        opt.step()
    (message,) = [str(w.message) for w in record]
    named = set(re.findall(r"'([\w.]+)'", message.split(":", 1)[1].split(". flatopt")[0]))
    assert named == {"0.weight", "0.bias", "1.bias", "2.bias"}, message


def test_a_sparse_grad_set_by_hand_is_refused_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = flatopt.AdamW(model)
    model(torch.randn(2, 4)).sum().backward()
    model[0].bias.grad = model[0].bias.grad.to_sparse()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients: parameter '0\.bias' has a"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.requires_cuda
@pytest.mark.filterwarnings("ignore:.*received no gradient")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_zero_grads_train_alike_on_the_gpu(dtype):
    """On CUDA with the Triton kernels, bf16 autocast for float32 parameters: zero_grad() (hooks copy on the
    autograd engine's device thread) and zero_grad(set_to_none=False) leave equal gradient buffers and
    parameters over 10 steps with 2 micro-batches and clipping, and the new gradients are freed."""
    torch.manual_seed(0)
    models = [Tied().cuda().to(dtype) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [flatopt.AdamW(m, lr=1e-2, weight_decay=0.1) for m in models]
    data = [
        torch.randint(0, 11, (64, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        for i in range(20)
    ]
    for step in range(10):
        for m, o, set_to_none in ((models[0], opts[0], True), (models[1], opts[1], False)):
            o.zero_grad(set_to_none=set_to_none)
            for micro in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is torch.float32):
                    loss = m(data[2 * step + micro], late=micro == 1)
                loss.backward()
            o.clip_grad_norm_(0.5)
            o.step()
        grads = [flatopt.inspect(o).buffers[0].grad for o in opts]
        torch.testing.assert_close(grads[0], grads[1], **SAME)
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"step {step}, {name}: {m}")
            assert_view(p, opts[0], f"step {step}, {name}")


@pytest.mark.requires_cuda
def test_captured_step_shows_its_gradients_after_zero_grad_between_replays():
    """opt.zero_grad() between two replays sets every .grad to None; the next replay writes the gradients
    into the views and puts the views back in .grad, equal to an eager step's."""
    torch.manual_seed(0)
    model, ref = Tied().cuda(), None
    ref = copy.deepcopy(model)
    opt = flatopt.AdamW(model, lr=1e-2)
    opt_ref = flatopt.AdamW(ref, lr=1e-2)
    data = [
        torch.randint(0, 11, (64, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(4)
    ]

    def train_step(x):
        model(x).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = opt.capture(train_step, data[0])
        for i, x in enumerate(data):
            opt.zero_grad()
            step(x)
            opt_ref.zero_grad()
            ref(x).backward()
            opt_ref.step()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_view(p, opt, f"replay {i}, {name}")
                torch.testing.assert_close(p.grad, q.grad, **SAME, msg=lambda m: f"replay {i}, {name}.grad: {m}")
                torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"replay {i}, {name}: {m}")
    step.release()


def test_the_hooks_stay_out_of_saved_and_copied_models():
    """torch.save(model) and copy.deepcopy(model) work while the optimizer's hooks are on the parameters,
    and neither the loaded model nor the copy carries them (a copy trains on its own)."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = flatopt.AdamW(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    for other in (torch.load(saved, weights_only=False), copy.deepcopy(model)):
        assert hooks(other) == [0, 0, 0, 0]
        other(torch.randn(2, 4)).sum().backward()
        assert all(p.grad is not None for p in other.parameters())
        assert all(p.grad is None for p in model.parameters()), "a copy's backward reached the optimizer's hooks"


@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_deferred_landing_copies_every_gradient_at_settle():
    """What a captured step records: the hooks leave each new gradient where autograd put it, and settle()
    copies them all in with one batched copy per (dtype, device) after backward; the buffers end as with
    the hooks' copies, for a model with a float32 and a bfloat16 buffer and two backward passes."""
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 1))
        models.append(m)
    models[1].load_state_dict(models[0].state_dict())
    opts = [flatopt.AdamW(m, lr=1e-2, direct_grads=False) for m in models]  # every gradient by hook
    assert len(flatopt.inspect(opts[0]).buffers) == 2

    def loss(m, x):
        return m[2](m[1](m[0](x).to(torch.bfloat16)).float()).sum()

    x = [torch.randn(3, 4) for _ in range(2)]
    for m, o, deferred in ((models[0], opts[0], True), (models[1], opts[1], False)):
        o.zero_grad()
        with flatopt.inspect(o).landing.deferring() if deferred else contextlib.nullcontext():
            for xi in x:
                loss(m, xi).backward()
            if deferred:
                assert not any(p.grad.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr()
                               for p in m.parameters() for b in flatopt.inspect(o).buffers), "copied early"  # fmt: skip
        o.step()
    for b, c in zip(flatopt.inspect(opts[0]).buffers, flatopt.inspect(opts[1]).buffers):
        assert torch.equal(b.grad, c.grad)
        assert torch.equal(b.data, c.data)
    for p in models[0].parameters():
        assert_view(p, opts[0], "after settle")


@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_deferred_landing_copies_gradients_that_share_storage_at_once():
    """Autograd hands both branches of an add views of one tensor: two parameters' .grad share storage. Left
    in the pool together, an in-place change (a second micro-batch, unscale_) would reach both twice; the
    second one is copied at once, so the captured body matches eager flatopt."""
    from flatopt.capture import RecordedBody

    torch.manual_seed(0)
    w = torch.randn(12)
    ps = [[nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3, 4))] for _ in range(2)]
    ps[1][0].data.copy_(ps[0][0])
    ps[1][1].data.copy_(ps[0][1])
    opts = [flatopt.SGD(pair, lr=0.1) for pair in ps]

    def train_step(a, b):
        for _ in range(2):
            (w * (a.view(-1) + b.view(-1))).sum().backward()

    body = RecordedBody(opts[0], lambda: train_step(*ps[0]), [])
    for _ in range(2):
        opts[0].engine.refresh_hparams()  # as each replay's call does before the graph runs
        body.run()
        opts[1].zero_grad()
        train_step(*ps[1])
        opts[1].step()
        for p, q in zip(ps[0], ps[1]):
            torch.testing.assert_close(p.grad, 2 * w.view(3, 4), **SAME)
            torch.testing.assert_close(p, q, **SAME)


def steps_like_torch_sgd(model, edit, steps=3):
    """flatopt.SGD and torch.optim.SGD on copies of ``model`` (4 inputs); ``edit(model, opt, step)`` runs
    between backward and step on both. Parameters compared after every step; returns flatopt's SGD."""
    ref = copy.deepcopy(model)
    opt, ref_opt = flatopt.SGD(model, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(3, 4, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).sum().backward()
            edit(m, o, step)
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, {name}: {m}")
    return opt


def test_a_grad_replaced_by_a_view_of_the_buffer_is_copied_from_a_copy():
    """``p.grad = p.grad.t()`` (a square weight) and another parameter's .grad swapped in: each new .grad is
    a view into the flat gradient buffer that overlaps what settling writes. Stepped as torch.optim steps
    the same .grads."""

    def edit(m, o, step):
        m[0].weight.grad = m[0].weight.grad.t()
        m[1].weight.grad, m[0].bias.grad = m[0].weight.grad * 1.0, m[1].bias.grad

    torch.manual_seed(0)
    steps_like_torch_sgd(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), edit).check_bindings(full=True)


def test_a_grad_replaced_after_clipping_is_seen_by_step():
    """clip_grad_norm_() settles the gradients between zero_grad() and step(); a .grad replaced after it is
    still seen by step(), as torch.optim sees it."""

    def edit(m, o, step):
        if isinstance(o, flatopt.SGD):
            o.clip_grad_norm_(1.0)
        else:
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        m[1].weight.grad = torch.full_like(m[1].weight, 0.25 * step)

    torch.manual_seed(0)
    steps_like_torch_sgd(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)), edit)


@pytest.mark.parametrize("skip_unused", [True, False], ids=["default", "skip_unused=False"])
def test_a_sparse_grad_set_in_the_middle_of_a_buffer_is_refused_at_the_next_step(skip_unused):
    """Every step looks at every .grad (as torch.optim's does): a sparse .grad put on a parameter in the middle
    of a buffer, with no zero_grad() since the last step, is refused by name, changing nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    opt = flatopt.SGD(model, lr=0.1, skip_unused=skip_unused)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    opt.step()
    model(x).sum().backward()  # no zero_grad(): accumulated into the views
    model[1].weight.grad = torch.eye(4).to_sparse()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients: parameter '1\.weight'"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
