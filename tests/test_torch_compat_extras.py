"""torch.optim behaviours around the optimizer object: copying and serialising it (refused, with the
way out), copying the model after an optimizer was created for it, the state-dict hooks, and
torch.optim's implementation options (foreach, fused, capturable, differentiable, amsgrad)."""

import copy
import inspect
import io
import pickle
import re
import warnings

import pytest
import torch
from torch import nn

import flatopt

OPTIMIZERS = {
    "AdamW": (flatopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    "Lion": (flatopt.Lion, None, dict(lr=1e-3, weight_decay=0.1)),
}
MODES = {
    "step": dict(),
    "skip_unused": dict(skip_unused=True),
    "in_backward": dict(in_backward=True),
    "unflat": dict(flat=False),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def values(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_values(model, expected):
    for p, q in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


def state_values(opt):
    sd = opt.state_dict()
    return {
        k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()} for k, v in sd["state"].items()
    }


def hooks_of(p):
    return dict(getattr(p, "_post_accumulate_grad_hooks", None) or {}), dict(p._backward_hooks or {})


# ------------------------------------------------------------------------------------------------ copies

COPIES = {
    "deepcopy": lambda opt, model: copy.deepcopy(opt),
    "deepcopy_with_model": lambda opt, model: copy.deepcopy((model, opt)),
    "deepcopy_in_a_dict": lambda opt, model: copy.deepcopy({"step": 3, "opt": opt}),
    "copy": lambda opt, model: copy.copy(opt),
    **{f"pickle_{proto}": (lambda proto: lambda opt, model: pickle.dumps(opt, proto))(proto) for proto in range(6)},
    "torch_save": lambda opt, model: torch.save(opt, io.BytesIO()),
    "torch_save_with_model": lambda opt, model: torch.save({"model": model, "opt": opt}, io.BytesIO()),
}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("steps", [0, 2])
def test_copying_or_serialising_the_optimizer_is_refused(how, mode, steps):
    """torch.optim's pickling keeps defaults, state and param_groups only, which would make a broken
    flatopt optimizer: every way of copying or serialising it raises TypeError, with what to do,
    and the optimizer goes on as if nothing happened."""
    model, twin = make_model(), make_model()
    opt, twin_opt = flatopt.AdamW(model, **MODES[mode]), flatopt.AdamW(twin, **MODES[mode])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, steps)
        train(twin, twin_opt, steps)
    before = state_values(opt)
    held = "parameters and states" if mode == "in_backward" else "parameters, gradients and states"
    why = "it holds tables on the devices" if mode == "unflat" else f"its {held} are views into flat buffers"
    pattern = (
        r"^flatopt\.AdamW cannot be pickled or copied \(copy\.deepcopy, copy\.copy, pickle, torch\.save\): "
        f"{re.escape(why)}.*Save opt\\.state_dict\\(\\) \\(torch\\.optim's format\\) and load it into an optimizer "
        "created for the copied model$"
    )
    with pytest.raises(TypeError, match=pattern):
        COPIES[how](opt, model)
    after = state_values(opt)
    assert before.keys() == after.keys()
    for k in before:
        for n, t in before[k].items():
            torch.testing.assert_close(after[k][n], t, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, 2, start=steps)
        train(twin, twin_opt, 2, start=steps)
    assert_values(model, values(twin))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_refuses_copies(name):
    cls, _, kw = OPTIMIZERS[name]
    opt = cls(make_model(), **kw)
    for how in ("deepcopy", "pickle_5", "torch_save"):
        with pytest.raises(TypeError, match=f"^flatopt\\.{name} cannot be pickled or copied"):
            COPIES[how](opt, None)


def test_torch_save_of_the_state_dict_is_the_way_out(tmp_path):
    """What the message says to do: save opt.state_dict(), create an optimizer for the copied model,
    load it; the copy then trains exactly as the original."""
    model = make_model()
    opt = flatopt.AdamW(model, lr=1e-2)
    train(model, opt, 3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    copied = make_model(seed=1)
    copied.load_state_dict(ckpt["model"])
    copied_opt = flatopt.AdamW(copied, lr=1e-2)
    copied_opt.load_state_dict(ckpt["opt"])
    train(model, opt, 3, start=3)
    train(copied, copied_opt, 3, start=3)
    assert_values(copied, values(model))


@pytest.mark.parametrize("mode", ["step", "skip_unused", "in_backward"])
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_deepcopy_of_the_model_works_and_leaves_the_optimizer_alone(mode, steps):
    """The optimizer's gradient hooks are on the parameters, but torch does not copy tensor hooks
    (nn.Parameter.__deepcopy__ copies data and requires_grad): copy.deepcopy(model) works before and
    after the first step, the copy has no hooks and its own storage, and training it (with an
    optimizer of its own, loaded from the original's state dict) does not touch the original or its
    optimizer. Compared with the same recipe on torch.optim.AdamW."""
    model, ref = make_model(), make_model()
    opt = flatopt.AdamW(model, lr=1e-2, **MODES[mode])
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, steps)
        train(ref, theirs, steps)
        if steps == 0 and mode != "in_backward":  # a backward without a step: gradients are held
            x, y = batch(99)
            nn.functional.mse_loss(model(x), y).backward()
            nn.functional.mse_loss(ref(x), y).backward()
        originals = values(model)
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        copied = copy.deepcopy(model)
        ref_copied = copy.deepcopy(ref)
        for p, q, r in zip(model.parameters(), copied.parameters(), ref_copied.parameters(), strict=True):
            assert q is not p and q.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
            torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=0)
            assert hooks_of(q) == ({}, {})
            assert q.grad is None and r.grad is None  # nn.Parameter's deepcopy leaves .grad behind, as torch's
        # the copy's backward reaches neither the original's gradients nor its in-backward hooks
        x, y = batch(100)
        nn.functional.mse_loss(copied(x), y).backward()
        assert_values(model, originals)
        for p, g in zip(model.parameters(), grads, strict=True):
            assert (p.grad is None) == (g is None)
            if g is not None:
                torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
        # the copy trains with its own optimizer, loaded from the original's state dict, as torch's does
        copied.zero_grad()
        ref_copied.zero_grad()
        copied_opt = flatopt.AdamW(copied, lr=1e-2)
        copied_opt.load_state_dict(opt.state_dict())
        ref_copied_opt = torch.optim.AdamW(ref_copied.parameters(), lr=1e-2)
        ref_copied_opt.load_state_dict(copy.deepcopy(theirs.state_dict()))  # torch's load keeps the tensors
        if steps == 0 and mode != "in_backward":
            opt.zero_grad()
            theirs.zero_grad()
        train(copied, copied_opt, 2, start=steps)
        train(ref_copied, ref_copied_opt, 2, start=steps)
        assert_values(model, originals)
        for p, q in zip(copied.parameters(), ref_copied.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)
        # and the original goes on as before
        train(model, opt, 2, start=steps)
        train(ref, theirs, 2, start=steps)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["step", "skip_unused", "in_backward"])
