"""Bad input raises an error that says what is wrong and how to fix it, in torch's words where torch
has them, and changes nothing: parameters, gradients, states, step counts and param_groups are as
they were, and an optimizer whose call failed still steps exactly like an untouched twin."""

import copy
import re
import warnings

import pytest
import torch
from conftest import Net, loss_fn, make_batch
from torch import nn

import flatopt
from flatopt.bindings import FULL_CHECK_EVERY

MAKE = {
    "adamw": lambda ps, **k: flatopt.AdamW(ps, **{"lr": 1e-2, "weight_decay": 0.1, **k}),
    "sgd": lambda ps, **k: flatopt.SGD(ps, **{"lr": 0.05, "momentum": 0.9, **k}),
    "lion": lambda ps, **k: flatopt.Lion(ps, **{"lr": 1e-3, "weight_decay": 0.1, **k}),
}


def close(actual, expected, what, **tol):
    """torch.testing.assert_close with explicit tolerances and a message naming the step and the tensor."""
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def silent(fn, *args, **kwargs):
    """Call ``fn`` with warnings silenced (the unused-parameter warning has a test of its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _frozen(v):
    """A deep copy of ``v`` in which tensors keep their address, for comparison after an error."""
    if isinstance(v, torch.Tensor) and v.layout != torch.strided:
        return ("tensor", None, v.dtype, v.detach().to_dense())
    if isinstance(v, torch.Tensor):
        return ("tensor", v.data_ptr(), v.dtype, v.detach().clone())
    if isinstance(v, dict):
        return {k: _frozen(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_frozen(x) for x in v)
    return copy.deepcopy(v)


def snapshot(params, opt=None, grads=True):
    """Everything a failing call must leave as it was (gradients left out with ``grads=False``)."""
    snap = {
        "params": [
            (_frozen(p.data), None if p.grad is None or not grads else _frozen(p.grad), p.requires_grad, p.stride())
            for p in params
        ]
    }
    if opt is not None:
        snap["groups"] = [
            {k: [id(q) for q in v] if k == "params" else _frozen(v) for k, v in g.items()} for g in opt.param_groups
        ]
        snap["state"] = {id(p): _frozen(dict(s)) for p, s in opt.state.items()}
        snap["buffers"] = [
            (
                _frozen(b.data),
                # a gradient storage released by zero_grad() cannot be read (nor must it come back)
                (_frozen(b.grad) if b.grad.untyped_storage().nbytes() else "released") if grads else None,
                _frozen(b.states),
                _frozen(b.meta.steps),
                b.meta.uniform,
            )
            for b in flatopt.inspect(opt).buffers
        ]
        snap["hparams"] = {str(d): _frozen(t) for d, t in flatopt.inspect(opt).tables.items()}
    return snap


def assert_unchanged(before, after, path="optimizer"):
    if isinstance(before, tuple) and before and before[0] == "tensor":
        _, ptr, dtype, value = before
        _, ptr2, dtype2, value2 = after
        assert (ptr2, dtype2) == (ptr, dtype), f"{path} was replaced"
        close(value2, value, path, atol=0, rtol=0, equal_nan=True)
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), f"{path}: keys {sorted(map(str, before))} -> {sorted(map(str, after))}"
        for k in before:
            assert_unchanged(before[k], after[k], f"{path}[{k!r}]")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), f"{path}: length {len(before)} -> {len(after)}"
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            assert_unchanged(a, b, f"{path}[{i}]")
    else:
        assert before == after, f"{path}: {before!r} -> {after!r}"


def torch_message(fn, *args, **kwargs):
    """The message of the ValueError that torch.optim raises for the same input."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def train_step(model, opt, gen):
    loss_fn(model, make_batch(gen)).backward()
    silent(opt.step)
    opt.zero_grad()


def trained(opt_name="adamw", steps=1, **kwargs):
    """A Net and its optimizer after ``steps`` steps, and the batch generator to go on with."""
    torch.manual_seed(0)
    model = Net()
    opt = silent(MAKE[opt_name], model, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        train_step(model, opt, gen)
    return model, opt, gen


def assert_twins(model, opt, twin, twin_opt, step):
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        close(p, q, f"step {step}, {name}", atol=0, rtol=0)
        for key, value in twin_opt.state.get(q, {}).items():
            close(opt.state[p][key], value, f"step {step}, {name}.{key}", atol=0, rtol=0)


def steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start, n=2):
    for step in range(start, start + n):
        train_step(model, opt, gen)
        train_step(twin, twin_opt, twin_gen)
        assert_twins(model, opt, twin, twin_opt, step)


# ---------------------------------------------------------------------------------------------- sparse


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.emb = nn.Embedding(10, 4, sparse=True)

    def forward(self, x, idx):
        return (self.lin(x) * self.emb(idx)).sum()


@pytest.mark.parametrize("opt_name", list(MAKE))
def test_sparse_embedding_module_is_refused(opt_name):
    model = SparseNet()
    params = list(model.parameters())
    before = snapshot(params)
    with pytest.raises(ValueError, match=r"does not support sparse gradients: Embedding 'emb'.*sparse=False"):
        MAKE[opt_name](model)
    assert_unchanged(before, snapshot(params))


