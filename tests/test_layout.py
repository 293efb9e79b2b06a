"""The flat layout: flatopt.layout.FlatBuffer's offset arithmetic and views, and how the optimizers
lay parameters out (input forms, tied and frozen parameters, one buffer per (device, dtype), .grad
views through zero_grad and accumulation, add_param_group, one launch per buffer, flat=False)."""

import copy
import warnings

import pytest
import torch
from conftest import Net, assert_same, device_for, loss_fn, make_batch
from torch import nn

import flatopt
from flatopt import cpu, kernels, reference
from flatopt.layout import _MMAP, ALIGN, HUGE_PAGE, FlatBuffer, GradSources, align_up, flat_zeros

# Sizes that are not multiples of ALIGN, exactly ALIGN, one past it, a scalar-like one and an
# empty one in the middle.
SHAPES = [(7,), (3, 5), (64,), (65,), (1,), (0,), (2, 3, 4), (130,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STATES = ("exp_avg", "exp_avg_sq")


def make_tensors(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def all_buffers(buf):
    return {"data": buf.data, "grad": buf.grad, **buf.states}


def padding_mask(buf):
    """True on the elements of the buffer that belong to no parameter."""
    pad = torch.ones(buf.numel, dtype=torch.bool)
    for s, e in buf.index.values():
        pad[s:e] = False
    return pad


def assert_view_of(view, flat, start, what):
    """``view`` lies in ``flat``'s memory and its first element is ``flat[start]`` (a parameter's data over a storage
    of its own bytes, a gradient or a state over the buffer's storage)."""
    assert view.device == flat.device and view.dtype == flat.dtype, f"{what} is not in the buffer"
    if view.numel() == 0:  # no memory to share (data_ptr() is 0): a gradient's or a state's view of the buffer
        if view.untyped_storage().nbytes():
            assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), f"{what} not in the buffer"
            assert view.storage_offset() == flat.storage_offset() + start, f"{what} starts at the wrong offset"
    else:
        assert view.data_ptr() == flat.data_ptr() + start * flat.element_size(), f"{what} is not at flat[{start}]"


def close(actual, expected, what, **tol):
    """torch.testing.assert_close with explicit tolerances and a message naming the step and the tensor."""
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def silent(fn, *args, **kwargs):
    """Call ``fn`` with the unused- and duplicate-parameter warnings silenced (they have tests of their own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def buffer_of(opt, p):
    found = [buf for buf in flatopt.inspect(opt).buffers if any(q is p for q in buf.params)]
    assert len(found) == 1, f"parameter of shape {tuple(p.shape)} is in {len(found)} buffers"
    return found[0]


# ---------------------------------------------------------------------------------------------- FlatBuffer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offsets_aligned_disjoint_tight_and_length(dtype):
    params = make_tensors(SHAPES, dtype)
    buf = FlatBuffer(params, [0] * len(params), STATES)
    prev_end = 0
    for i, p in enumerate(params):
        s, e = buf.index[p]
        assert buf.starts[i] == s
        assert s % ALIGN == 0, f"params[{i}] starts at {s}, not a multiple of ALIGN={ALIGN}"
        assert e - s == p.numel()
        assert s >= prev_end, f"params[{i}] overlaps the previous parameter"
        assert s == align_up(prev_end), f"params[{i}] leaves more than the alignment padding before it"
        prev_end = e
    assert buf.numel == align_up(prev_end)
    assert buf.numel % ALIGN == 0
    for name, flat in all_buffers(buf).items():
        assert flat.shape == (buf.numel,) and flat.dtype == dtype and flat.is_contiguous(), name
    assert set(buf.states) == set(STATES)


def test_length_of_one_small_parameter_is_one_granule():
    buf = FlatBuffer([torch.ones(3)], [0])
    assert buf.numel == ALIGN
    assert buf.index[buf.params[0]] == (0, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_views_cover_exactly_their_range_and_padding_stays_zero(dtype):
    params = make_tensors(SHAPES, dtype)
    buf = FlatBuffer(params, [0] * len(params), STATES)
    pad = padding_mask(buf)
    for name, flat in all_buffers(buf).items():
        assert not flat.any(), f"{name} is not zero-initialised"
        views = {"data": buf.data_views, "grad": buf.grad_views}.get(name) or buf.state_views[name]
        for i, (p, view) in enumerate(zip(params, views, strict=True)):
            s, e = buf.index[p]
            assert view.shape == p.shape and view.stride() == p.stride() and view.dtype == dtype
            assert_view_of(view, flat, s, f"{name} view {i}")
            view.fill_(i + 1)  # writes through the view land in [s, e) of the flat buffer
        for i, p in enumerate(params):
            s, e = buf.index[p]
            assert (flat[s:e] == i + 1).all(), f"{name}: the view of params[{i}] does not cover [{s}, {e})"
        assert not flat[pad].any(), f"{name}: a view writes into the padding"


def test_param_of_granule_group_table_and_step_meta():
    params = make_tensors(SHAPES)
    groups = [0, 1, 1, 2, 0, 2, 1, 0]
    buf = FlatBuffer(params, groups, STATES)
    owner = buf.meta.param_of_granule
    assert owner.dtype == torch.int32 and owner.numel() == buf.numel // ALIGN
    for g in range(owner.numel()):
        # a granule belongs to the parameter whose aligned range [start, align_up(end)) holds it
        holders = [
            i for i, p in enumerate(params) if p.numel() and buf.starts[i] <= g * ALIGN < align_up(buf.index[p][1])
        ]
        assert holders == [int(owner[g])], f"granule {g} is owned by {int(owner[g])}, expected {holders}"
    assert buf.meta.param_group.tolist() == groups and buf.meta.param_group.dtype == torch.int32
    assert buf.meta.steps.tolist() == [0.0] * len(params) and buf.meta.steps.dtype == torch.float32
    assert buf.meta.counter.tolist() == [0]
    assert buf.meta.active is None
    assert not buf.meta.uniform
    assert FlatBuffer(make_tensors(SHAPES), [3] * len(SHAPES)).meta.uniform


def test_param_of_granule_is_initialised_when_every_parameter_is_empty(monkeypatch):
    real_empty = torch.empty

    def dirty_empty(*args, **kwargs):  # uninitialised memory, made deterministic
        t = real_empty(*args, **kwargs)
        return t.fill_(-12345) if t.dtype == torch.int32 else t

    monkeypatch.setattr(torch, "empty", dirty_empty)
    buf = FlatBuffer([torch.zeros(0), torch.zeros(0, 3)], [0, 1])
    monkeypatch.undo()
    owner = buf.meta.param_of_granule
    assert ((owner >= 0) & (owner < len(buf.params))).all(), f"param_of_granule holds {owner.tolist()}"


def test_adopt_copies_values_and_existing_grads_into_views():
    params = [nn.Parameter(t) for t in make_tensors(SHAPES)]
    grads = make_tensors(SHAPES, seed=1)
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if i % 3 != 2:  # every third parameter has no gradient yet
            p.grad = g.clone()
    values = [p.detach().clone() for p in params]
    had_grad = [p.grad is not None for p in params]
    buf = FlatBuffer(params, [0] * len(params))
    buf.adopt()
    for i, p in enumerate(params):
        s, _ = buf.index[p]
        assert_view_of(p.data, buf.data, s, f"params[{i}].data")
        assert_view_of(p.grad, buf.grad, s, f"params[{i}].grad")
        assert torch.equal(p.detach(), values[i])
        assert torch.equal(p.grad, grads[i] if had_grad[i] else torch.zeros_like(p))
    assert not buf.data[padding_mask(buf)].any() and not buf.grad[padding_mask(buf)].any()


def strided_params():
    """A channels_last conv weight, a transposed matrix, a permuted 3-d tensor, and a size-1 dim
    with an arbitrary stride: all dense, none contiguous in the default format."""
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(5, 3, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    t = torch.randn(7, 9, generator=gen).t()
    perm = torch.randn(2, 3, 5, generator=gen).permute(2, 0, 1)
    odd = torch.randn(4, 6, generator=gen).as_strided((4, 1, 6), (6, 100, 1))
    return [nn.Parameter(x) for x in (conv, t, perm, odd)]


def test_views_keep_the_parameter_strides():
    params = strided_params()
    strides = [p.stride() for p in params]
    values = [p.detach().clone() for p in params]
    assert not params[0].is_contiguous() and params[0].is_contiguous(memory_format=torch.channels_last)
    opt = flatopt.SGD(params, lr=0.1)
    buf = flatopt.inspect(opt).buffers[0]
    for i, p in enumerate(params):
        assert p.stride() == strides[i], f"params[{i}] lost its strides"
        assert p.grad is None, "a parameter with no gradient keeps .grad None, as in torch"
        assert torch.equal(p.detach(), values[i])
        assert_view_of(p.data, buf.data, buf.index[p][0], f"params[{i}].data")
    assert params[0].is_contiguous(memory_format=torch.channels_last)
    # a backward accumulates into the views, with the parameter's strides kept
    sum(((p * (i + 1)) ** 2).sum() for i, p in enumerate(params)).backward()
    for i, p in enumerate(params):
        assert_view_of(p.grad, buf.grad, buf.index[p][0], f"params[{i}].grad after backward")
        assert p.grad.stride() == strides[i]
        torch.testing.assert_close(p.grad, 2 * (i + 1) ** 2 * values[i], atol=1e-6, rtol=1e-6)
    opt.step()
    for i, p in enumerate(params):
        expected = values[i] - 0.1 * 2 * (i + 1) ** 2 * values[i]
        close(p.detach(), expected, f"step 1, params[{i}]", atol=1e-6, rtol=1e-5)
        assert p.stride() == strides[i]


# ---------------------------------------------------------------------------------------------- optimizer layout


def forms(model):
    """The same two param groups in every form torch.optim accepts."""
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.dim() >= 2]
    rest = [(n, p) for n, p in named if p.dim() < 2]
    return {
        "module": (model, model.parameters()),
        "list": (list(model.parameters()),) * 2,
        "generator": ((p for p in model.parameters()), (p for p in model.parameters())),
        "named": (model.named_parameters(), model.named_parameters()),
        "groups": [
            [{"params": [p for _, p in mats], "weight_decay": 0.3}, {"params": [p for _, p in rest], "lr": 0.02}]
        ]
        * 2,
        "generator_groups": [
            [
                {"params": (p for _, p in mats), "weight_decay": 0.3},
                {"params": (p for _, p in rest), "lr": 0.02},
            ]
            for _ in range(2)
        ],
        "named_groups": [[{"params": mats, "weight_decay": 0.3}, {"params": rest, "lr": 0.02}]] * 2,
    }


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("form", list(forms(Small())))
def test_accepts_every_torch_input_form(form):
    torch.manual_seed(0)
    model = Small()
    ref = copy.deepcopy(model)
    ours = flatopt.AdamW(forms(model)[form][0], lr=0.01)
    theirs = torch.optim.AdamW(forms(ref)[form][1], lr=0.01, foreach=False)
    assert len(ours.param_groups) == len(theirs.param_groups)
    for g, h in zip(ours.param_groups, theirs.param_groups, strict=True):
        assert len(g["params"]) == len(h["params"]) and g["lr"] == h["lr"]
        assert g["weight_decay"] == h["weight_decay"] and g.get("param_names") == h.get("param_names")
    for p in model.parameters():
        buf = buffer_of(ours, p)
        assert_view_of(p.data, buf.data, buf.index[p][0], "data")
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        for m, o in ((model, ours), (ref, theirs)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_same(p.detach(), q.detach(), step, name)


def test_tied_parameters_appear_once():
    model = Net()
    assert model.head.weight is model.emb.weight
    opt = silent(flatopt.AdamW, model)
    laid_out = [p for buf in flatopt.inspect(opt).buffers for p in buf.params]
    trainable = [p for p in model.parameters() if p.requires_grad]  # nn.Module yields a tied weight once
    assert len(laid_out) == len(trainable) == len({id(p) for p in laid_out})
    buffer_of(opt, model.head.weight)


def test_duplicate_parameter_in_a_list_is_stepped_once():
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ours = flatopt.SGD([w, b, w], lr=0.1, momentum=0.9)
    assert [p for p in ours.param_groups[0]["params"]] == [w, b]
    assert [p for buf in flatopt.inspect(ours).buffers for p in buf.params] == [w, b]
    theirs = torch.optim.SGD([w2, b2], lr=0.1, momentum=0.9)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for step in (1, 2, 3):
        for (ww, bb), o in (((w, b), ours), ((w2, b2), theirs)):
            (x @ ww + bb).square().sum().backward()
            o.step()
            o.zero_grad()
        assert_same(w.detach(), w2.detach(), step, "w")
        assert_same(b.detach(), b2.detach(), step, "b")


DUP_OPTIMIZERS = {  # the same arguments for flatopt and torch.optim
    "adamw": (flatopt.AdamW, torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
    "sgd": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
}
DUP_ENGINES = {"step": {}, "in_backward": dict(in_backward=True), "per_param": dict(flat=False)}


def dup_groups(params, named, duplicate=True):
    """``[w, b, w]`` (named: the second entry of ``w`` under a name of its own, as ``named_parameters(
    remove_duplicate=False)`` gives a tied weight), ``[w, b]`` without the duplicate, then ``[c]``."""
    w, b, c = params
    first = [("w", w), ("b", b)] + ([("w_tied", w)] if duplicate else [])
    groups = [first, [("c", c)]]
    return [{"params": g if named else [p for _, p in g]} for g in groups]


def dup_step(runs, step):
    """One step of each (params, optimizer) of ``runs`` from the same gradients (in-backward: during backward)."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
    for (w, b, c), opt in runs:
        ((x @ w + b).square().sum() + (c * c).sum() * step).backward()
        opt.step()
        opt.zero_grad()


def assert_dup_runs_same(ours, theirs, step, what):
    for name, p, q in zip("wbc", ours, theirs, strict=True):
        assert_same(p.detach(), q.detach(), step, f"{what}: {name}")


def assert_same_states(ours, ours_p, theirs, theirs_p, what):
    """The state of each parameter in ``ours`` is the one in ``theirs`` (flatopt or torch.optim), key for key."""
    for name, p, q in zip("wbc", ours_p, theirs_p, strict=True):
        mine, torchs = ours.state[p], theirs.state[q]
        assert mine.keys() == torchs.keys(), f"{what}: {name} has {sorted(mine)}, the other {sorted(torchs)}"
        for key, value in torchs.items():
            assert_same(mine[key].float(), value.float(), 0, f"{what}: {name}.{key}")


def without_duplicates(sd):
    """``sd`` with each group's repeated entries left out: the state dict of the list without the duplicate."""
    sd = copy.deepcopy(sd)
    for group in sd["param_groups"]:
        first = {}
        for i, k in enumerate(group["params"]):
            first.setdefault(k, i)
        group["params"] = list(first)
        if "param_names" in group:
            group["param_names"] = [group["param_names"][i] for i in first.values()]
    return sd


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("engine", list(DUP_ENGINES))
@pytest.mark.parametrize("opt_name", list(DUP_OPTIMIZERS))
def test_duplicate_parameter_state_dicts_load_both_ways_with_torch(opt_name, engine, named):
    """A group given a parameter twice (``[w, b, w]``: flatopt keeps and steps it once, torch.optim keeps it twice and
    steps it twice) lists it twice in state_dict(), so that the state dicts of flatopt and torch.optim built from the
    same list load into each other, and into flatopt built from the list without the duplicate. Steps are compared
    with torch.optim built from ``[w, b]``, whose numbers flatopt's are."""
    ours_cls, theirs_cls, kwargs = DUP_OPTIMIZERS[opt_name]
    options = dict(backend="torch", **DUP_ENGINES[engine])
    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(3), torch.randn(5)]
    ours_p, ref_p, dup_p = ([nn.Parameter(t.clone()) for t in start] for _ in range(3))
    ours = silent(ours_cls, dup_groups(ours_p, named), **kwargs, **options)
    ref = theirs_cls(dup_groups(ref_p, named, duplicate=False), **kwargs)
    dup = silent(theirs_cls, dup_groups(dup_p, named), **kwargs)
    for step in (1, 2):
        dup_step([(ours_p, ours), (ref_p, ref), (dup_p, dup)], step)
        assert_dup_runs_same(ours_p, ref_p, step, "before saving")
    sd_ours, sd_dup = copy.deepcopy(ours.state_dict()), copy.deepcopy(dup.state_dict())
    assert [g["params"] for g in sd_ours["param_groups"]] == [[0, 1, 0], [2]]
    assert [g["params"] for g in sd_dup["param_groups"]] == [[2, 1, 2], [3]]  # torch.optim's numbers
    assert [p for p in ours.param_groups[0]["params"]] == ours_p[:2]  # still kept once
    if named:
        assert sd_ours["param_groups"][0]["param_names"] == sd_dup["param_groups"][0]["param_names"]
        assert ours.param_groups[0]["param_names"] == ["w", "b"]

    def fresh(cls, values, sd, duplicate=True):  # an optimizer over copies of ``values``, loaded with ``sd``
        params = [nn.Parameter(p.detach().clone()) for p in values]
        more = options if cls is ours_cls else {}
        opt = silent(cls, dup_groups(params, named, duplicate=duplicate), **kwargs, **more)
        opt.load_state_dict(copy.deepcopy(sd))
        return params, opt

    torch_from_ours = fresh(theirs_cls, ours_p, sd_ours)
    assert_same_states(torch_from_ours[1], torch_from_ours[0], ours, ours_p, "torch.optim loaded flatopt's")
    ref_from_dup = fresh(theirs_cls, dup_p, without_duplicates(sd_dup), duplicate=False)
    from_dup = {
        "flatopt from torch.optim's": fresh(ours_cls, dup_p, sd_dup),
        "flatopt without the duplicate from torch.optim's": fresh(ours_cls, dup_p, sd_dup, duplicate=False),
    }
    from_ours = {"flatopt from flatopt's": fresh(ours_cls, ours_p, sd_ours)}
    for what, (params, opt) in {**from_dup, **from_ours}.items():
        source = (dup, dup_p) if what in from_dup else (ours, ours_p)
        assert_same_states(opt, params, *source, what)
        again = opt.state_dict()["param_groups"]  # what it loaded, it exports again, with the list it was given
        listed = [[0, 1], [2]] if "without" in what else [[0, 1, 0], [2]]
        assert [g["params"] for g in again] == listed, what
        if named:
            assert again[0]["param_names"] == (["w", "b"] if "without" in what else ["w", "b", "w_tied"]), what
            assert opt.param_groups[0]["param_names"] == ["w", "b"], what
    for step in (3, 4):
        dup_step([(ours_p, ours), (ref_p, ref), ref_from_dup, *from_dup.values(), *from_ours.values()], step)
        assert_dup_runs_same(ours_p, ref_p, step, "uninterrupted")
        for what, (params, _) in from_ours.items():
            assert_dup_runs_same(params, ref_p, step, what)
        for what, (params, _) in from_dup.items():
            assert_dup_runs_same(params, ref_from_dup[0], step, what)


@pytest.mark.parametrize("case", ["saved_with_duplicate", "given_with_duplicate"])
def test_duplicate_parameter_in_a_group_that_does_not_fit_is_named(case):
    """A state dict whose group does not fit because of a duplicate (saved from ``[w, b, w]`` into ``[w, b, x]``, or
    the reverse) is refused before anything changes, naming the duplicated parameter and what to do."""
    torch.manual_seed(0)
    w, b, x, c = (nn.Parameter(torch.randn(s)) for s in ((4, 3), (3,), (4, 3), (5,)))
    saved_list, ours_list = ([w, b, w], [w, b, x]) if case == "saved_with_duplicate" else ([w, b, x], [w, b, w])
    theirs = silent(torch.optim.AdamW, [{"params": saved_list}, {"params": [c]}], lr=0.1)
    ours = silent(flatopt.AdamW, [{"params": ours_list}, {"params": [c]}], lr=0.1, backend="torch")
    for p in (w, b, x, c):
        p.grad = torch.ones_like(p)
    theirs.step()
    ours.step()
    sd = copy.deepcopy(theirs.state_dict())
    before = [p.detach().clone() for p in (w, b, x, c)], copy.deepcopy(ours.state_dict())
    if case == "saved_with_duplicate":
        pattern = (
            r"param group 0 of the state dict lists 3 entries, 2 distinct parameters \(parameter 2 twice: torch\.optim "
            r"keeps a parameter given more than once as many times, flatopt once\), and this optimizer's param group "
            r"0 holds 3 distinct parameters; create the optimizer from the parameter list the state dict was saved from"
        )
    else:
        pattern = (
            r"param group 0 of the state dict lists 3 entries, 3 distinct parameters, and this optimizer's param group "
            r"0 holds 2 distinct parameters \(it was given params\[0\] of param group 0 \(shape \(4, 3\)\) twice, and "
            r"keeps it once\); create the optimizer from the parameter list the state dict was saved from"
        )
    with pytest.raises(ValueError, match=r"doesn't match the size of optimizer's group: " + pattern):
        ours.load_state_dict(sd)
    after = [p.detach().clone() for p in (w, b, x, c)], ours.state_dict()
    for i, (p, q) in enumerate(zip(before[0], after[0], strict=True)):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=lambda m: f"params[{i}] changed: {m}")
    assert before[1]["param_groups"] == after[1]["param_groups"]
    for k, entry in before[1]["state"].items():
        for n, t in entry.items():
            torch.testing.assert_close(after[1]["state"][k][n], t, atol=0, rtol=0, msg=lambda m: f"{k}.{n}: {m}")


