"""state_dict() and load_state_dict() with fewer bytes per parameter (flatopt.precision): a flatopt checkpoint
resumes exactly (masters, remainders and stochastic rounding's stream included), loads into torch.optim and
back, and loading never changes the dtype the states are kept in."""

import copy
import io

import pytest
import torch
from conftest import TRITON_SKIP
from test_precision import buffers, grads, groups, model

import flatopt
from flatopt.precision import join_master

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*received no gradient.*:UserWarning"),
    # 8-bit states: the interpreter evaluates both sides of tl.where(absmax > 0, |x| / absmax, 0), 0 / 0 included
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
]

BACKENDS = ["torch", pytest.param("triton", marks=TRITON_SKIP)]
MODES = [
    dict(master_weights="remainder", state_dtype=torch.float32),
    dict(master_weights="fp32"),
    dict(stochastic_rounding=True, state_dtype=torch.bfloat16),
    dict(stochastic_rounding=True),
    dict(state_dtype=torch.float32),
    dict(stochastic_rounding=True, state_dtype="int8"),
    dict(master_weights="remainder", state_dtype="int8"),
]
OPTIMIZERS = {
    "adamw": (flatopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (flatopt.SGD, dict(lr=0.1, momentum=0.9)),
    "lion": (flatopt.Lion, dict(lr=1e-2, weight_decay=0.1)),
}


def run(net, opt, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(net.parameters(), grads(net, step)):
            p.grad = g
        opt.step()


def saved(obj):
    """``obj`` through torch.save and torch.load (weights_only, torch's default)."""
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f)


def snapshot(opt):
    """Every buffer's parameters, step counts, states and master, by name."""
    out = {}
    for b, buf in enumerate(flatopt.inspect(opt).buffers):
        out.update({(b, "data"): buf.data.clone(), (b, "steps"): buf.meta.steps.clone()})
        out.update({(b, k): t.clone() for k, t in buf.states.items()})
        if buf.master is not None:
            out[(b, "master")] = buf.master.clone()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_flatopt_checkpoint_resumes_exactly(name, mode, backend):
    cls, hp = OPTIMIZERS[name]
    net = model()
    torch.manual_seed(1)
    straight = cls(groups(net), **hp, **mode, backend=backend)
    run(net, straight, 6)

    first = model()
    torch.manual_seed(1)
    opt = cls(groups(first), **hp, **mode, backend=backend)
    run(first, opt, 3)
    model_sd, opt_sd = saved(first.state_dict()), saved(opt.state_dict())

    resumed = model(seed=7)  # other values, and another seed for stochastic rounding: both come from the checkpoint
    torch.manual_seed(2)
    again = cls(groups(resumed), **hp, **mode, backend=backend)
    resumed.load_state_dict(model_sd)
    again.load_state_dict(opt_sd)
    run(resumed, again, 3, first=3)
    want, got = snapshot(straight), snapshot(again)
    assert want.keys() == got.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_loads_into_torch_optim_and_back_keeping_the_states_dtype(backend):
    net = model()
    opt = flatopt.AdamW(groups(net), lr=1e-2, master_weights="remainder", state_dtype=torch.float32, backend=backend)
    run(net, opt, 3)
    sd = saved(opt.state_dict())
    assert "flatopt" in sd and {t.dtype for e in sd["state"].values() for k, t in e.items() if k != "step"} == {
        torch.float32
    }

    twin = copy.deepcopy(net)
    theirs = torch.optim.AdamW(groups(twin), lr=1e-2)
    theirs.load_state_dict(sd)  # the "flatopt" entry is ignored; torch casts the states to bfloat16
    for i, (p, q) in enumerate(zip(net.parameters(), twin.parameters())):
        assert theirs.state[q]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(theirs.state[q]["exp_avg"].float(), opt.state[p]["exp_avg"], atol=0, rtol=2**-8)
        assert float(theirs.state[q]["step"]) == (2.0 if i == 5 else 3.0)  # the last parameter missed one step
    run(twin, theirs, 1, first=3)

    back = flatopt.AdamW(groups(twin), lr=1e-2, master_weights="remainder", state_dtype=torch.float32, backend=backend)
    back.load_state_dict(theirs.state_dict())
    buf = buffers(back)
    assert {t.dtype for t in buf.states.values()} == {torch.float32}  # kept, whatever the checkpoint's dtype
    for p in twin.parameters():
        assert torch.equal(back.state[p]["exp_avg_sq"], theirs.state[p]["exp_avg_sq"].float())
    # no master in torch's checkpoint: each starts again from its parameter
    assert torch.equal(join_master(buf.data, buf.master), buf.data.float())


def test_the_default_state_dict_is_torch_optim_s_format_only():
    assert set(flatopt.AdamW(model()).state_dict()) == {"state", "param_groups"}


@pytest.mark.parametrize("model_first", [True, False], ids=["model-loaded-first", "optimizer-loaded-first"])
@pytest.mark.parametrize("saved_mode, mode", [("fp32", "remainder"), ("remainder", "fp32")])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_masters_saved_under_the_other_mode_are_converted(name, saved_mode, mode, model_first):
    """A float32 master and a parameter with its remainder are the same value in two forms (both modes round the
    master to the parameter to nearest, ties away from zero): a checkpoint of one mode resumes in the other bit for
    bit, as if it had run in that mode from the start. A float32 master from a remainder is joined with the
    parameter as it is when the optimizer loads: exact when the model was loaded first; loaded before the model,
    the parameter takes over at the next step, as after any write (the remainder's low bits are lost)."""
    cls, hp = OPTIMIZERS[name]
    net = model()
    straight = cls(groups(net), **hp, master_weights=mode, state_dtype=torch.float32)
    run(net, straight, 6)

    first = model()
    opt = cls(groups(first), **hp, master_weights=saved_mode, state_dtype=torch.float32)
    run(first, opt, 3)
    model_sd, opt_sd = saved(first.state_dict()), saved(opt.state_dict())

    resumed = model(seed=7)
    again = cls(groups(resumed), **hp, master_weights=mode, state_dtype=torch.float32)
    if model_first:
        resumed.load_state_dict(model_sd)
    again.load_state_dict(opt_sd)
    if not model_first:
        resumed.load_state_dict(model_sd)
    run(resumed, again, 3, first=3)
    want, got = snapshot(straight), snapshot(again)
    assert want.keys() == got.keys()
    exact = model_first or mode == "remainder"  # a remainder does not depend on the parameter it is loaded beside
    same = [key for key in want if got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])]
    if exact:
        assert same == list(want), sorted(set(want) - set(same), key=str)
    else:
        assert any(key[1] in ("data", "master") for key in set(want) - set(same)), "the low bits were not lost"