def test_deepcopy_of_plain_tensor_parameters_works(mode):
    """Parameters given as plain leaf tensors: torch's Tensor.__deepcopy__ copies .grad and __dict__
    but not hooks; the copies live apart from the optimizer's buffers."""
    params = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    opt = flatopt.AdamW(params, lr=1e-2, **MODES[mode])
    copied = copy.deepcopy(params)
    for p, q in zip(params, copied, strict=True):
        assert q.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
        assert hooks_of(q) == ({}, {})
    before = [p.detach().clone() for p in params]
    sum(q.square().sum() for q in copied).backward()
    with torch.no_grad():
        for q in copied:
            q.add_(1.0)
    for p, b in zip(params, before, strict=True):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()


# ------------------------------------------------------------------------------------------------ state-dict hooks


def hooked_run(make, model):
    """Register every kind of state-dict hook, save and load, and return what happened."""
    opt = make(model)
    train(model, opt, 2)
    events = []

    def sd_pre(tag):
        def hook(o):
            assert o is opt
            events.append(("state_dict_pre", tag))

        return hook

    def sd_post_in_place(o, sd):
        events.append(("state_dict_post_in_place", sorted(sd)))
        sd["extra"] = {"added": True}

    def sd_post_replace(o, sd):
        events.append(("state_dict_post_replace", sorted(sd)))
        return {**sd, "replaced": 1}

    def load_pre_in_place(o, sd):
        events.append(("load_pre_in_place", sorted(sd)))
        sd["param_groups"] = [{**g, "lr": 0.5} for g in sd["param_groups"]]  # in the shallow copy only
        sd.pop("extra")

    def load_pre_replace(o, sd):
        events.append(("load_pre_replace", sorted(sd), [g["lr"] for g in sd["param_groups"]]))
        new = {k: v for k, v in sd.items() if k != "replaced"}
        new["param_groups"] = [{**g, "lr": 0.25} for g in sd["param_groups"]]
        return new

    def load_post(tag):
        def hook(o):
            events.append(("load_post", tag, [g["lr"] for g in o.param_groups]))

        return hook

    handles = [
        opt.register_state_dict_pre_hook(sd_pre("a")),
        opt.register_state_dict_pre_hook(sd_pre("first"), prepend=True),
        opt.register_state_dict_post_hook(sd_post_replace),
        opt.register_state_dict_post_hook(sd_post_in_place, prepend=True),
        opt.register_load_state_dict_pre_hook(load_pre_replace),
        opt.register_load_state_dict_pre_hook(load_pre_in_place, prepend=True),
        opt.register_load_state_dict_post_hook(load_post("a")),
        opt.register_load_state_dict_post_hook(load_post("first"), prepend=True),
    ]
    sd = opt.state_dict()
    result = {"keys": sorted(sd), "extra": sd["extra"], "replaced": sd["replaced"]}
    saved_groups = sd["param_groups"]
    opt.load_state_dict(sd)
    result["caller_dict_kept"] = sorted(sd) == ["extra", "param_groups", "replaced", "state"]
    result["caller_groups_kept"] = sd["param_groups"] is saved_groups and all(g["lr"] != 0.25 for g in saved_groups)
    result["lrs"] = [g["lr"] for g in opt.param_groups]
    for h in handles:
        h.remove()
    plain = opt.state_dict()
    result["plain_keys"] = sorted(plain)
    opt.load_state_dict(plain)
    return events, result, opt


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_state_dict_hooks_run_as_in_torch(name):
    """The same hooks, registered the same way, on flatopt and on torch.optim: the same calls in the
    same order with the same arguments, and the same effects (a state_dict post hook's replacement
    returned, a load pre hook's replacement loaded, the caller's dict left as it was)."""
    cls, torch_cls, kw = OPTIMIZERS[name]
    ours = hooked_run(lambda m: cls(m, **kw), make_model())
    theirs = hooked_run(lambda m: torch_cls(m.parameters(), **kw), make_model())
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    assert [e[0] for e in ours[0]] == [
        "state_dict_pre",
        "state_dict_pre",
        "state_dict_post_in_place",
        "state_dict_post_replace",
        "load_pre_in_place",
        "load_pre_replace",
        "load_post",
        "load_post",
    ]
    assert ours[0][0] == ("state_dict_pre", "first") and ours[0][-2] == ("load_post", "first", [0.25])
    assert ours[1]["lrs"] == [0.25] and ours[1]["plain_keys"] == ["param_groups", "state"]
    # the loaded state dict still steps like torch.optim
    model, ref = make_model(), make_model()
    opt, ref_opt = cls(model, **kw), torch_cls(ref.parameters(), **kw)
    for o in (opt, ref_opt):
        o.register_load_state_dict_pre_hook(
            lambda o, sd: {**sd, "param_groups": [{**g, "lr": 0.3} for g in sd["param_groups"]]}
        )
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    opt.load_state_dict(opt.state_dict())
    ref_opt.load_state_dict(ref_opt.state_dict())
    train(model, opt, 2, start=2)
    train(ref, ref_opt, 2, start=2)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_hooks_run_in_every_mode(name, mode):
    cls, _, kw = OPTIMIZERS[name]
    events, result, _ = hooked_run(lambda m: cls(m, **kw, **MODES[mode]), make_model())
    assert [e[0] for e in events] == [
        "state_dict_pre",
        "state_dict_pre",
        "state_dict_post_in_place",
        "state_dict_post_replace",
        "load_pre_in_place",
        "load_pre_replace",
        "load_post",
        "load_post",
    ]
    assert result["lrs"] == [0.25] and result["caller_dict_kept"] and result["caller_groups_kept"]