def test_frozen_parameters_are_left_alone():
    torch.manual_seed(0)
    model = Net()
    frozen = list(model.frozen.parameters())
    ptrs = [p.data_ptr() for p in frozen]
    values = [p.detach().clone() for p in frozen]
    opt = silent(flatopt.AdamW, model, lr=0.1, weight_decay=0.5)
    for buf in flatopt.inspect(opt).buffers:
        assert not any(p is q for p in frozen for q in buf.params), "a frozen parameter was laid out"
    assert all(any(p is q for q in opt.param_groups[0]["params"]) for p in frozen), "kept in the group as torch does"
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        loss_fn(model, make_batch(gen)).backward()
        silent(opt.step)
        opt.zero_grad()
    for p, ptr, v in zip(frozen, ptrs, values, strict=True):
        assert p.data_ptr() == ptr and p.grad is None and torch.equal(p.detach(), v)
        assert p not in opt.state


def test_one_buffer_per_dtype():
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32]
    params = [nn.Parameter(torch.randn(5 + i, generator=gen).to(dt)) for i, dt in enumerate(dtypes)]
    for p in params:  # an existing gradient is copied into the gradient buffer, and .grad becomes its view
        p.grad = torch.randn_like(p)
    opt = flatopt.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 0.1}])
    assert [buf.dtype for buf in flatopt.inspect(opt).buffers] == [torch.float32, torch.bfloat16, torch.float16]
    for buf in flatopt.inspect(opt).buffers:
        assert buf.data.dtype == buf.grad.dtype == buf.dtype
        assert all(s.dtype == buf.dtype for s in buf.states.values())
        assert all(p.dtype == buf.dtype for p in buf.params)
    for p in params:
        buf = buffer_of(opt, p)
        assert_view_of(p.data, buf.data, buf.index[p][0], "data")
        assert_view_of(p.grad, buf.grad, buf.index[p][0], "grad")
    fp32 = buffer_of(opt, params[0])
    assert fp32.group_ids == [0, 0, 1] and fp32.meta.param_group.tolist() == [0, 0, 1]


