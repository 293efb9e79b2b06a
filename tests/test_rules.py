"""flatopt.rules: each optimizer's hyper-parameter columns, named once, are the ones its Triton kernel and
its torch reference read; the row builder, the checks of a param group (torch's words), the states and the
optimizer classes' delegation to their rule.

The column test changes one column of one param group's row and launches the kernel (under the Triton
interpreter on a machine without a GPU) and the reference: both must agree with each other, leave the
other group's parameter exactly as without the change, and change the parameter of the changed group
exactly when the rule's math reads that column.
"""

import math
import re

import pytest
import torch
from conftest import TOL, TRITON_SKIP, device_for

import flatopt
from flatopt import cpu, functional, kernels, reference
from flatopt.layout import FlatBuffer
from flatopt.rules import ADAMW, LION, SGD, Rule

RULES = {"adamw": ADAMW, "sgd": SGD, "lion": LION}
CLASSES = {"adamw": flatopt.AdamW, "sgd": flatopt.SGD, "lion": flatopt.Lion}
GROUPS = {  # complete param groups, every value visible in a float32 step
    "adamw": dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1, maximize=False),
    "sgd": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05, nesterov=False, maximize=False),
    "lion": dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=0.1),
}
UNREAD = {"adamw": {"beta1"}, "sgd": set(), "lion": set()}  # columns the update does not read
SHAPES = [(100,), (7, 10)]  # one parameter per group; sizes that are not multiples of 64
DEVICE = device_for("triton")


def changed(name, value):
    """Another value for column ``name``: a sign flipped, a flag toggled, anything else halved."""
    if name == "grad_sign":
        return -value
    if name == "nesterov":
        return 1.0 - value
    return value * 0.5 if value else 0.25


def step_once(opt, launcher, rows, uniform):
    """The buffers after one launch of ``launcher`` over two parameters (params[i] in group i, or both in
    group 0 when ``uniform``) with the float32 table ``rows``, from the same random start each time."""
    rule = RULES[opt]
    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(s, device=DEVICE) for s in SHAPES]
    buf = FlatBuffer(params, [0, 0] if uniform else [0, 1], rule.state_names)
    for i in range(len(params)):
        for views in (buf.data_views, buf.grad_views, *buf.state_views.values()):
            views[i].copy_(torch.randn(SHAPES[i], generator=gen))
    if "exp_avg_sq" in buf.states:
        buf.states["exp_avg_sq"].abs_()
    buf.meta.steps.fill_(3.0)  # past the first step: SGD's momentum buffer and the bias corrections in use
    buf.meta.uniform = uniform
    hparams = torch.tensor(rows, dtype=torch.float32, device=DEVICE)
    launcher(buf.data, buf.grad, *buf.states.values(), hparams=hparams, meta=buf.meta, block_size=128)
    return {"param": buf.data, **buf.states}, [buf.index[p] for p in params]


COLUMNS = [(opt, column) for opt, rule in RULES.items() for column in rule.columns]


@TRITON_SKIP
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("uniform", [False, True], ids=["two-groups", "uniform"])
@pytest.mark.parametrize("opt, column", COLUMNS, ids=[f"{o}-{c}" for o, c in COLUMNS])
def test_kernel_and_reference_read_each_column_where_the_rule_puts_it(opt, column, uniform):
    rule = RULES[opt]
    row = rule.row(GROUPS[opt])
    other = list(row)
    other[rule.columns.index(column)] = changed(column, row[rule.columns.index(column)])
    # two groups: only group 1's row changes; uniform: the one group's row changes
    tables = {"same": [row] if uniform else [row, row], "changed": [other] if uniform else [row, other]}
    out = {}
    for backend, module in (("triton", kernels), ("torch", reference)):
        for table, rows in tables.items():
            out[backend, table], spans = step_once(opt, getattr(module, f"{opt}_step"), rows, uniform)
    for table in tables:
        for name, t in out["triton", table].items():
            torch.testing.assert_close(
                t, out["torch", table][name], **TOL[torch.float32], msg=lambda m: f"{table} row, {name}: {m}"
            )
    (s0, e0), (s1, e1) = spans
    for backend in ("triton", "torch"):
        same, diff = out[backend, "same"], out[backend, "changed"]
        if not uniform:
            for name in same:
                assert torch.equal(same[name][s0:e0], diff[name][s0:e0]), f"{backend}: group 0's {name} changed"
        moved = [name for name in same if not torch.equal(same[name][s1:e1], diff[name][s1:e1])]
        if column in UNREAD[opt]:
            assert not moved, f"{backend}: {opt} does not read {column}, yet changing it changed {moved}"
        else:
            assert moved, f"{backend}: {opt} reads {column}, yet changing it changed nothing"