def test_sparse_gradient_is_refused_flat():
    model = SparseNet()
    params = list(model.parameters())  # a list: the module check cannot see the Embedding
    opt = flatopt.AdamW(params, lr=0.1)
    before = snapshot(params, opt, grads=False)
    with pytest.raises((RuntimeError, ValueError), match="sparse"):  # at the backward or at the step
        model(torch.randn(2, 3), torch.tensor([1, 7])).backward()
        opt.step()
    assert_unchanged(before, snapshot(params, opt, grads=False))


def test_sparse_gradient_at_step_is_refused_unflat():
    model = SparseNet()
    params = list(model.parameters())
    opt = flatopt.AdamW(params, lr=0.1, flat=False)
    model(torch.randn(2, 3), torch.tensor([1, 7])).backward()
    assert params[-1].grad.is_sparse
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))


# ---------------------------------------------------------------------------------------------- bad parameters

BAD_PARAMS = {
    "complex": (lambda: torch.randn(3, 2, dtype=torch.complex64), r"does not support complex parameters.*view_as_real"),
    "float8": (lambda: torch.randn(5).to(torch.float8_e5m2), r"float16 and float64 parameters, got.*model\.to\("),
    "non-dense": (lambda: torch.randn(4, 6)[:, ::2], r"needs dense parameters.*strides \(6, 2\).*contiguous"),
    "meta": (lambda: torch.empty(3, 4, device="meta"), r"meta device has no data.*to_empty\(device=\.\.\.\)"),
}


@pytest.mark.parametrize("kind", list(BAD_PARAMS))
@pytest.mark.parametrize("form", ["list", "group-list", "group-generator"])
def test_bad_parameter_is_refused(kind, form):
    """Also in a group whose 'params' is a generator ({'params': model.layer.parameters()})."""
    make, pattern = BAD_PARAMS[kind]
    good = nn.Parameter(torch.randn(3, 3))
    bad = nn.Parameter(make())
    params = [good, bad]
    groups = {
        "list": lambda: params,
        "group-list": lambda: [{"params": [good]}, {"params": [bad], "lr": 0.1}],
        "group-generator": lambda: [{"params": [good]}, {"params": (p for p in [bad]), "lr": 0.1}],
    }[form]
    before = snapshot(params)
    for opt_name in MAKE:
        with pytest.raises(ValueError, match=pattern):
            MAKE[opt_name](groups())
    assert_unchanged(before, snapshot(params))


@pytest.mark.parametrize("kind", list(BAD_PARAMS))
def test_bad_parameter_in_add_param_group_changes_nothing(kind):
    model, opt, gen = trained()
    make, pattern = BAD_PARAMS[kind]
    bad = nn.Parameter(make())
    params = list(model.parameters()) + [bad]
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group({"params": [bad]})
    assert_unchanged(before, snapshot(params, opt))


def _shared_memory():
    p = nn.Parameter(torch.ones(5))
    p.data.share_memory_()
    return [p]


def _overlapping():
    base = torch.ones(10)
    return [nn.Parameter(base[:6]), nn.Parameter(base[4:])]


@pytest.mark.parametrize(
    "make, pattern",
    [(_shared_memory, r"out of shared memory"), (_overlapping, r"params\[0\] of param group 1.*params\[1\]")],
    ids=["shared-memory", "overlapping"],
)
@pytest.mark.parametrize("mode", ["step", "in_backward"])
def test_a_group_the_layout_refuses_is_not_added(make, pattern, mode):
    """add_param_group() with parameters the flat layout refuses (found when it lays them out): the group is not
    left in param_groups, so the optimizer goes on stepping as before (every step() used to be refused, saying
    the optimizer was laid out for fewer groups)."""
    model, opt, gen = trained(in_backward=mode == "in_backward")
    twin, twin_opt, twin_gen = trained(in_backward=mode == "in_backward")
    params = list(model.parameters())
    grads = mode == "step"  # in-backward mode has no gradient buffer
    opt.state_dict()  # brings the buffers' cached launch flags up to date, as any call that reads the state does
    before = snapshot(params, opt, grads=grads)
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group({"params": make(), "lr": 0.1})
    assert len(opt.param_groups) == 1
    assert_unchanged(before, snapshot(params, opt, grads=grads))
    steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start=2)


@pytest.mark.parametrize("mode", ["step", "in_backward"])
def test_a_layout_that_fails_part_way_in_add_param_group_leaves_the_optimizer_training(mode, monkeypatch):
    """add_param_group() whose layout fails after the checks (out of memory allocating the new buffers): the group
    is not added, and the groups are laid out as they were, their gradients and in-backward hooks connected again
    (else backward passes would step nothing in in-backward mode); training goes on as the twin's."""
    kwargs = {"in_backward": True} if mode == "in_backward" else {"direct_grads": True}
    model, opt, gen = trained(**kwargs)
    twin, twin_opt, twin_gen = trained(**kwargs)
    engine = flatopt.inspect(opt).engine
    allocate = engine.new_buffer

    def out_of_memory(*args, **kwargs):
        monkeypatch.setattr(engine, "new_buffer", allocate)  # once
        raise torch.OutOfMemoryError("simulated: allocating the new buffers")

    monkeypatch.setattr(engine, "new_buffer", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "lr": 0.1})
    assert len(opt.param_groups) == 1
    loss_fn(model, make_batch(gen)).backward()
    if mode == "in_backward":  # the pass stepped the parameters and freed their gradients
        assert all(p.grad is None for p in model.parameters())
    else:  # the covered layers wrote their gradients into the flat buffer
        assert engine.landing.slots.landed_count(0) > 0
    silent(opt.step)
    opt.zero_grad()
    train_step(twin, twin_opt, twin_gen)
    assert_twins(model, opt, twin, twin_opt, 2)
    steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start=3)