def check_grad_views(opt, model):
    """Every trainable parameter's .grad is its view, but those of the layer no forward uses (Net.unused),
    whose .grad stays None as in torch."""
    for name, p in model.named_parameters():
        if not p.requires_grad or name.startswith("unused."):
            assert p.grad is None, f"{name}.grad"
            continue
        buf = buffer_of(opt, p)
        assert_view_of(p.grad, buf.grad, buf.index[p][0], f"{name}.grad")
        assert p.grad.stride() == p.stride(), name


def test_zero_grad_set_to_none_false_keeps_views_and_zeroes_the_buffer():
    torch.manual_seed(0)
    model = Net()
    opt = silent(flatopt.AdamW, model)
    loss_fn(model, make_batch(torch.Generator().manual_seed(1))).backward()
    assert all(buf.grad.any() for buf in flatopt.inspect(opt).buffers)
    opt.zero_grad(set_to_none=False)
    check_grad_views(opt, model)
    for buf in flatopt.inspect(opt).buffers:
        assert not buf.grad.any()
    for p in model.parameters():
        assert p.grad is None or not p.grad.any()


def test_zero_grad_sets_none_and_the_next_backward_finds_views():
    """zero_grad() (set_to_none=True) as torch.optim: every .grad None, and a step then changes nothing; the
    next backward's gradients are views of the buffer (tests/test_grads.py covers the rest)."""
    torch.manual_seed(0)
    model = Net()
    opt = silent(flatopt.AdamW, model)
    gen = torch.Generator().manual_seed(1)
    loss_fn(model, make_batch(gen)).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    silent(opt.step)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)), "nothing to step"
    loss_fn(model, make_batch(gen)).backward()
    check_grad_views(opt, model)