@pytest.mark.parametrize("opt", list(RULES))
def test_row_fills_every_column_by_name(opt):
    rule = RULES[opt]
    group = GROUPS[opt]
    assert set(rule.values(group)) == set(rule.columns)
    row = rule.row(group)
    assert len(row) == rule.num_hparams == len(rule.columns)
    assert all(type(v) is float for v in row)
    assert rule.lr_column == 0, "FlatOptimizer copies a tensor lr into column 0"
    assert row[rule.lr_column] == group["lr"]
    tensor_lr = rule.row({**group, "lr": torch.tensor(0.5)})
    assert tensor_lr[rule.lr_column] == 0.0, "a tensor lr is a 0.0 placeholder (copied in on the device)"
    assert tensor_lr[1:] == row[1:]
    assert rule.named(row) == dict(zip(rule.columns, row))


def test_row_values():
    """Every column's value, by name, as each update reads it."""
    adamw = ADAMW.named(ADAMW.row(dict(lr=0.01, betas=(0.0, 0.5), eps=1e-3, weight_decay=0.1, maximize=True)))
    assert adamw == dict(
        lr=0.01, beta1=0.0, one_minus_beta1=1.0, beta2=0.5, one_minus_beta2=0.5, log_beta1=-math.inf,
        log_beta2=math.log(0.5), eps=1e-3, weight_decay=0.1, grad_sign=-1.0,
    )  # fmt: skip
    sgd = SGD.named(SGD.row(dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.05, nesterov=True,
                                 maximize=False)))  # fmt: skip
    assert sgd == dict(lr=0.1, momentum=0.9, one_minus_dampening=0.75, weight_decay=0.05, nesterov=1.0, grad_sign=1.0)
    lion = LION.named(LION.row(dict(lr=0.02, betas=(0.75, 0.5), weight_decay=0.1)))
    assert lion == dict(lr=0.02, beta1=0.75, one_minus_beta1=0.25, beta2=0.5, one_minus_beta2=0.5, weight_decay=0.1)