@pytest.mark.parametrize("kind", ["complex", "float8", "non-dense"])
@pytest.mark.parametrize("flat", [True, False])
def test_frozen_parameter_of_any_kind_is_accepted_and_refused_once_trainable(kind, flat):
    """torch.optim takes a frozen parameter it could not step (a RoPE table kept as a complex Parameter) and never
    steps it; so does flatopt. Made trainable later, it is refused at the step, before anything changes."""
    make, pattern = BAD_PARAMS[kind]
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    frozen = nn.Parameter(make(), requires_grad=False)
    params = [layer.weight, layer.bias, frozen]
    torch_opt = torch.optim.AdamW(params, lr=1e-2)  # torch.optim accepts it
    opt = flatopt.AdamW(params, lr=1e-2, flat=flat)
    layer(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert frozen.grad is None and len(opt.state[frozen]) == 0 and torch_opt.state_dict()["state"] == {}
    if kind == "float8":
        return  # cannot require grad
    frozen.requires_grad_(True)
    frozen.grad = torch.zeros_like(frozen)
    layer(torch.randn(2, 3)).sum().backward()
    before = snapshot(params, opt)
    with pytest.raises((ValueError, RuntimeError), match=pattern):  # flat=False: RuntimeError for a non-dense one
        opt.step()
    assert_unchanged(before, snapshot(params, opt))


def test_overlapping_parameters_are_refused_and_disjoint_views_train_as_torch():
    """Parameters that overlap in memory would no longer share it once copied into the flat buffers; views of one
    tensor that do not overlap are copied like any parameter (the optimizer's own buffers are such a tensor, so an
    optimizer created over a model another flatopt optimizer holds takes its parameters as usual)."""
    base = torch.randn(8)
    a, b = nn.Parameter(base[0:5]), nn.Parameter(base[3:8])
    before = snapshot([a, b])
    for opt_name in MAKE:
        with pytest.raises(ValueError, match=r"parameters .* and .* share memory .*overlap.*flat=False"):
            MAKE[opt_name]([a, b])
    assert_unchanged(before, snapshot([a, b]))
    disjoint = [nn.Parameter(base[0:4]), nn.Parameter(base[4:8])]
    twins = [nn.Parameter(p.detach().clone()) for p in disjoint]
    opt, ref = flatopt.AdamW(disjoint, lr=0.1), torch.optim.AdamW(twins, lr=0.1)
    for _ in range(3):
        for ps, o in ((disjoint, opt), (twins, ref)):
            o.zero_grad()
            sum((p * p).sum() for p in ps).backward()
            o.step()
    for p, q in zip(disjoint, twins):
        close(p, q, "disjoint views", atol=1e-6, rtol=0)
    model = Net()
    first = flatopt.AdamW(model)
    flatopt.AdamW(model)  # its parameters are views of first's buffer: taken again
    with pytest.raises(RuntimeError, match="was laid out by another flatopt optimizer"):
        first.step()


def test_parameters_in_shared_memory_are_refused_with_flat_true_and_stepped_in_place_with_flat_false():
    """model.share_memory() (Hogwild training with torch.multiprocessing): torch.optim updates the shared storages
    in place, which other processes see; flat=True would copy the parameters out of them."""
    torch.manual_seed(0)
    model = Net()
    model.share_memory()
    params = list(model.parameters())
    before = snapshot(params)
    for opt_name in MAKE:
        with pytest.raises(ValueError, match=r"out of shared memory.*Use flat=False"):
            MAKE[opt_name](model)
    assert_unchanged(before, snapshot(params))
    twin = copy.deepcopy(model)
    opt, ref = flatopt.AdamW(model, lr=0.1, flat=False), torch.optim.AdamW(twin.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = make_batch(gen)
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            loss_fn(m, batch).backward()
            o.step()
    assert all(p.is_shared() for p in model.parameters())
    for p, q in zip(model.parameters(), twin.parameters()):
        close(p, q, "shared parameter", atol=1e-6, rtol=0)


def test_share_memory_after_the_optimizer_is_refused_at_the_step_saying_so():
    model, opt, gen = trained()
    loss_fn(model, make_batch(gen)).backward()
    model.share_memory()  # moves the parameters' storages in place, out of the flat buffer
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match=r"was moved out of the optimizer's flat buffer.*\(share_memory\(\)"):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))