def test_two_backwards_accumulate_in_place():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = silent(flatopt.AdamW, model)
    gen = torch.Generator().manual_seed(1)
    batches = [make_batch(gen), make_batch(gen)]
    for batch in batches:
        loss_fn(model, batch).backward()
        loss_fn(ref, batch).backward()
    check_grad_views(opt, model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p.requires_grad and q.grad is not None:
            close(p.grad, q.grad, f"after 2 backwards, {name}.grad", atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_padding_stays_zero_through_steps(backend, opt_name):
    device = device_for(backend)
    torch.manual_seed(0)
    model = Net().to(device)
    make = {
        "adamw": lambda ps: flatopt.AdamW(ps, lr=0.1, weight_decay=0.5, backend=backend),
        "sgd": lambda ps: flatopt.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5, nesterov=True, backend=backend),
    }[opt_name]
    opt = silent(make, model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        loss_fn(model, make_batch(gen, device=device)).backward()
        silent(opt.step)
    for buf in flatopt.inspect(opt).buffers:
        pad = padding_mask(buf).to(device)
        assert pad.any(), "the test model must leave padding"
        for name, flat in all_buffers(buf).items():
            assert flat.any(), f"{name} was never written"
            assert not flat[pad].any(), f"{name}: padding is not zero after 3 steps"


def test_add_param_group_keeps_values_and_state(backend):
    """Two steps over part of a model, add the rest as a new group, three more steps: the same as
    torch.optim doing the same, and nothing already there changes when the group is added."""
    device = device_for(backend)
    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    first = [model.conv.weight, model.conv.bias, model.proj.weight]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in first)]
    names = {p: n for n, p in model.named_parameters()}
    ref_of = dict(zip(model.parameters(), ref.parameters(), strict=True))
    ours = flatopt.AdamW(first, lr=0.02, weight_decay=0.1, backend=backend)
    theirs = torch.optim.AdamW([ref_of[p] for p in first], lr=0.02, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(1)

    def train(step, params):
        batch = make_batch(gen, device=device)
        for m, o in ((model, ours), (ref, theirs)):
            loss_fn(m, batch).backward()
            silent(o.step)
            o.zero_grad(set_to_none=False)
        for p in params:
            assert_same(p.detach(), ref_of[p].detach(), step, names[p])
            for key, value in theirs.state[ref_of[p]].items():
                mine = ours.state[p][key]
                if key == "step":
                    assert float(mine) == float(value), f"step {step}, {names[p]}: step {float(mine)}"
                else:
                    assert_same(mine, value, step, f"{names[p]}.{key}")

    for step in (1, 2):
        train(step, first)
    for p in rest:  # neither optimizer zeroes gradients of parameters it does not hold: start them afresh
        p.grad = None
        ref_of[p].grad = None
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in ours.state[p].items()}) for p in first}
    group = {"params": rest, "lr": 0.01, "weight_decay": 0.0}
    ours.add_param_group(group)
    theirs.add_param_group({**group, "params": [ref_of[p] for p in rest]})
    for p in first:
        assert torch.equal(p.detach(), before[p][0])
        for k, v in before[p][1].items():
            assert torch.equal(ours.state[p][k].cpu(), v.cpu()), f"{names[p]}.{k} changed in add_param_group"
    for p in first + rest:
        buf = buffer_of(ours, p)
        assert_view_of(p.data, buf.data, buf.index[p][0], names[p])
        if any(p is q for q in first):  # the others' .grad stays None until a backward gives them one, as in torch
            assert_view_of(p.grad, buf.grad, buf.index[p][0], names[p] + ".grad")
    for step in (3, 4, 5):
        train(step, first + rest)