BAD_GROUPS = [
    ("adamw", dict(lr=torch.tensor([1e-3, 1e-3])), "Tensor lr must be 1-element"),
    ("adamw", dict(lr=-1e-3), "Invalid learning rate: -0.001"),
    ("adamw", dict(lr=float("nan")), "Invalid learning rate: nan"),
    ("adamw", dict(eps=-1e-8), "Invalid epsilon value: -1e-08"),
    ("adamw", dict(betas=(0.9,)), r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    ("adamw", dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    ("adamw", dict(betas=(0.9, -0.5)), "Invalid beta parameter at index 1: -0.5"),
    ("adamw", dict(weight_decay=-0.01), "Invalid weight_decay value: -0.01"),
    ("adamw", dict(amsgrad=True), r"does not implement amsgrad; use torch.optim.AdamW\(amsgrad=True\)"),
    ("adamw", dict(lr=-1.0, eps=-1.0), "Invalid learning rate"),  # checked in torch's order
    ("sgd", dict(lr=torch.tensor([0.1, 0.1])), "Tensor lr must be 1-element"),
    ("sgd", dict(lr=-0.1), "Invalid learning rate: -0.1"),
    ("sgd", dict(momentum=-0.9), "Invalid momentum value: -0.9"),
    ("sgd", dict(weight_decay=-1e-4), "Invalid weight_decay value: -0.0001"),
    ("sgd", dict(nesterov=True, momentum=0.0), "Nesterov momentum requires a momentum and zero dampening"),
    ("sgd", dict(nesterov=True, dampening=0.1), "Nesterov momentum requires a momentum and zero dampening"),
    ("lion", dict(lr=-1e-4), "Invalid learning rate: -0.0001"),
    ("lion", dict(betas=(1.5, 0.99)), "Invalid beta parameter at index 0: 1.5"),
    ("lion", dict(betas=(0.9, -0.01)), "Invalid beta parameter at index 1: -0.01"),
    ("lion", dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
]


@pytest.mark.parametrize("opt, change, message", BAD_GROUPS, ids=[f"{o}-{m[:30]}" for o, _, m in BAD_GROUPS])
def test_check_refuses_in_torchs_words(opt, change, message):
    group = {**GROUPS[opt], **change}
    with pytest.raises(ValueError, match=message):
        RULES[opt].check(group)
    with pytest.raises(ValueError, match=message):  # the class's check is the rule's
        CLASSES[opt].rule.check(group)


@pytest.mark.parametrize(
    "opt, change",
    [
        ("adamw", {}), ("adamw", dict(betas=(0.0, 0.0), lr=torch.tensor(0.1))), ("sgd", {}),
        ("sgd", dict(lr=float("nan"), momentum=float("nan"))),  # torch.optim.SGD compares with < 0.0: NaN passes
        ("sgd", dict(nesterov=True, dampening=0.0)), ("lion", {}), ("lion", dict(betas=(1.0, 1.0))),
    ],
)  # fmt: skip
def test_check_accepts_what_torch_accepts(opt, change):
    RULES[opt].check({**GROUPS[opt], **change})


def test_uses_state():
    assert SGD.uses_state("momentum_buffer", {**GROUPS["sgd"], "momentum": 0.9})
    assert not SGD.uses_state("momentum_buffer", {**GROUPS["sgd"], "momentum": 0})
    assert not SGD.uses_state("momentum_buffer", {**GROUPS["sgd"], "momentum": 0.0})
    for rule in (ADAMW, LION):
        assert all(rule.uses_state(n, {}) for n in rule.state_names)
    assert ADAMW.state_names == ("exp_avg", "exp_avg_sq") and ADAMW.exported_step
    assert SGD.state_names == ("momentum_buffer",) and not SGD.exported_step
    assert LION.state_names == ("exp_avg",) and not LION.exported_step


@pytest.mark.parametrize("opt", list(RULES))
def test_optimizer_classes_step_by_their_rule(opt):
    cls, rule = CLASSES[opt], RULES[opt]
    assert cls.rule is rule and rule.name == cls.__name__
    assert rule.functional is getattr(functional, opt)
    model = torch.nn.Linear(3, 2)
    o = cls(model.parameters(), **({**GROUPS[opt], "momentum": 0.0} if opt == "sgd" else GROUPS[opt]))
    model(torch.randn(4, 3)).sum().backward()
    o.step()
    expected = torch.tensor(rule.row(o.param_groups[0]), dtype=torch.float32)
    assert torch.equal(flatopt.inspect(o).tables[torch.device("cpu")][0], expected)
    assert set(flatopt.inspect(o).buffers[0].states) == {n for n in rule.state_names if opt != "sgd"}


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=TRITON_SKIP)])
@pytest.mark.parametrize(
    "shape, dtype, what",
    [((1, 9), torch.float32, r"got torch.float32 of shape \(1, 9\)"), ((10,), torch.float32, r"shape \(10,\)"),
     ((1, 10), torch.float64, r"got torch.float64 of shape \(1, 10\)")],
)  # fmt: skip
def test_a_table_of_another_shape_is_refused_before_anything_changes(backend, shape, dtype, what):
    params = [torch.randn(s, device=DEVICE) for s in SHAPES]
    buf = FlatBuffer(params, [0, 0], ADAMW.state_names)
    buf.grad.copy_(torch.randn(buf.numel))
    before = [t.clone() for t in (buf.data, buf.grad, *buf.states.values(), buf.meta.steps)]
    launcher = {"triton": kernels, "cpu": cpu, "torch": reference}[backend].adamw_step
    expected = r"AdamW's hyper-parameter table is float32 \[groups, 10\] \(columns lr, beta1, "
    with pytest.raises(ValueError, match=expected) as e:
        launcher(buf.data, buf.grad, *buf.states.values(), hparams=torch.zeros(shape, dtype=dtype), meta=buf.meta)
    assert re.search(what, str(e.value)), str(e.value)
    for old, new in zip(before, (buf.data, buf.grad, *buf.states.values(), buf.meta.steps)):
        assert torch.equal(old, new)


def test_a_rule_names_each_column_once_and_has_an_lr():
    kw = dict(key="x", values=dict, check=lambda g: None, math=lambda *a, **k: a, state_names=())
    with pytest.raises(ValueError, match="columns must be distinct and include 'lr'"):
        Rule(name="X", columns=("lr", "eps", "lr"), **kw)
    with pytest.raises(ValueError, match="columns must be distinct and include 'lr'"):
        Rule(name="X", columns=("eps",), **kw)