@pytest.mark.parametrize("mode", ["step", "in_backward"])
def test_share_memory_of_one_layer_after_the_optimizer_is_refused_at_the_next_step(mode):
    """Each parameter lies over a storage of its own: share_memory() of a layer in the middle of a buffer (or
    torch.multiprocessing sending it to another process) moves that layer alone, which the first and last
    parameters of the buffer do not show. On the CPU every parameter's address is looked at, at every step."""
    # (two steps: the pass after the first settles which step counts differ, the unused layer's having stayed at 0)
    model, opt, gen = trained(in_backward=True, steps=2) if mode == "in_backward" else trained()
    model.proj.share_memory()
    params = list(model.parameters())
    if mode == "step":
        loss_fn(model, make_batch(gen)).backward()
    before = snapshot(params, opt, grads=mode == "step")  # (no gradient buffer in in-backward mode)
    with pytest.raises(RuntimeError, match=r"parameter 'proj\.weight' was moved out of the optimizer's flat buffer"):
        if mode == "in_backward":
            loss_fn(model, make_batch(gen)).backward()
        opt.step()
    assert_unchanged(before, snapshot(params, opt, grads=mode == "step"))


def test_prune_remove_after_the_optimizer_is_refused_naming_it():
    """torch.nn.utils.prune.remove() makes the pruned weight permanent by rebinding the parameter's data, off the
    flat buffer: refused at the next step, the message naming it."""
    from torch.nn.utils import prune

    model, opt, gen = trained()
    prune.l1_unstructured(model.proj, "weight", amount=0.5)
    prune.remove(model.proj, "weight")
    loss_fn(model, make_batch(gen)).backward()
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match=r"'proj.weight' no longer lives .*torch.nn.utils.prune.remove\(\) do that"):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))


def test_parameter_in_two_groups():
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4))
    groups = lambda: [{"params": [a, b]}, {"params": [b], "lr": 0.1}]  # noqa: E731
    expected = torch_message(torch.optim.AdamW, groups())
    assert expected == "some parameters appear in more than one parameter group"
    before = snapshot([a, b])
    for opt_name in MAKE:
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
            MAKE[opt_name](groups())
    assert_unchanged(before, snapshot([a, b]))


def test_parameter_in_two_groups_via_add_param_group():
    model, opt, gen = trained()
    params = list(model.parameters())
    expected = torch_message(torch.optim.AdamW([params[0]]).add_param_group, {"params": [params[0]]})
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        opt.add_param_group({"params": [model.proj.weight], "lr": 0.1})
    assert_unchanged(before, snapshot(params, opt))


# ---------------------------------------------------------------------------------------------- hyper-parameters

ADAMW_BAD = [
    dict(lr=-1e-3),
    dict(lr=float("nan")),
    dict(lr=torch.tensor([1e-3, 1e-3])),
    dict(eps=-1e-8),
    dict(betas=(1.0, 0.999)),
    dict(betas=(-0.1, 0.999)),
    dict(betas=(0.9, 1.0)),
    dict(betas=(0.9, -0.5)),
    dict(weight_decay=-0.01),
]
SGD_BAD = [
    dict(lr=-0.1),
    dict(lr=torch.tensor([0.1, 0.1])),
    dict(momentum=-0.9),
    dict(weight_decay=-1e-4),
    dict(nesterov=True),
    dict(nesterov=True, momentum=0.9, dampening=0.1),
]
LION_BAD = [
    (dict(lr=-1e-4), "Invalid learning rate: -0.0001"),
    (dict(betas=(1.5, 0.99)), "Invalid beta parameter at index 0: 1.5"),
    (dict(betas=(0.9, -0.01)), "Invalid beta parameter at index 1: -0.01"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
]


def _ids(kw):
    return ",".join(f"{k}={v.tolist() if isinstance(v, torch.Tensor) else v}" for k, v in kw.items())


@pytest.mark.parametrize(
    "cls_name, kwargs",
    [("AdamW", kw) for kw in ADAMW_BAD] + [("SGD", kw) for kw in SGD_BAD],
    ids=lambda x: _ids(x) if isinstance(x, dict) else x,
)
def test_invalid_hyperparameters_use_torch_wording(cls_name, kwargs):
    p = nn.Parameter(torch.randn(5))
    other = nn.Parameter(torch.randn(3))
    expected = torch_message(getattr(torch.optim, cls_name), [p], **kwargs)
    ours = getattr(flatopt, cls_name)
    before = snapshot([p, other])
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        ours([p], **kwargs)
    # torch.optim checks only the defaults; flatopt checks every group, in the same words
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        ours([{"params": [other]}, {"params": [p], **kwargs}])
    assert_unchanged(before, snapshot([p, other]))


@pytest.mark.parametrize("kwargs, expected", LION_BAD, ids=[_ids(kw) for kw, _ in LION_BAD])
def test_invalid_lion_hyperparameters(kwargs, expected):
    p = nn.Parameter(torch.randn(5))
    before = snapshot([p])
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        flatopt.Lion([p], **kwargs)
    assert_unchanged(before, snapshot([p]))


@pytest.mark.parametrize("cls_name", ["AdamW", "SGD", "Lion"])
def test_unknown_keyword_argument_is_a_type_error(cls_name):
    p = nn.Parameter(torch.randn(5))
    before = snapshot([p])
    expected = f"{cls_name}.__init__() got an unexpected keyword argument 'foo'"
    if hasattr(torch.optim, cls_name):
        with pytest.raises(TypeError) as theirs:
            getattr(torch.optim, cls_name)([p], foo=1)
        assert str(theirs.value) == expected
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        getattr(flatopt, cls_name)([p], foo=1)
    if cls_name == "Lion":  # lion-pytorch has no `fused`
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'fused'"):
            getattr(flatopt, cls_name)([p], fused=True)
    else:  # torch's option, at a value flatopt cannot honour
        with pytest.raises(ValueError, match=r"does not take fused=False: .*one fused kernel; drop 'fused'"):
            getattr(flatopt, cls_name)([p], fused=False)
    assert_unchanged(before, snapshot([p]))


def test_amsgrad_is_refused_with_a_pointer_to_torch():
    p = nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"amsgrad=True: .*torch\.optim\.AdamW\(amsgrad=True\)"):
        flatopt.AdamW([p], amsgrad=True)


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        ("amsgrad", True, r"does not implement amsgrad"),
        ("decoupled_weight_decay", False, r"decoupled weight decay only.*torch\.optim\.Adam"),
    ],
)
def test_adamw_flags_torch_reads_at_every_step_are_validated_when_edited(key, value, pattern):
    """torch.optim.AdamW reads group["amsgrad"] and group["decoupled_weight_decay"] at every step (False gives Adam's
    L2 penalty); flatopt implements neither, so an edit after the first step is refused at the next one, changing
    nothing, as an edit of lr is; set back, the optimizer steps as an untouched twin."""
    model, opt, gen = trained(steps=2)
    twin_model, twin, twin_gen = trained(steps=2)
    opt.param_groups[0][key] = value
    loss_fn(model, make_batch(gen)).backward()
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=pattern):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))
    opt.param_groups[0][key] = not value
    opt.step()
    loss_fn(twin_model, make_batch(twin_gen)).backward()
    twin.step()
    for p, q in zip(params, twin_model.parameters()):
        close(p, q, key, atol=0, rtol=0)