def test_a_master_converted_between_the_modes_keeps_ties_away_from_zero():
    """Masters exactly halfway between two bfloat16 values (low 16 bits 0x8000), of both signs: the float32 mode's
    parameter is the master rounded away from zero, and the remainder converted from the master joins with that
    parameter into the master bit for bit; the master converted from parameter and remainder is the master."""
    from flatopt.checkpoint import _convert_master
    from flatopt.precision import nearest

    bits = torch.tensor([0x3F808000, 0x3F818000, 0x40008000, 0x00018000], dtype=torch.int64)
    x = torch.cat([bits, bits | (1 << 31)]).to(torch.int32).view(torch.float32)  # both signs
    p = nearest(x, torch.bfloat16)
    assert torch.equal(p.float().abs(), (x.abs().view(torch.int32) + 0x8000 & -65536).view(torch.float32))
    rem = _convert_master(x, p)
    assert rem.dtype == torch.int16 and torch.equal(join_master(p, rem), x)
    assert torch.equal(_convert_master(rem, p), x)


def test_a_master_saved_under_the_other_mode_is_checked_before_anything_changes():
    net = model()
    opt = flatopt.AdamW(net, lr=1e-2, master_weights="fp32")
    run(net, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    last = max(sd["flatopt"]["master"])  # the last one checked: every other master was taken before it
    sd["flatopt"]["master"][last] = sd["flatopt"]["master"][last].to(torch.int16)
    other = flatopt.AdamW(copy.deepcopy(net), lr=1e-2, master_weights="remainder")
    before = snapshot(other)
    message = rf"parameter {last} .*torch.int16 .*master_weights='fp32' keeps torch.float32"
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(sd)
    after = snapshot(other)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(rounding_seed=-1), r"rounding_seed -1"),
        (lambda c: c["master"].update({0: torch.zeros(3)}), r"parameter 0 .*float32 of shape \(3,\); master_weights"),
        (lambda c: c["master"].update({99: torch.zeros(3)}), r"master copy for parameter 99"),
        (lambda c: c["master"].update({0: c["master"][0].to("meta")}), r"master copy for parameter 0 .*meta device"),
        (lambda c: c.update(precision="fp32"), r"'precision' entry of type str"),
    ],
)
def test_a_bad_flatopt_entry_is_refused_before_anything_changes(edit, match):
    net = model()
    opt = flatopt.AdamW(net, lr=1e-2, master_weights="fp32")
    run(net, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    edit(sd["flatopt"])
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = snapshot(opt)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("mode", [m for m in MODES if m.get("state_dtype") == "int8"], ids=lambda m: str(m))
def test_a_checkpoint_loads_right_after_a_state_reset(mode):
    """opt.state.clear() (a reset, honoured at the next step), then load_state_dict() of a checkpoint of the same run:
    the load reads opt.state as the reset left it (no 8-bit codes yet) and the run resumes exactly."""
    cls, hp = OPTIMIZERS["adamw"]
    net = model()
    torch.manual_seed(1)
    opt = cls(groups(net), **hp, **mode, backend="torch")
    run(net, opt, 3)
    sd, want = saved(opt.state_dict()), snapshot(opt)
    opt.state.clear()
    opt.load_state_dict(sd)
    got = snapshot(opt)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def int8_checkpoint():
    """An AdamW with 8-bit states after 3 steps, its state dict through torch.save, and the index of the parameter
    whose states are 8-bit."""
    net = model()
    opt = flatopt.AdamW(groups(net), lr=1e-2, state_dtype="int8", backend="torch")
    run(net, opt, 3)
    sd = saved(opt.state_dict())
    (k,) = sd["flatopt"]["codes"]
    return net, opt, sd, k


def test_8bit_codes_on_the_meta_device_are_refused_before_anything_changes():
    net, opt, sd, k = int8_checkpoint()
    sd["flatopt"]["codes"][k]["exp_avg"] = sd["flatopt"]["codes"][k]["exp_avg"].to("meta")
    sd["param_groups"][0]["lr"] = 0.5
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"8-bit 'exp_avg' for parameter .*meta device"):
        opt.load_state_dict(sd)
    after = snapshot(opt)
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_edited_values_of_8bit_states_win_over_the_saved_codes():
    """torch.optim users edit sd["state"] (zero a moment, drop a parameter's entry to restart it): the codes saved
    beside it no longer read back as those values, and the values are what loads."""
    net, opt, sd, k = int8_checkpoint()
    sd["state"][k]["exp_avg"] = torch.zeros_like(sd["state"][k]["exp_avg"])
    opt.load_state_dict(sd)
    assert not opt.state_dict()["state"][k]["exp_avg"].any()
    p = [q for g in opt.param_groups for q in g["params"]][k]
    for name in ("exp_avg_sq", "exp_avg_sq_absmax"):  # not edited: its exact codes and scales
        assert torch.equal(opt.state[p][name], sd["flatopt"]["codes"][k][name]), name

    net, opt, sd, k = int8_checkpoint()
    del sd["state"][k]  # this parameter starts again, as torch.optim starts it
    opt.load_state_dict(sd)
    p = {i: q for i, q in enumerate(q for g in opt.param_groups for q in g["params"])}[k]
    assert "step" not in opt.state_dict()["state"].get(k, {})
    g = torch.full_like(p, 0.5)
    for q in net.parameters():
        q.grad = torch.zeros_like(q)
    p.grad = g
    opt.step()
    m = opt.state_dict()["state"][k]["exp_avg"]
    torch.testing.assert_close(m, torch.full_like(m, 0.05), rtol=0.02, atol=0)  # (1 - beta1) * g, not old moments