MOMENTUM_SCHEDULES = {  # step -> momentum of the second group
    "on at step 3": {3: 0.9},
    # on, off, on again: torch.optim keeps the momentum buffer through momentum=0 and goes on from it
    "on, off, on again": {3: 0.9, 5: 0.0, 7: 0.9},
}


@pytest.mark.parametrize("schedule", list(MOMENTUM_SCHEDULES))
def test_momentum_switched_on_later_in_a_buffer_shared_with_a_momentum_group(backend, schedule):
    """The group's first momentum step sets the buffer to the update (torch's buf <- d), although
    its parameters' step counts are already > 0; a later one goes on from the kept buffer."""
    device = device_for(backend)
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(5, device=device)), nn.Parameter(torch.randn(6, device=device))
    a2, b2 = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    ours = flatopt.SGD([{"params": [a], "momentum": 0.9}, {"params": [b]}], lr=0.1, dampening=0.5, backend=backend)
    theirs = torch.optim.SGD([{"params": [a2], "momentum": 0.9}, {"params": [b2]}], lr=0.1, dampening=0.5)
    assert len(flatopt.inspect(ours).buffers) == 1
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 10):
        if step in MOMENTUM_SCHEDULES[schedule]:  # a scheduler or the user changes the second group's momentum
            ours.param_groups[1]["momentum"] = theirs.param_groups[1]["momentum"] = MOMENTUM_SCHEDULES[schedule][step]
        ga, gb = torch.randn(5, generator=gen).to(device), torch.randn(6, generator=gen).to(device)
        a.grad, b.grad = ga.clone(), gb.clone()
        a2.grad, b2.grad = ga.clone(), gb.clone()
        silent(ours.step)
        theirs.step()
        assert_same(a.detach(), a2.detach(), step, "group 0")
        assert_same(b.detach(), b2.detach(), step, "group 1")