def test_a_load_refused_after_the_pre_hooks_runs_no_post_hook():
    """As in torch.optim, the post hooks run only once the state dict is loaded; flatopt checks
    everything first, so a refused load changes nothing."""
    model = make_model()
    opt = flatopt.AdamW(model)
    train(model, opt, 1)
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: {**sd, "param_groups": sd["param_groups"] * 2})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    before = state_values(opt)
    with pytest.raises(ValueError, match="^loaded state dict has a different number of parameter groups$"):
        opt.load_state_dict(opt.state_dict())
    assert calls == []
    assert state_values(opt).keys() == before.keys()


# ------------------------------------------------------------------------------------------------ torch.optim options

ACCEPTED = {
    "AdamW": [
        dict(amsgrad=False),
        dict(foreach=None),
        dict(fused=None),
        dict(fused=True),
        dict(capturable=False),
        dict(capturable=True),
        dict(differentiable=False),
        dict(amsgrad=False, foreach=None, fused=True, capturable=True, differentiable=False),
    ],
    "SGD": [dict(foreach=None), dict(fused=None), dict(fused=True), dict(differentiable=False)],
    "Lion": [dict(use_triton=False), dict(decoupled_weight_decay=False)],
}


@pytest.mark.parametrize(
    "name,options", [(n, o) for n, opts in ACCEPTED.items() for o in opts], ids=lambda v: str(v).replace(" ", "")
)
def test_options_that_change_nothing_are_taken(name, options):
    """Taken and ignored: the groups carry torch.optim's keys at torch's defaults whatever was passed (so
    that code reading them works and a torch.optim loading the state dict keeps its own defaults), and the
    groups, defaults, state dict and steps are those of an optimizer created without them."""
    cls, _, kw = OPTIMIZERS[name]
    model, twin = make_model(), make_model()
    opt, plain = cls(model, **kw, **options), cls(twin, **kw)
    assert opt.defaults == plain.defaults
    neutral = dict(cls.rule.torch_keys)  # none for Lion: lion-pytorch keeps its options out of the groups
    for key in options:
        if key in neutral:
            assert opt.defaults[key] == neutral[key] and all(g[key] == neutral[key] for g in opt.param_groups)
        else:
            assert key not in opt.defaults and all(key not in g for g in opt.param_groups)
    train(model, opt, 3)
    train(twin, plain, 3)
    assert_values(model, values(twin))
    assert opt.state_dict()["param_groups"] == plain.state_dict()["param_groups"]