def test_adam_state_dict_loads_into_adamw_as_torch_loads_it():
    """torch.optim.Adam's groups say decoupled_weight_decay=False; torch.optim.AdamW sets it back to True on load
    (its __setstate__), and so does flatopt.AdamW, which then steps AdamW's decay as torch.optim.AdamW does."""
    torch.manual_seed(0)
    source = Net()
    adam = torch.optim.Adam(source.parameters(), lr=1e-2, weight_decay=0.5)
    gen = torch.Generator().manual_seed(1)
    loss_fn(source, make_batch(gen)).backward()
    adam.step()
    sd = adam.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    mine, theirs = copy.deepcopy(source), copy.deepcopy(source)
    opt, ref = flatopt.AdamW(mine, lr=1e-2), torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(sd))
    ref.load_state_dict(copy.deepcopy(sd))
    assert opt.param_groups[0]["decoupled_weight_decay"] is True is ref.param_groups[0]["decoupled_weight_decay"]
    for _ in range(3):
        batch = make_batch(gen)
        for m, o in ((mine, opt), (theirs, ref)):
            o.zero_grad()
            loss_fn(m, batch).backward()
            o.step()
    for p, q in zip(mine.parameters(), theirs.parameters()):
        close(p, q, "after loading Adam's state dict", atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- backend


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = Net()
    params = list(model.parameters())
    before = snapshot(params)
    for opt_name in MAKE:
        with pytest.raises(ValueError, match=r"backend='triton' runs on CUDA tensors.*use backend='cpu'"):
            MAKE[opt_name](model, backend="triton")
    assert_unchanged(before, snapshot(params))


def test_unknown_backend():
    model = Net()
    params = list(model.parameters())
    before = snapshot(params)
    for opt_name in MAKE:
        expected = r"^Invalid backend: 'nonsense'; expected one of \('triton', 'cpu', 'torch'\)$"
        with pytest.raises(ValueError, match=expected):
            MAKE[opt_name](model, backend="nonsense")
    assert_unchanged(before, snapshot(params))


# ---------------------------------------------------------------------------------------------- rebinding

DATA_MESSAGE = r"parameter '{}' no longer lives in the optimizer's flat buffer.*Create the optimizer after"


def rebind_to_bf16(model):
    model.to(torch.bfloat16)
    return "conv.weight", DATA_MESSAGE


def rebind_first(model):
    model.conv.weight.data = model.conv.weight.data.clone()
    return "conv.weight", DATA_MESSAGE


def rebind_middle(model):
    model.proj.weight.data = model.proj.weight.data.clone()
    return "proj.weight", DATA_MESSAGE


REBINDS = {
    "model.to(bfloat16)": rebind_to_bf16,
    "first p.data=clone": rebind_first,
    "middle p.data=clone": rebind_middle,
}


def step_until_refused(model, opt, pattern, bound):
    """Step until step() raises (within ``bound`` steps), checking that the refused step changed nothing."""
    params = list(model.parameters())
    for _ in range(bound):
        before = snapshot(params, opt)
        try:
            opt.step()
        except RuntimeError as error:
            assert re.search(pattern, str(error)), f"unexpected message: {error}"
            assert_unchanged(before, snapshot(params, opt))
            return
    pytest.fail(f"step() did not refuse within {bound} steps (pattern {pattern!r})")


@pytest.mark.parametrize("steps_before", [0, 1])
@pytest.mark.parametrize("how", list(REBINDS))
def test_rebound_parameter_is_detected_at_the_next_step(how, steps_before):
    """opt.check_bindings() detects any rebinding at once; step() at the next step for the first or
    last parameter of a buffer and at the first step, and within FULL_CHECK_EVERY (256) steps for a
    middle parameter after that (step() checks every parameter only every 256th step)."""
    model, opt, gen = trained(steps=steps_before)
    loss_fn(model, make_batch(gen)).backward()
    name, pattern = REBINDS[how](model)
    pattern = pattern.format(re.escape(name))
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match=pattern):
        opt.check_bindings()
    assert_unchanged(before, snapshot(params, opt))
    bound = FULL_CHECK_EVERY if steps_before and how.startswith("middle") else 1
    step_until_refused(model, opt, pattern, bound)