# ---------------------------------------------------------------------------------------------- launches

OPTIMIZERS = {
    "adamw": (lambda ps, **k: flatopt.AdamW(ps, lr=1e-2, **k), "adamw_step"),
    "sgd": (lambda ps, **k: flatopt.SGD(ps, lr=1e-2, momentum=0.9, **k), "sgd_step"),
    "lion": (lambda ps, **k: flatopt.Lion(ps, lr=1e-3, **k), "lion_step"),
}


def layouts(case, device):
    """(param groups, number of (device, dtype) buffers) for each launch-count case."""
    gen = torch.Generator().manual_seed(0)

    def tensors(n, dtype=torch.float32):
        return [nn.Parameter(torch.randn(1 + i % 7, 1 + i % 5, generator=gen).to(device, dtype)) for i in range(n)]

    if case == "1-group":
        return [{"params": tensors(6)}], 1
    if case == "5-groups":
        return [{"params": tensors(2 + g), "lr": 1e-3 * (g + 1)} for g in range(5)], 1
    if case == "300-params":
        ps = tensors(300)
        return [{"params": ps[:100]}, {"params": ps[100:250], "lr": 1e-3}, {"params": ps[250:]}], 1
    if case == "2-dtypes":
        return [{"params": tensors(4) + tensors(3, torch.bfloat16)}, {"params": tensors(2, torch.bfloat16)}], 2
    raise ValueError(case)