def _same(a, b, path="state_dict"):
    """``a`` and ``b`` (nested dicts, lists, tensors) equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("save_while_frozen", [False, True], ids=["load", "load-save-load"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_a_checkpoint_loaded_while_a_parameter_is_frozen_resumes_exactly_once_it_is_unfrozen(mode, save_while_frozen):
    """Progressive unfreezing after a resume: a parameter frozen when the checkpoint is loaded (not laid out) keeps
    its master copy or remainder, its states in the dtype they are kept in (float32 values for 8-bit states) and,
    through a save and a load while still frozen, all of it; once unfrozen it trains exactly as when it was
    trainable at the load."""
    cls, hp = flatopt.AdamW, dict(lr=1e-2, weight_decay=0.1)
    net = model()
    torch.manual_seed(1)
    trained = cls(net, **hp, **mode)
    run(net, trained, 3)
    sd, weights = saved(trained.state_dict()), copy.deepcopy(net.state_dict())
    results = []
    for frozen in (False, True):
        net2 = model()
        net2.load_state_dict(weights)
        net2[3].requires_grad_(not frozen)  # the 70 x 70 layer: 8-bit states under state_dtype="int8"
        opt = cls(net2, **hp, **mode)
        opt.load_state_dict(copy.deepcopy(sd))
        if frozen and save_while_frozen:
            again = saved(opt.state_dict())
            del opt
            opt = cls(net2, **hp, **mode)
            opt.load_state_dict(again)
        net2[3].requires_grad_(True)
        run(net2, opt, 2, first=3)
        results.append((list(net2.parameters()), opt.state_dict()))
    (ps, a), (qs, b) = results
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    _same(a, b)