def test_rebound_parameter_message_uses_torch_param_names():
    """Parameters given as named_parameters() (torch.optim keeps the names in 'param_names')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = flatopt.AdamW(model.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' no longer lives"):
        opt.step()


@pytest.mark.parametrize("steps_before", [0, 1])
def test_create_graph_backward_is_detected(steps_before):
    model, opt, gen = trained(steps=steps_before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that create_graph=True makes a reference cycle
        loss_fn(model, make_batch(gen)).backward(create_graph=True)
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match=r"the \.grad of parameter 'conv\.weight' requires grad.*create_graph"):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))
    for p in params:
        p.grad = None  # break the graph's reference cycle


# ---------------------------------------------------------------------------------------------- warnings


def test_unused_parameter_warning_points_at_the_callers_line():
    model, opt, gen = trained(steps=0)
    loss_fn(model, make_batch(gen)).backward()
    with pytest.warns(UserWarning, match="received no gradient") as record:
        opt.step()
    assert [w.filename for w in record] == [__file__]


# ---------------------------------------------------------------------------------------------- load_state_dict


def _state_dict(opt):
    return copy.deepcopy(opt.state_dict())


def sd_wrong_shape(sd, model):
    sd["state"][0]["exp_avg"] = torch.zeros(5, 5)
    return r"'exp_avg' of shape \(5, 5\) for parameter 0 \('conv\.weight'\), whose shape is \(5, 3, 3, 3\)"


def sd_fewer_params(sd, model):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    return "torch"


def sd_more_groups(sd, model):
    sd["param_groups"].append({**sd["param_groups"][0], "params": []})
    return "torch"


def sd_unknown_param(sd, model):
    sd["state"][99] = sd["state"][0]
    return r"state for parameter 99, but the optimizer has \d+ parameters"


def sd_amsgrad_state(sd, model):
    sd["state"][3]["max_exp_avg_sq"] = sd["state"][3]["exp_avg_sq"].clone()
    return r"unexpected state \['max_exp_avg_sq'\] for parameter 3 \(amsgrad state"


def sd_torch_amsgrad(sd, model):
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    theirs = torch.optim.AdamW(ref.parameters(), amsgrad=True)
    theirs.step()
    sd.clear()
    sd.update(theirs.state_dict())
    return r"amsgrad"


def sd_bad_lr(sd, model):
    sd["param_groups"][0]["lr"] = -1.0
    return r"^Invalid learning rate: -1\.0$"


def sd_missing_step(sd, model):
    del sd["state"][0]["step"]
    return r"no 'step' for parameter 0 \('conv\.weight'\)"


def sd_negative_step(sd, model):
    sd["state"][0]["step"] = torch.tensor(-3.0)
    return r"step -3\.0 for parameter 0; it must be >= 0"


def sd_not_a_dict(sd, model):
    sd["state"][0] = [1, 2]
    return r"state list for parameter 0; expected a dict"


BAD_STATE_DICTS = {f.__name__[3:]: f for f in (
    sd_wrong_shape, sd_fewer_params, sd_more_groups, sd_unknown_param, sd_amsgrad_state, sd_torch_amsgrad,
    sd_bad_lr, sd_missing_step, sd_negative_step, sd_not_a_dict,
)}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_STATE_DICTS))
def test_failing_load_state_dict_changes_nothing(case):
    model, opt, gen = trained(steps=2)
    twin, twin_opt, twin_gen = trained(steps=2)
    sd = _state_dict(opt)
    pattern = BAD_STATE_DICTS[case](sd, model)
    if pattern == "torch":  # same input into torch.optim: same words
        ref = torch.optim.AdamW(copy.deepcopy(model).parameters())
        pattern = f"^{re.escape(torch_message(ref.load_state_dict, copy.deepcopy(sd)))}$"
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(params, opt))
    steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start=3)


@pytest.mark.parametrize(
    "key, value, pattern",
    [("lr", "0.1", r"lr must be a number, got str '0\.1'"),
     ("weight_decay", None, r"weight_decay must be a number, got NoneType None"),
     ("betas", ("0.9", 0.999), r"betas\[0\] must be a number, got str '0\.9'")],
)  # fmt: skip
@pytest.mark.parametrize("when", ["load_state_dict", "set_later"])
def test_a_hyperparameter_that_is_not_a_number_is_named_and_changes_nothing(key, value, pattern, when):
    """A string (a hand-edited or JSON-converted checkpoint) or None where a number belongs: a TypeError that names
    the hyper-parameter, rather than a bare comparison error, raised before anything changes."""
    model, opt, gen = trained(steps=2)
    twin, twin_opt, twin_gen = trained(steps=2)
    params = list(model.parameters())
    before = snapshot(params, opt)
    if when == "load_state_dict":
        sd = _state_dict(opt)
        sd["param_groups"][0][key] = value
        with pytest.raises(TypeError, match=pattern):
            opt.load_state_dict(sd)
    else:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        loss_fn(model, make_batch(gen)).backward()
        loss_fn(twin, make_batch(twin_gen)).backward()
        with pytest.raises(TypeError, match=pattern):
            opt.step()
        opt.param_groups[0][key] = good
        silent(opt.step)
        silent(twin_opt.step)
        opt.zero_grad()
        twin_opt.zero_grad()
        before = snapshot(params, opt)
    assert_unchanged(before, snapshot(params, opt))
    steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start=3)


def test_failing_sgd_load_state_dict_changes_nothing():
    model, opt, gen = trained("sgd", steps=2)
    twin, twin_opt, twin_gen = trained("sgd", steps=2)
    sd = _state_dict(opt)
    sd["state"][3]["momentum_buffer"] = torch.zeros(13)
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of shape \(13,\) for parameter 3 \('proj\.weight'\)"):
        opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(params, opt))
    steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start=3)


# ---------------------------------------------------------------------------------------------- later hparams

LATER_BAD = [
    ("adamw", 0, "lr", -1.0),
    ("adamw", 0, "betas", (1.5, 0.999)),
    ("adamw", 1, "betas", (0.9, 1.0)),
    ("adamw", 1, "betas", (-0.5, 0.999)),
    ("adamw", 0, "eps", -1e-8),
    ("adamw", 1, "weight_decay", -0.1),
    ("sgd", 1, "lr", -0.5),
    ("sgd", 0, "momentum", -0.9),
    ("sgd", 1, "nesterov", True),
    ("lion", 1, "betas", (0.9, 1.5)),
    ("lion", 0, "lr", -1e-4),
]


def two_groups(model):
    mats = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": mats}, {"params": rest, "lr": 1e-3}]


@pytest.mark.parametrize(
    "opt_name, group, key, value", LATER_BAD, ids=[f"{o}-group{g}-{k}={v}" for o, g, k, v in LATER_BAD]
)
def test_invalid_hyperparameter_set_later_is_refused_at_step(opt_name, group, key, value):
    def build():
        torch.manual_seed(0)
        model = Net()
        opt = silent(MAKE[opt_name], two_groups(model), **({"dampening": 0.1} if key == "nesterov" else {}))
        gen = torch.Generator().manual_seed(1)
        train_step(model, opt, gen)
        return model, opt, gen

    model, opt, gen = build()
    twin, twin_opt, twin_gen = build()
    good = opt.param_groups[group][key]
    opt.param_groups[group][key] = value
    if opt_name == "lion":
        expected = "Invalid beta parameter at index 1: 1.5" if key == "betas" else f"Invalid learning rate: {value}"
    else:
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[opt_name]
        kwargs = {"dampening": 0.1, "momentum": 0.9} if key == "nesterov" else {}
        expected = torch_message(cls, [nn.Parameter(torch.ones(1))], **{key: value, **kwargs})
    loss_fn(model, make_batch(gen)).backward()
    loss_fn(twin, make_batch(twin_gen)).backward()
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):  # refused again, not only once
        opt.step()
    assert_unchanged(before, snapshot(params, opt))
    opt.param_groups[group][key] = good
    silent(opt.step)
    silent(twin_opt.step)
    opt.zero_grad()
    twin_opt.zero_grad()
    assert_twins(model, opt, twin, twin_opt, 2)
    steps_like_twin(model, opt, gen, twin, twin_opt, twin_gen, start=3)


def test_invalid_tensor_lr_set_later_is_refused_at_step():
    model, opt, gen = trained(lr=torch.tensor(1e-2))
    opt.param_groups[0]["lr"] = torch.tensor(-1.0)
    loss_fn(model, make_batch(gen)).backward()
    params = list(model.parameters())
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=r"^Invalid learning rate: -1\.0$|^Invalid learning rate: tensor\(-1\.\)$"):
        opt.step()
    assert_unchanged(before, snapshot(params, opt))


def test_invalid_group_in_add_param_group_changes_nothing():
    model, opt, gen = trained()
    extra = nn.Parameter(torch.randn(7))
    params = list(model.parameters()) + [extra]
    expected = torch_message(torch.optim.AdamW, [extra], lr=-0.5)
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        opt.add_param_group({"params": [extra], "lr": -0.5})
    assert_unchanged(before, snapshot(params, opt))


def test_a_tensor_subclass_without_its_own_dispatch_is_stepped_as_a_tensor():
    """Only subclasses with their own dispatch (DTensor: tests/test_ddp.py) are refused; a plain subclass
    steps as torch.optim steps it."""

    class Tagged(torch.Tensor):
        pass

    torch.manual_seed(0)
    ours = nn.Parameter(torch.randn(3, 4).as_subclass(Tagged))
    theirs = nn.Parameter(ours.detach().clone())
    opt, ref = silent(flatopt.AdamW, [ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2)
    grad = torch.randn(3, 4)
    ours.grad = grad.clone()
    theirs.grad = grad.clone()
    silent(opt.step)  # the gradient was set, not accumulated: the first-step warning would name it
    ref.step()
    close(ours.detach().as_subclass(torch.Tensor), theirs.detach(), "parameter", rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["load_state_dict(assign=True)", "attribute", "added"])
def test_module_parameters_the_optimizer_lacks_are_detected(how):
    """An optimizer built from a module notices, at its full binding check (the first step, every
    FULL_CHECK_EVERY-th, check_bindings()), a trainable parameter of the module it does not hold: replaced
    (torch.optim keeps the old objects without a word, and the model stops training) or added without
    add_param_group. The step that finds it changes nothing."""
    model, opt, gen = trained()
    if how == "attribute":
        model.proj.weight = nn.Parameter(model.proj.weight.detach().clone())
        name = "proj.weight"
    elif how == "added":
        model.extra = nn.Linear(2, 2)
        name = "extra.weight"
    else:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        name = "proj.weight"
    with pytest.raises(RuntimeError, match=rf"trainable parameter\(s\) .*'{name}'.*not among the parameters"):
        opt.check_bindings()
    old = [p for b in flatopt.inspect(opt).buffers for p in b.params]
    for _ in range(FULL_CHECK_EVERY + 1):
        loss_fn(model, make_batch(gen)).backward()
        before = snapshot(old, opt)
        try:
            silent(opt.step)
        except RuntimeError as e:
            assert "not among the parameters" in str(e)
            assert_unchanged(before, snapshot(old, opt))
            break
    else:
        pytest.fail(f"the parameters were not detected within {FULL_CHECK_EVERY + 1} steps")


@pytest.mark.parametrize("how", ["load_state_dict(assign=True)", "attribute"])
@pytest.mark.parametrize("mode", ["step", "direct_grads", "in_backward"])
def test_parameters_replaced_in_the_module_are_refused_at_the_next_step(how, mode):
    """Parameters replaced after the first step get no gradient (the optimizer holds the old ones), in a pattern
    not seen before: the next step makes the full check and refuses, before anything changes, rather than train
    them no more until the FULL_CHECK_EVERY-th step (in in-backward mode, when every parameter was replaced, no
    hook of the optimizer ever ran: step() after a pass that stepped nothing checks)."""
    kwargs = {"in_backward": True} if mode == "in_backward" else {"direct_grads": mode == "direct_grads"}
    model, opt, gen = trained(**kwargs)
    if how == "attribute":
        model.proj.weight = nn.Parameter(model.proj.weight.detach().clone())
    else:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    old = [p for b in flatopt.inspect(opt).buffers for p in b.params]
    opt.state_dict()  # brings the buffers' cached launch flags up to date, as any call that reads the state does
    before = snapshot(old, opt, grads=False)
    with pytest.raises(RuntimeError, match=r"trainable parameter\(s\) .*'proj\.weight'.*not among the parameters"):
        loss_fn(model, make_batch(gen)).backward()
        silent(opt.step)
    assert_unchanged(before, snapshot(old, opt, grads=False))


def test_module_changes_that_keep_the_parameters_are_not_refused():
    """Compared by identity, not by name: removing a layer renumbers a Sequential's names, a parameter
    frozen later stays the optimizer's (skip_unused), a DDP-style wrapper prefixes every name."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    opt = silent(flatopt.SGD, seq, lr=0.1, skip_unused=True)
    seq(torch.randn(2, 3)).sum().backward()
    silent(opt.step)
    del seq[0]  # '1.weight' is now '0.weight'
    seq[0].bias.requires_grad_(False)
    opt.check_bindings()
    wrapper = nn.Module()
    wrapper.module = nn.Linear(3, 2)
    opt2 = silent(flatopt.AdamW, wrapper, lr=0.1)
    opt2.check_bindings()
    opt2.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})  # not in the module: fine
    opt2.check_bindings()