@pytest.mark.parametrize("case", ["1-group", "5-groups", "300-params", "2-dtypes"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_one_launch_per_buffer_per_step(backend, opt_name, case, monkeypatch):
    make, entry = OPTIMIZERS[opt_name]
    module = {"triton": kernels, "cpu": cpu, "torch": reference}[backend]
    calls = []
    real = getattr(module, entry)

    def counted(param, *args, **kwargs):
        calls.append(param)
        return real(param, *args, **kwargs)

    monkeypatch.setattr(module, entry, counted)
    if backend == "cpu":  # an ordinary CPU step launches through the lane's entry (flatopt.engines.cpu_lane)
        real_own = cpu.step_own

        def counted_own(rule, param, *args, **kwargs):
            calls.append(param)
            return real_own(rule, param, *args, **kwargs)

        monkeypatch.setattr(cpu, "step_own", counted_own)
    groups, n_buffers = layouts(case, device_for(backend))
    params = [p for g in groups for p in g["params"]]
    opt = make(groups, backend=backend)
    assert len(flatopt.inspect(opt).buffers) == n_buffers
    for step in (1, 2):
        calls.clear()
        before = [buf.data.clone() for buf in flatopt.inspect(opt).buffers]
        sum((p.float() * (i % 3 - 1.5)).sum() for i, p in enumerate(params)).backward()
        opt.step()
        opt.zero_grad()
        assert len(calls) == n_buffers, f"step {step}: {len(calls)} launches for {n_buffers} buffer(s)"
        assert {c.data_ptr() for c in calls} == {buf.data.data_ptr() for buf in flatopt.inspect(opt).buffers}
        for buf, b in zip(flatopt.inspect(opt).buffers, before, strict=True):
            assert not torch.equal(buf.data, b), f"step {step} did not step the {buf.dtype} buffer"


# ---------------------------------------------------------------------------------------------- flat=False


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_flat_false_keeps_tensors_in_place_and_matches_torch(backend, opt_name):
    """Also with the Triton kernels, over parameters whose sizes are not multiples of GRANULE."""
    make = {
        "adamw": (
            lambda m: flatopt.AdamW(m, lr=1e-2, weight_decay=0.1, flat=False, backend=backend),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False),
        ),
        "sgd": (
            lambda m: flatopt.SGD(m, lr=0.05, momentum=0.9, weight_decay=0.1, flat=False, backend=backend),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1, foreach=False),
        ),
    }[opt_name]
    device = device_for(backend)
    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    strides = {n: p.stride() for n, p in model.named_parameters()}
    ours, theirs = make[0](model), make[1](ref)
    assert flatopt.inspect(ours).buffers == []
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        batch = make_batch(gen, device=device)
        for m, o in ((model, ours), (ref, theirs)):
            loss_fn(m, batch).backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.data_ptr() == ptrs[name] and p.stride() == strides[name], f"step {step}: {name} moved"
            assert_same(p.detach(), q.detach(), step, name)
            for key, value in theirs.state.get(q, {}).items():
                mine = ours.state[p][key]
                if key == "step":
                    assert float(mine) == float(value), f"step {step}, {name}: step count {float(mine)}"
                else:
                    assert_same(mine, value, step, f"{name}.{key}")
        assert model.unused.weight not in ours.state or not ours.state[model.unused.weight]


def test_grad_sources_share_the_buffers_index_tables():
    """The offsets and sizes a gathering launch reads never change for a buffer: every GradSources of it reads the
    same two tables, built once (one host-to-device copy per step is left: the gradients' addresses)."""
    params = [nn.Parameter(torch.randn(n)) for n in (5, 64, 3)]
    buf = FlatBuffer(params, [0, 0, 0], grad=True)
    grads = [torch.randn(64) if i == 1 else None for i in range(3)]
    a, b = GradSources.of(buf, grads), GradSources.of(buf, [None, None, None])
    assert a.start is b.start and a.numel is b.numel
    assert a.start.tolist() == buf.starts and a.numel.tolist() == [5, 64, 3]
    assert a.src.tolist() == [buf.grad_views[0].data_ptr(), grads[1].data_ptr(), buf.grad_views[2].data_ptr()]