def test_amsgrad_is_taken_positionally_as_by_torch():
    model, twin = make_model(), make_model()
    opt = flatopt.AdamW(model, 1e-2, (0.8, 0.99), 1e-6, 0.1, False)
    theirs = torch.optim.AdamW(twin.parameters(), 1e-2, (0.8, 0.99), 1e-6, 0.1, False)
    train(model, opt, 3)
    train(twin, theirs, 3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_signature_has_torch_optims_arguments(name):
    """Every argument of torch.optim's constructor, with its default and kind (positional or
    keyword-only); flatopt's own arguments are keyword-only and come after."""
    ours = inspect.signature(OPTIMIZERS[name][0]).parameters
    theirs = inspect.signature(OPTIMIZERS[name][1]).parameters
    for arg, p in theirs.items():
        assert arg in ours, arg
        assert (ours[arg].kind, ours[arg].default) == (p.kind, p.default), arg
    positional = [a for a, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [a for a, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]


def test_lion_signature_has_lion_pytorchs_arguments():
    ours = inspect.signature(flatopt.Lion).parameters
    positional = [(a, p.default) for a, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [
        ("params", inspect.Parameter.empty),
        ("lr", 1e-4),
        ("betas", (0.9, 0.99)),
        ("weight_decay", 0.0),
        ("use_triton", False),
        ("decoupled_weight_decay", False),
    ]


REFUSED = {
    ("AdamW", "amsgrad", True): r"it does not implement amsgrad; use torch\.optim\.AdamW\(amsgrad=True\)",
    ("AdamW", "foreach", True): r"one fused kernel, not with torch\.optim's foreach or for-loop implementation "
    r"\(whose rounding differs\); drop 'foreach'",
    ("AdamW", "foreach", False): r"one fused kernel, not with torch\.optim's foreach or for-loop .*drop 'foreach'",
    ("AdamW", "fused", False): r"it always steps each flat buffer with one fused kernel; drop 'fused' \(or pass "
    r"fused=True\)",
    ("AdamW", "differentiable", True): r"its step updates the parameters in place outside autograd and is not "
    r"differentiable; use torch\.optim\.AdamW\(differentiable=True\)",
    ("SGD", "foreach", True): r"drop 'foreach'",
    ("SGD", "foreach", False): r"drop 'foreach'",
    ("SGD", "fused", False): r"drop 'fused' \(or pass fused=True\)",
    ("SGD", "differentiable", True): r"use torch\.optim\.SGD\(differentiable=True\)",
    ("Lion", "use_triton", True): r"it steps with its own kernels, as backend= says "
    r"\(Triton on CUDA, torch's fused CPU kernels on the CPU\); drop 'use_triton'",
    ("Lion", "decoupled_weight_decay", True): r"lion-pytorch's decoupled weight decay \(weight_decay divided by "
    r"the constructor's lr\); pass weight_decay=weight_decay / lr instead, which decays the same",
}


@pytest.mark.parametrize("name,key,value", list(REFUSED), ids=lambda v: str(v))
def test_options_that_would_change_something_are_refused_before_anything_is_built(name, key, value):
    cls = OPTIMIZERS[name][0]
    model = make_model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    before = values(model)
    pattern = f"^flatopt\\.{name} does not take {key}={value!r}: .*{REFUSED[name, key, value]}$"
    with pytest.raises(ValueError, match=pattern):
        cls(model, **{key: value})
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # not moved into flat buffers
    assert all(p.grad is None and hooks_of(p) == ({}, {}) for p in model.parameters())
    assert_values(model, before)


def test_lion_decoupled_weight_decay_equivalent_is_what_the_message_says():
    """lion-pytorch's decoupled_weight_decay=True decays by lr * weight_decay / (constructor's lr):
    weight_decay=weight_decay / lr gives the same decay, also when a scheduler changes lr."""
    p = nn.Parameter(torch.ones(4))
    lr, wd = 0.1, 0.5
    opt = flatopt.Lion([p], lr=lr, weight_decay=wd / lr, betas=(0.0, 0.0))
    for new_lr in (lr, lr / 2):
        opt.param_groups[0]["lr"] = new_lr
        expected = p.detach() * (1 - new_lr * wd / lr)  # then minus lr * sign(g), with g = 0: sign 0
        p.grad = torch.zeros_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no backward: the parameter "received no gradient"
            opt.step()
        torch.testing.assert_close(p.detach(), expected)


@pytest.mark.parametrize(
    "name,key,hint",
    [
        ("SGD", "capturable", r"; capture\(\) records flatopt\.SGD's step in a CUDA graph without it, so drop "
         r"'capturable'$"),
        ("SGD", "amsgrad", "$"),
        ("Lion", "fused", r"; flatopt\.Lion always steps each flat buffer with one fused kernel, so drop 'fused'$"),
        ("Lion", "foreach", r"; flatopt\.Lion always steps each flat buffer with one fused kernel, so drop 'foreach'$"),
        ("Lion", "differentiable", r"; flatopt\.Lion's step is not differentiable, so drop 'differentiable'$"),
        ("Lion", "capturable", r"; capture\(\) records flatopt\.Lion's step"),
        ("Lion", "amsgrad", "$"),
        ("AdamW", "use_triton", "$"),
    ],
)  # fmt: skip
def test_options_this_optimizer_does_not_have_are_type_errors_as_in_torch(name, key, hint):
    cls, torch_cls, _ = OPTIMIZERS[name]
    expected = f"{name}.__init__() got an unexpected keyword argument '{key}'"
    p = nn.Parameter(torch.randn(3))
    if torch_cls is not None:
        with pytest.raises(TypeError) as theirs:
            torch_cls([p], **{key: False})
        assert str(theirs.value) == expected
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}{hint}"):
        cls([p], **{key: False})


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
@pytest.mark.parametrize("direction", ["flatopt_to_torch", "torch_to_flatopt"])
def test_state_dict_round_trip_with_options(name, direction):
    """flatopt's state dict carries torch.optim's option keys at torch's defaults, so torch.optim loads it with
    its own defaults (fused or capturable asked of flatopt does not make torch.optim's CPU step fused or
    capturable); torch.optim's state dict carries its options, which flatopt keeps in the groups and saves
    again."""
    cls, torch_cls, kw = OPTIMIZERS[name]
    model, ref = make_model(), make_model()
    flat_kw = dict(fused=True, capturable=True) if name == "AdamW" else dict(fused=True)
    ours = cls(model, **kw, **flat_kw)
    theirs = torch_cls(ref.parameters(), **kw, foreach=False)
    train(model, ours, 3)
    train(ref, theirs, 3)
    if direction == "flatopt_to_torch":
        target_model = make_model(seed=5)
        target = torch_cls(target_model.parameters(), **kw)
        target_model.load_state_dict(model.state_dict())
        sd = ours.state_dict()
        carried = {k: v for k, v in sd["param_groups"][0].items() if k in dict(cls.rule.torch_keys)}
        assert carried == dict(cls.rule.torch_keys), carried
        target.load_state_dict(sd)
        group = target.param_groups[0]
        assert group["foreach"] is None and group["fused"] in (None, False) and group["differentiable"] is False
        assert group.get("capturable", False) is False
        train(target_model, target, 2, start=3)
        train(ref, theirs, 2, start=3)
        expected = ref
    else:
        target_model = make_model(seed=5)
        target = cls(target_model, **kw)
        target_model.load_state_dict(ref.state_dict())
        target.load_state_dict(theirs.state_dict())
        assert target.param_groups[0]["foreach"] is False
        resaved = target.state_dict()["param_groups"]
        assert resaved == theirs.state_dict()["param_groups"]
        again = torch_cls(make_model().parameters(), **kw)
        again.load_state_dict(target.state_dict())
        assert again.param_groups[0]["foreach"] is False
        train(target_model, target, 2, start=3)
        train(model, ours, 2, start=3)
        expected = model
    for p, q in zip(target_model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=2e-6)


def test_torch_state_dict_with_amsgrad_is_still_refused():
    ref = make_model()
    theirs = torch.optim.AdamW(ref.parameters(), amsgrad=True)
    train(ref, theirs, 1)
    opt = flatopt.AdamW(make_model())
    with pytest.raises(ValueError, match=r"^flatopt\.AdamW does not implement amsgrad; use torch\.optim\.AdamW"):
        opt.load_state_dict(theirs.state_dict())


# ------------------------------------------------------------------------------------------ step hooks
def hook_trace(opt, calls, torch_optim):
    """Register a per-optimizer and a global pre- and post-hook that record (who, args, kwargs)."""
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt, len(a), dict(k)))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, len(a), dict(k)))),
        torch_optim.register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global-pre", o is opt))),
        torch_optim.register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global-post", o is opt))),
    ]
    return handles