def test_wrapper_subclass_parameters_step_one_by_one_with_flat_false():
    """A tensor subclass with its own dispatch cannot live in a flat buffer (refused); with flat=False and
    the torch backend it steps as torch.optim steps it. DTensor is refused either way (tests/test_ddp.py)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor", reason="torch's TwoTensor test subclass")
    torch.manual_seed(0)

    def make():
        a = torch.randn(3, 4)
        return nn.Parameter(two_tensor.TwoTensor(a, a.clone()))

    with pytest.raises(ValueError, match=r"is a TwoTensor: tensor subclasses with their own dispatch"):
        flatopt.AdamW([make()], lr=1e-2)
    ours = make()
    theirs = nn.Parameter(two_tensor.TwoTensor(ours.a.detach().clone(), ours.b.detach().clone()))
    opt = flatopt.AdamW([ours], lr=1e-2, flat=False, backend="torch")
    ref = torch.optim.AdamW([theirs], lr=1e-2, foreach=False)
    for _ in range(3):
        g = torch.randn(3, 4)
        ours.grad = two_tensor.TwoTensor(g, g.clone())
        theirs.grad = two_tensor.TwoTensor(g.clone(), g.clone())
        opt.step()
        ref.step()
    close(ours.detach().a, theirs.detach().a, "parameter", rtol=1e-6, atol=1e-7)