HUGE_PAGES = pytest.mark.skipif(_MMAP is None, reason="huge-page buffers are laid out on Linux only (mmap, madvise)")


@HUGE_PAGES
def test_a_large_cpu_buffer_lies_in_huge_page_aligned_memory_of_its_own():
    """flat_zeros: at least HUGE_PAGE bytes on the CPU, in an anonymous mapping aligned to HUGE_PAGE (so that the
    kernel can back it with transparent huge pages), zeroed, with a storage of exactly its bytes (torch.save of a
    view writes the buffer, not the alignment's slack); smaller, or elsewhere, torch's allocator."""
    t = flat_zeros(HUGE_PAGE // 4 + 3, torch.float32, "cpu")
    assert t.data_ptr() % HUGE_PAGE == 0 and t.is_contiguous() and t.numel() == HUGE_PAGE // 4 + 3
    assert not t.any() and not t.untyped_storage().resizable()
    assert t.untyped_storage().nbytes() == t.numel() * 4
    t[-1] = 2.0  # writable to the end
    small = flat_zeros(100, torch.bfloat16, "cpu")
    assert small.untyped_storage().resizable() and small.dtype == torch.bfloat16 and not small.any()


@HUGE_PAGES
@pytest.mark.cpu_gradient_policy
def test_an_optimizer_over_large_cpu_parameters_steps_as_torch_optim_and_saves_its_bytes():
    """Parameters, states and the kept CPU gradient buffer of a model of several MiB lie in those mappings; the
    optimizer steps as torch.optim's, and checkpoints of the model and the optimizer hold their bytes only."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8))
    twin = copy.deepcopy(model)
    opt = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    buf = flatopt.inspect(opt).buffers[0]
    for t in (buf.data, buf.grad, *buf.states.values()):
        assert not t.untyped_storage().resizable(), "not laid out by flat_zeros"
    for step in range(3):
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (twin, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    for obj, expected in ((model.state_dict(), nbytes), (opt.state_dict(), 2 * nbytes)):
        f = io.BytesIO()
        torch.save(obj, f)
        assert expected <= f.tell() < expected + 64 * 1024, (f.tell(), expected)


@pytest.mark.parametrize("mode", sorted(DUP_ENGINES))
def test_torch_save_of_one_layer_writes_that_layers_bytes_not_the_buffer(mode):
    """Each parameter's data is a storage of its own bytes over the buffer's memory: torch.save of one layer's
    state_dict (an adapter's weights) writes that layer, and the saved tensors load back as they were."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    opt = flatopt.AdamW(model, lr=0.1, **DUP_ENGINES[mode])
    model(torch.randn(3, 256)).sum().backward()
    opt.step()
    f = io.BytesIO()
    torch.save(model[1].state_dict(), f)
    assert f.tell() < 4 * (256 * 4 + 4) + 4096, f.tell()  # the whole buffer would be over 260 KB
    f.seek(0)
    for k, v in torch.load(f).items():
        assert torch.equal(v, model[1].state_dict()[k]), k


@pytest.mark.parametrize(
    "mode", [{}, {"in_backward": True}, {"direct_grads": True}], ids=["step", "in_backward", "direct"]
)
def test_built_under_another_default_device_the_buffers_follow_the_parameters(mode):
    """An optimizer created inside ``with torch.device("meta")`` (where a model's next part is being
    initialised) or under torch.set_default_device(): its buffers, tables and host-side tensors go where the
    parameters are and where the host needs them, not to the default device, and it trains as torch.optim."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    with torch.device("meta"):
        opt = flatopt.AdamW(model, lr=1e-2, **mode)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 6)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert not p.is_meta, name
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("direct_grads", [False, True])
def test_an_optimizer_dropped_before_its_first_step_leaves_no_hooks(direct_grads):
    """The hooks that record the first backward pass are removed at the first step, or with the optimizer when
    it never steps (a trial of a hyper-parameter search, an optimizer built to convert a state dict): they would
    pile up on the parameters, a Python call each per backward."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    for _ in range(3):
        opt = flatopt.AdamW(model, lr=1e-2, direct_grads=direct_grads)
        assert any(p._backward_hooks or p._post_accumulate_grad_hooks for p in model.parameters())
        del opt
        gc.collect()
    assert all(p._backward_hooks is None for p in model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("mode", ["step", "in_backward"])
def test_a_second_flatopt_optimizer_over_some_parameters_is_named_at_the_first_ones_next_check(mode, monkeypatch):
    """A parameter lives in the buffers of one flatopt optimizer at a time. Another one created over some of them
    (the middle layer, even a throwaway one, deleted at once) takes them: the first one's next check looks at
    every parameter, not only each buffer's ends (the GPU's per-step check), and refuses, naming the cause, before
    anything changes."""
    import gc

    from flatopt import bindings

    monkeypatch.setattr(bindings, "watch_every_address", lambda buf: False)  # the GPU's check: the ends only
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=mode == "in_backward")
    x = torch.randn(3, 4)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert bindings.ends_bound(flatopt.inspect(opt).buffers)
    other = flatopt.AdamW(model[2], lr=1e-2)
    del other
    gc.collect()
    assert not bindings.ends_bound(flatopt.inspect(opt).buffers)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"parameter '2\.weight' was laid out by another flatopt optimizer"):
        model(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