def step_with_hook_trace(model, opt):
    """One training step of ``model`` with the hooks of hook_trace registered; returns their calls."""
    from torch.optim import optimizer as torch_optim

    calls = []
    handles = hook_trace(opt, calls, torch_optim)
    try:
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    return calls


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_step_hooks_run_as_in_torch(name, mode):
    """Global and per-optimizer step pre/post hooks run in torch.optim's order, with its arguments."""

    ours_cls, torch_cls, kw = OPTIMIZERS[name]
    traces = []
    for make in (lambda m: ours_cls(m.parameters(), **kw, **MODES[mode]), lambda m: torch_cls(m.parameters(), **kw)):
        model = make_model()
        opt = make(model)
        traces.append(step_with_hook_trace(model, opt))
    assert (
        traces[0]
        == traces[1]
        == [
            ("global-pre", True),
            ("pre", True, 1, {}),
            ("post", True, 1, {}),
            ("global-post", True),
        ]
    )


def test_a_step_pre_hook_can_replace_the_arguments():
    model = make_model()
    opt = flatopt.AdamW(model, lr=1e-2)
    x, y = batch(0)
    closures = []

    def closure():
        closures.append(1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": closure}))
    loss = opt.step()
    assert closures == [1] and isinstance(loss, torch.Tensor)
    opt.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
    with pytest.raises(RuntimeError, match="must return None or a tuple of \\(new_args, new_kwargs\\)"):
        opt.step()


def test_profiler_sees_the_step_and_zero_grad_under_torch_optims_labels():
    model = make_model()
    opt = flatopt.AdamW(model, lr=1e-2)
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # the first step outside the profiler
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#AdamW.step") == 1, sorted(set(names))
    assert names.count("Optimizer.zero_grad#AdamW.zero_grad") == 1, sorted(set(names))


@pytest.mark.parametrize("cls", ["AdamW", "SGD", "Lion"])
@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_step_counts_as_an_in_place_update_of_the_parameters_it_steps(cls, backend):
    """torch.optim's step updates each parameter in place, so autograd refuses a backward through a graph that saved
    the old values (the classic retain_graph mistake): flatopt's kernels write the flat buffers, and the step bumps
    the parameters' version counters as torch's in-place ops do. A parameter left out (no gradient) is not bumped."""
    model = make_model()
    model.register_parameter("unused", nn.Parameter(torch.randn(3)))  # gets no gradient
    opt = getattr(flatopt, cls)(model, lr=1e-2, backend=backend)
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    versions = {n: p._version for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="received no gradient"):
        opt.step()
    assert all(p._version > versions[n] for n, p in model.named_parameters() if not n.startswith("unused"))
    assert all(p._version == versions[n] for n, p in model.named_parameters() if n.startswith("unused"))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("mode", ["step", "direct_grads", "in_backward"])
def test_allow_mutation_on_saved_tensors_keeps_what_backward_saved(mode):
    """Under torch.autograd.graph.allow_mutation_on_saved_tensors() a tensor saved for backward is cloned before an
    in-place operation changes it (and the version check is off): a graph kept with retain_graph=True, run again
    after the step, computes with the weights of its forward, as under torch.optim (in in-backward mode, as under
    torch's per-parameter post-accumulate-grad recipe). The kernels write the flat buffers below dispatch; the
    step goes through dispatch first so that the mode sees it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(5, 6)
    if mode == "in_backward":
        opt = flatopt.SGD(model, lr=0.5, in_backward=True)
        per_param = {p: torch.optim.SGD([p], lr=0.5) for p in ref.parameters()}
        for p in ref.parameters():
            p.register_post_accumulate_grad_hook(lambda p: (per_param[p].step(), per_param[p].zero_grad()) and None)
        ref_opt = None  # the hooks step each parameter
    else:
        opt = flatopt.SGD(model, lr=0.5, direct_grads=mode == "direct_grads")
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for m, o in ((model, opt), (ref, ref_opt)):
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            loss = m(x).square().mean()
            loss.backward(retain_graph=True)  # in-backward: steps the parameters
            if o is not None:
                if mode != "in_backward":
                    o.step()
                o.zero_grad()
            loss.backward()  # the kept graph, run again after the update
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        if mode != "in_backward":
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}.grad: {m}")


def test_step_hooks_run_once_for_a_subclass_that_overrides_step():
    """torch.optim wraps the subclass's step() with its hooks; flatopt's own wrapper, reached through
    super().step(), must not run them again. (torch.optim itself runs them twice in this case once an
    instance of the base class has been created, since both steps are wrapped then.)"""

    flatopt.AdamW(make_model(), lr=1e-2)  # the base class's step() is in use too

    class Mine(flatopt.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    model = make_model()
    opt = Mine(model, lr=1e-2)
    calls = step_with_hook_trace(model, opt)
    assert calls == [("global-pre", True), ("pre", True, 1, {}), ("post", True, 1, {}), ("global-post", True)]


def test_a_tensor_lr_that_requires_grad_leaves_no_autograd_history():
    model = make_model()
    lr = torch.tensor(1e-2, requires_grad=True)
    opt = flatopt.AdamW(model, lr=lr)
    for i in range(3):
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for table in flatopt.inspect(opt).tables.values():
        assert table.grad_fn is None and not table.requires_grad
    assert all(p.grad_fn is None for p in model.parameters())


# ---------------------------------------------------------------------------------------------- torch.compile


def test_a_compiled_training_step_runs_the_optimizer_step_as_it_is(backend):
    """torch.compile over forward, backward, opt.step() and zero_grad(): dynamo leaves flatopt's step
    alone (one fused launch already; tracing into the Triton launcher fails under the interpreter), so the
    compiled loop trains exactly as the eager one, the step hooks run once per step and the views stay."""
    from conftest import device_for

    torch.manual_seed(0)
    dev = device_for(backend)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dev)
    ref = copy.deepcopy(model)
    opt, opt_ref = (flatopt.AdamW(m, lr=1e-2, weight_decay=0.1, backend=backend) for m in (model, ref))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))

    def train_step(m, o, x):
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    torch._dynamo.reset()
    compiled = torch.compile(train_step, backend="eager")
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        x = torch.randn(4, 8, generator=gen).to(dev)
        torch.testing.assert_close(compiled(model, opt, x), train_step(ref, opt_ref, x), rtol=0, atol=0)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"step {step}: {m}")
        assert calls == ["pre"] * step
    opt.check_bindings(full=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_in_backward_under_a_compiled_forward_and_backward_trains_as_torch(cls):
    """in_backward=True with torch.compile over a function that runs forward and loss.backward() (step() outside):
    dynamo meets the optimizer's gradient hooks when it traces the backward, and leaves them out of the graph (they
    launch kernels), rather than tracing them into functionalization's internal assert."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, **({"momentum": 0.9} if cls == "SGD" else {})}
    opt = getattr(flatopt, cls)(model, in_backward=True, **kwargs)
    opt_ref = getattr(torch.optim, cls)(ref.parameters(), **kwargs)

    def forward_backward(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    torch._dynamo.reset()
    compiled = torch.compile(forward_backward, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(3):
            x = torch.randn(4, 8, generator=gen)
            compiled(model, x)
            opt.step()
            opt.zero_grad()
            forward_backward(ref, x)
            opt_ref.step()
            opt_ref.zero_grad()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    finally:
        torch._dynamo.reset()


def test_step_without_torchs_hook_tables_is_left_for_torch_to_wrap(monkeypatch):
    """Where torch lacks the global hook tables flatopt's step() wrapper relies on, the wrapper is not
    marked as hooked, and torch.optim wraps step() itself when the optimizer is created: step hooks run
    once each, and the step is the same as with flatopt's own wrapper."""
    import flatopt.torch_compat as fo

    monkeypatch.setattr(fo, "HOOK_TABLES", ("_a_table_this_torch_lacks",))

    class Fallback(flatopt.AdamW):
        step = fo.hooked_step(flatopt.AdamW.step.__wrapped__)

    assert not getattr(Fallback.step, "hooked", False)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    opt, opt_ref = Fallback(model, lr=0.1), flatopt.AdamW(ref, lr=0.1)
    assert getattr(Fallback.step, "hooked", False), "torch.optim did not wrap step()"
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    for _ in range(2):
        x = torch.randn(2, 4)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    assert calls == ["pre", "post", "pre", "post"]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "betas",
    [(0.9, torch.tensor(0.99)), (torch.tensor(0.9), 0.99), (0, 0.99)],
    ids=["float-tensor", "tensor-float", "int"],
)
def test_constructor_betas_of_mixed_kinds_are_refused_as_torch_refuses_them(betas):
    """torch.optim.AdamW wants its constructor's betas both floats or both tensors (an int is neither)."""
    with pytest.raises(ValueError) as expected:
        torch.optim.AdamW(nn.Linear(2, 2).parameters(), betas=betas)
    model = nn.Linear(2, 2)
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        flatopt.AdamW(model, betas=betas)
    assert [p.data_ptr() for p in model.parameters()] == before, "the failed constructor rebound parameters"


@pytest.mark.parametrize("flat", [True, False])
def test_sgd_without_momentum_keeps_no_state_as_torch(flat):
    """torch.optim.SGD with momentum=0 keeps no state entry for any parameter; one appears with the momentum
    buffer once a group turns momentum on."""
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = flatopt.SGD(model, lr=0.1, flat=flat)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for momentum in (0.0, 0.0, 0.9, 0.9):
        for o in (opt, opt_ref):
            o.param_groups[0]["momentum"] = momentum
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(torch.ones(4, 3)).sum().backward()
            o.step()
        assert len(opt.state) == len(opt_ref.state), f"momentum {momentum}: {dict(opt.state)}"
        for p, q in zip(model.parameters(), ref.parameters()):
            assert set(opt.state.get(p, {})) == set(opt_ref.state.get(q, {}))
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_param_groups_have_torchs_keys(name):
    """Code that reads opt.param_groups[0]["foreach"] (or fused, differentiable, ...) works as with torch.optim:
    every key torch's group has, flatopt's has."""
    cls, torch_cls, kw = OPTIMIZERS[name]
    ours, theirs = cls(make_model(), **kw), torch_cls(make_model().parameters(), **kw)
    assert set(ours.param_groups[0]) == set(theirs.param_groups[0])
    ours.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
    assert set(ours.param_groups[1]) == set(theirs.param_groups[0])


# the Triton interpreter (numpy) warns of the padding's 0 / 0, which is the case under test
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("mode", [{}, {"in_backward": True}], ids=["step", "in_backward"])
def test_eps_zero_keeps_the_padding_zero(backend, mode):
    """eps=0 (accepted, as by torch): a padding element's update is 0 / 0, so the engines zero the padding again
    after the step; the parameters still follow torch.optim.AdamW(eps=0)."""
    from conftest import device_for

    device = device_for(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).to(device)
    ref = copy.deepcopy(model)
    opt = flatopt.AdamW(model, lr=1e-2, eps=0.0, backend=backend, **mode)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=0.0)
    for _ in range(3):
        x = torch.randn(4, 3, device=device)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    for buf in flatopt.inspect(opt).buffers:
        for pad in buf.padding(buf.data):
            assert not pad.any() and not torch.isnan(pad).any(), "the padding is not zero"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_gradients_from_before_the_optimizer_count_as_received():
    """A backward before the optimizer exists leaves gradients that the first step uses: the unused-parameter
    warning names only parameters that had none."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    model[0](torch.randn(4, 3)).sum().backward()  # model[1] gets no gradient
    opt = flatopt.AdamW(model)
    with pytest.warns(UserWarning, match="received no gradient") as record:
        opt.step()
    message = str(record[0].message)
    assert "'1.weight'" in message and "'1.bias'" in message and "'0." not in message, message


def test_a_post_accumulate_grad_hook_returning_a_value_fails_as_in_torch():
    messages = []
    for make in (lambda m: torch.optim.AdamW(m.parameters()), flatopt.AdamW):
        model = nn.Linear(3, 2)
        make(model)
        model.weight.register_post_accumulate_grad_hook(lambda p: 1)
        with pytest.raises(Exception) as caught:
            model(torch.randn(2, 3)).sum().backward()
        messages.append((type(caught.value), str(caught.value)))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("saved_with_names", [True, False])
def test_param_names_of_a_loaded_state_dict_are_taken_as_torch_takes_them(saved_with_names):
    """torch.optim takes the param_names a loaded state dict has (they replace the optimizer's) and keeps its own
    where it has none."""
    groups = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: flatopt.AdamW(ps, lr=1e-2)):
        source_model, target_model = make_model(), make_model()
        named = list(source_model.named_parameters())
        source = make(named if saved_with_names else [p for _, p in named])
        train(source_model, source, 1)
        target = make([(f"other.{n}", p) for n, p in target_model.named_parameters()])
        target.load_state_dict(source.state_dict())
        groups.append(target.param_groups[0].get("param_names"))
    assert groups[0] == groups[1]
    expected = [n for n, _ in make_model().named_parameters()]
    assert groups[1] == (expected if saved_with_names else [f"other.{n}" for n in expected])
