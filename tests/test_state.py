"""``opt.state`` behaves as torch.optim's: edits that reset or replace a state are honoured at the next step
(or refused, before anything changes, with an error naming the parameter and the key), state_dict()
exports what the next step uses, load_state_dict() checks every tensor before it changes anything, and
keys that are no parameter's (a state-dict hook's ``opt.state["test"]``) are kept, as torch.optim keeps
them; so are the keys a caller puts in a parameter's entry (``opt.state[p]["note"]``), through state_dict() and
load_state_dict() (cast as torch.optim casts them). Compared with torch.optim.AdamW and SGD (and Lion with the
paper's reference, a torch.optim.Optimizer) over several steps."""

import copy
import re
from collections import defaultdict

import pytest
import torch
from conftest import LionReference, assert_same, device_for
from torch import nn

import flatopt

SHAPES = [(5, 3), (7,), (2, 3, 4), (5, 3)]  # two of one shape, for states swapped between parameters

ENGINES = {
    "step": dict(),
    "in_backward": dict(in_backward=True),
    "per_param": dict(flat=False),
}

OPTIMIZERS = {
    "adamw": (
        lambda ps, **k: flatopt.AdamW(ps, lr=0.05, weight_decay=0.1, **k),
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    ),
    "sgd": (
        lambda ps, **k: flatopt.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, **k),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    ),
}

WITH_LION = {  # the tests of the caller's keys also run Lion, against the paper's (a torch.optim.Optimizer)
    **OPTIMIZERS,
    "lion": (
        lambda ps, **k: flatopt.Lion(ps, lr=0.01, weight_decay=0.1, **k),
        lambda ps: LionReference(ps, lr=0.01, weight_decay=0.1),
    ),
}


class Pair:
    """One set of parameters stepped by flatopt and a copy stepped by torch.optim, from the same gradients."""

    def __init__(self, opt_name="adamw", engine="step", backend="torch", device=None):
        torch.manual_seed(0)
        self.device = device or device_for(backend)
        self.ours = [nn.Parameter(torch.randn(s).to(self.device)) for s in SHAPES]
        self.theirs = [nn.Parameter(p.detach().clone()) for p in self.ours]
        make_ours, make_theirs = WITH_LION[opt_name]
        self.opt = make_ours(self.ours, backend=backend, **ENGINES[engine])
        self.ref = make_theirs(self.theirs)
        self.steps = 0

    @staticmethod
    def backward(params, step):
        gen = torch.Generator().manual_seed(100 + step)
        loss = sum(((p * torch.randn(p.shape, generator=gen).to(p.device)).sum() + (p * p).sum()) for p in params)
        loss.backward()

    def step(self, ours=True, theirs=True):
        """One training step (a backward pass steps in-backward mode's parameters, then ``opt.step()``)."""
        self.steps += 1
        for params, opt, do in ((self.ours, self.opt, ours), (self.theirs, self.ref, theirs)):
            if do:
                self.backward(params, self.steps)
                opt.step()
                opt.zero_grad()

    def compare(self, what):
        for i, (p, q) in enumerate(zip(self.ours, self.theirs, strict=True)):
            assert_same(p.detach(), q.detach(), self.steps, f"{what}: params[{i}]")
            for key, value in self.ref.state.get(q, {}).items():
                if key not in own_keys_of(self.ref):
                    continue  # a key of the caller's: see assert_extras_as_torch
                mine = self.opt.state[p][key]
                if key == "step":
                    assert float(mine) == float(value), f"step {self.steps}, {what}: params[{i}] step {float(mine)}"
                else:
                    assert_same(mine, value, self.steps, f"{what}: params[{i}].{key}")

    def run(self, n, what):
        for _ in range(n):
            self.step()
            self.compare(what)

    def both(self, edit):
        """Apply ``edit(opt, params)`` to flatopt and to torch.optim."""
        edit(self.opt, self.ours)
        edit(self.ref, self.theirs)


def set_state(opt, new):
    opt.state = new


RESETS = {
    "clear": lambda opt, ps: opt.state.clear(),
    "assign_empty": lambda opt, ps: opt.state.__setitem__(ps[1], {}),
    "del": lambda opt, ps: opt.state.__delitem__(ps[2]),
    "pop": lambda opt, ps: opt.state.pop(ps[0]),
    "param_dict_clear": lambda opt, ps: opt.state[ps[3]].clear(),
    "replace": lambda opt, ps: set_state(opt, defaultdict(dict)),
    "replace_keeping_one": lambda opt, ps: set_state(opt, defaultdict(dict, {ps[1]: opt.state[ps[1]]})),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("reset", list(RESETS))
def test_reset_state_restarts_as_torch(reset, engine, opt_name):
    """A state emptied starts again as at its first step (step 0, zero moments; SGD takes its momentum buffer
    from the next gradient), in every engine, as torch.optim's lazy initialisation does."""
    pair = Pair(opt_name, engine)
    pair.run(3, "before the reset")
    pair.both(RESETS[reset])
    pair.run(3, f"after {reset}")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_reset_with_the_triton_kernels(engine, backend):
    """The kernels read the step counts of a buffer whose parameters now differ in steps."""
    pair = Pair("adamw", engine, backend)
    pair.run(2, "before the reset")
    pair.both(RESETS["assign_empty"])
    pair.run(2, "after resetting one parameter")
    pair.both(RESETS["clear"])
    pair.run(2, "after clear()")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_assigned_tensors_and_step_are_used(engine):
    """A tensor assigned to a state, and a step count assigned, are what the next step uses (copied into the
    flat buffer; the entry holds the buffer's view again after the step)."""
    pair = Pair("adamw", engine)
    pair.run(3, "before")
    gen = torch.Generator().manual_seed(7)
    m = torch.randn(SHAPES[0], generator=gen)
    v = torch.rand(SHAPES[2], generator=gen)

    def edit(opt, ps):
        opt.state[ps[0]]["exp_avg"] = m.clone()
        opt.state[ps[2]]["exp_avg_sq"] = v.clone()
        opt.state[ps[1]]["step"] = torch.tensor(1.0)

    pair.both(edit)
    given = pair.opt.state[pair.ours[0]]["exp_avg"]
    pair.run(3, "after assigning")
    if engine != "per_param":  # the flat engines copied it into their buffer
        assert pair.opt.state[pair.ours[0]]["exp_avg"] is not given
        torch.testing.assert_close(given, m, atol=0, rtol=0)


@pytest.mark.parametrize("which", [0, 1], ids=["first-parameter", "second-parameter"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_step_count_written_in_place_is_used(engine, backend, which):
    """opt.state[p]["step"] written in place (fill_) is what the next step uses for that parameter, as in
    torch.optim, though the buffer's other parameters' counts stay as they were: the step counts of one buffer
    differ from then on."""
    pair = Pair("adamw", engine, backend)
    pair.run(2, "before")
    pair.both(lambda opt, ps: opt.state[ps[which]]["step"].fill_(7.0))
    pair.run(3, "after writing a step count in place")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_step_count_of_zero_assigned_keeps_the_entry_in_the_state_dict(engine):
    """opt.state[p]["step"] = 0 keeps the moments (torch.optim's bias correction starts again from them): the state
    dict exports that entry as torch.optim does, step 0 and moments, so a run resumed from it goes on as the live
    one (a parameter never stepped, all zeros, has no entry, as in torch.optim)."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    pair.both(lambda opt, ps: opt.state[ps[1]].__setitem__("step", torch.tensor(0.0)))
    ours, theirs = pair.opt.state_dict()["state"], pair.ref.state_dict()["state"]
    assert sorted(ours) == sorted(theirs) == [0, 1, 2, 3]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[1][key].float(), theirs[1][key].float(), atol=1e-6, rtol=1e-5)
    pair.run(2, "after assigning step 0")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_sgd_momentum_buffer_assigned(engine):
    """SGD uses a momentum buffer assigned, also one given before the first step (torch.optim keeps no state
    then), instead of taking it from the gradient."""
    pair = Pair("sgd", engine)
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(SHAPES[1], generator=gen)
    pair.both(lambda opt, ps: opt.state[ps[1]].__setitem__("momentum_buffer", buf.clone()))
    pair.run(2, "momentum buffer given before the first step")
    buf2 = torch.randn(SHAPES[0], generator=gen)
    pair.both(lambda opt, ps: opt.state[ps[0]].__setitem__("momentum_buffer", buf2.clone()))
    pair.run(2, "momentum buffer given later")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_states_swapped_between_parameters(engine):
    """Two parameters of one shape swap their states: both read before either is written."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")

    def swap(opt, ps):
        a, b = opt.state[ps[0]], opt.state[ps[3]]
        a["exp_avg"], b["exp_avg"] = b["exp_avg"], a["exp_avg"]

    pair.both(swap)
    pair.run(2, "after swapping exp_avg")


def test_non_parameter_keys_and_reads_change_nothing():
    """Reading ``opt.state``, writing a state in place, and keys that are no parameter's leave the steps as
    torch.optim's."""
    pair = Pair("adamw")
    pair.run(2, "before")

    def edit(opt, ps):
        opt.state["note"] = 1
        opt.state[ps[0]]["exp_avg"].mul_(0.5)
        opt.state[ps[1]]["step"] += 0  # in place on the step tensor, then set again (the same tensor)
        _ = [opt.state[p] for p in ps]

    pair.both(edit)
    pair.run(2, "after the edits")
    assert pair.opt.state["note"] == 1


# ---------------------------------------------------------------------------------------------- refusals


BAD_EDITS = {  # key, the tensor assigned, what the message says of it
    "wrong_shape": ("exp_avg", lambda: torch.zeros(4, 3), r"is a tensor of shape \(4, 3\)"),
    "wrong_dtype": (
        "exp_avg",
        lambda: torch.zeros(5, 3, dtype=torch.float64),
        r"is a tensor of shape \(5, 3\) and dtype torch\.float64",
    ),
    "meta": ("exp_avg_sq", lambda: torch.zeros(5, 3, device="meta"), r"is a tensor on the meta device"),
    "sparse": ("exp_avg", lambda: torch.zeros(5, 3).to_sparse(), r"is a torch\.sparse_coo tensor"),
    "not_a_tensor": ("exp_avg", lambda: [0.0] * 15, r"is a list; it must be a tensor"),
    "step_of_two": ("step", lambda: torch.zeros(2), r"is a tensor of shape \(2,\); it must be"),
    "negative_step": ("step", lambda: torch.tensor(-1.0), r"is -1\.0; a step count must be finite and >= 0"),
}


NAME3 = re.escape("params[3] of param group 0 (shape (5, 3))")  # how messages name ours[3]


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("case", list(BAD_EDITS))
def test_edit_that_cannot_be_honoured_is_refused_before_anything_changes(case, engine):
    key, make, pattern = BAD_EDITS[case]
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    p = pair.ours[3]
    pair.opt.state[pair.ours[0]] = {}  # a valid edit too: it waits with the bad one
    pair.opt.state[p][key] = make()
    params = [q.detach().clone() for q in pair.ours]
    bufs = [(b.data.clone(), {n: t.clone() for n, t in b.states.items()}, b.meta.steps.clone())
            for b in flatopt.inspect(pair.opt).buffers]  # fmt: skip
    where = rf"opt\.state\[{NAME3}\]\['{key}'\]"
    with pytest.raises(ValueError, match=f"{where} {pattern}"):
        pair.step(theirs=False)
    for i, (q, old) in enumerate(zip(pair.ours, params, strict=True)):
        torch.testing.assert_close(q.detach(), old, atol=0, rtol=0, msg=lambda m: f"params[{i}] changed: {m}")
    for b, (data, states, steps) in zip(flatopt.inspect(pair.opt).buffers, bufs, strict=True):
        torch.testing.assert_close(b.data, data, atol=0, rtol=0)
        torch.testing.assert_close(b.meta.steps, steps, atol=0, rtol=0)
        for n, t in states.items():
            torch.testing.assert_close(b.states[n], t, atol=0, rtol=0)
    if engine != "per_param":  # flat=False exports opt.state's own tensors, as torch.optim does
        with pytest.raises(ValueError, match=pattern):
            pair.opt.state_dict()  # not an export of a state that the buffers do not hold


@pytest.mark.parametrize("engine", list(ENGINES))
def test_incomplete_state_is_refused_naming_what_is_missing(engine):
    """torch.optim fails with a KeyError on a state that lacks one of its keys; flatopt says which."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    del pair.opt.state[pair.ours[3]]["exp_avg"]
    params = [q.detach().clone() for q in pair.ours]
    msg = rf"opt\.state\[{NAME3}\] has \['exp_avg_sq', 'step'\] but not \['exp_avg'\]"
    with pytest.raises(ValueError, match=msg):
        pair.step(theirs=False)
    for q, old in zip(pair.ours, params, strict=True):
        torch.testing.assert_close(q.detach(), old, atol=0, rtol=0)
    pair.opt.state[pair.ours[3]].clear()  # restarting it is accepted
    pair.step(theirs=False)


def test_opt_state_that_is_not_a_dict_is_refused():
    pair = Pair("adamw")
    pair.run(1, "before")
    pair.opt.state = [1, 2]
    with pytest.raises(TypeError, match=r"opt\.state is a list; it must be a dict of per-parameter dicts"):
        pair.step(theirs=False)


# ---------------------------------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("reset", ["clear", "assign_empty", "replace"])
def test_state_dict_after_a_reset_is_what_the_next_step_uses(reset, engine):
    """Exported before the next step: no entry with a step count but no moments; it loads into torch.optim
    and into flatopt, and training goes on as torch.optim's."""
    pair = Pair("adamw", engine)
    pair.run(3, "before")
    pair.both(RESETS[reset])
    ours, theirs = pair.opt.state_dict(), pair.ref.state_dict()
    for k, entry in ours["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, f"state {k}: {sorted(entry)}"
    assert {k for k, e in theirs["state"].items() if e} == set(ours["state"])
    pair.opt.load_state_dict(copy.deepcopy(theirs))  # torch's own export (with its empty entries) loads too
    pair.ref.load_state_dict(copy.deepcopy(ours))
    pair.run(3, "after a state_dict round trip")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("engine", ["step", "in_backward"])
def test_on_the_gpu_a_state_on_another_device_is_refused_and_a_cpu_checkpoint_loads(engine):
    pair = Pair("adamw", engine, backend=None, device="cuda")  # the Triton kernels, compiled
    pair.run(2, "before")
    pair.opt.state[pair.ours[3]]["exp_avg"] = torch.zeros(SHAPES[3])  # on the CPU
    with pytest.raises(ValueError, match=rf"opt\.state\[{NAME3}\]\['exp_avg'\] is on cpu, the parameter on cuda"):
        pair.step(theirs=False)
    pair.opt.zero_grad()  # the refused step's gradients
    pair.opt.state[pair.ours[3]]["exp_avg"] = torch.zeros(SHAPES[3], device="cuda")
    pair.ref.state[pair.theirs[3]]["exp_avg"] = torch.zeros(SHAPES[3], device="cuda")
    pair.steps -= 1  # the refused step used this step's gradients for ours only
    pair.run(2, "after the fix")
    sd = {"state": {k: {n: t.cpu() for n, t in e.items()} for k, e in pair.ref.state_dict()["state"].items()}}
    sd["param_groups"] = copy.deepcopy(pair.ref.state_dict()["param_groups"])
    pair.opt.load_state_dict(copy.deepcopy(sd))
    pair.ref.load_state_dict(sd)
    pair.run(2, "after loading a CPU checkpoint")


# ---------------------------------------------------------------------------------------------- load_state_dict


def snapshot(params, opt):
    """Parameters, the state_dict's tensors and step counts, and the param groups, as values."""
    sd = opt.state_dict()
    state = {
        k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in entry.items()}
        for k, entry in sd["state"].items()
        if isinstance(entry, dict)
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [p.detach().clone() for p in params], state, copy.deepcopy(groups)


def assert_unchanged(before, after):
    (params0, state0, groups0), (params1, state1, groups1) = before, after
    for i, (a, b) in enumerate(zip(params0, params1, strict=True)):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=lambda m: f"params[{i}] changed: {m}")
    assert state0.keys() == state1.keys()
    for k in state0:
        assert state0[k].keys() == state1[k].keys(), f"state {k}"
        for n in state0[k]:
            if isinstance(state0[k][n], torch.Tensor):
                torch.testing.assert_close(state1[k][n], state0[k][n], atol=0, rtol=0, msg=lambda m: f"{k}.{n}: {m}")
            else:  # a key of the caller's
                assert state1[k][n] == state0[k][n], f"{k}.{n}: {state1[k][n]!r}, was {state0[k][n]!r}"
    assert groups1 == groups0


def bad_tensor(kind, shape):
    return {
        "sparse": lambda: torch.zeros(shape).to_sparse(),
        "meta": lambda: torch.zeros(shape, device="meta"),
        "complex": lambda: torch.zeros(shape, dtype=torch.complex64),
    }[kind]()


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("kind", ["sparse", "meta", "complex"])
def test_load_of_a_tensor_that_cannot_be_copied_changes_nothing(kind, engine):
    """The bad tensor is the last parameter's, and the state dict also changes lr: all is checked first."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    sd = copy.deepcopy(pair.ref.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    for entry in sd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1.0
    sd["state"][3]["exp_avg_sq"] = bad_tensor(kind, SHAPES[3])
    before = snapshot(pair.ours, pair.opt)
    with pytest.raises(ValueError, match=r"'exp_avg_sq' for parameter 3 \(params\[3\] of param group 0"):
        pair.opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(pair.ours, pair.opt))
    pair.run(2, "after the failed load")


STEP_CASES = {
    "two_elements": (torch.tensor([1.0, 2.0]), r"as a torch\.float32 tensor of shape \(2,\) on cpu"),
    "meta": (torch.tensor(1.0, device="meta"), r"as a torch\.float32 tensor of shape \(\) on meta"),
    "string": ("3", r"as a str"),
}


@pytest.mark.parametrize("engine", ["step", "per_param"])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_load_of_a_bad_step_names_the_parameter(case, engine):
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    sd = copy.deepcopy(pair.ref.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    value, pattern = STEP_CASES[case]
    sd["state"][2]["step"] = value
    before = snapshot(pair.ours, pair.opt)
    name = re.escape("'step' for parameter 2 (params[2] of param group 0 (shape (2, 3, 4))) ")
    with pytest.raises(ValueError, match=name + pattern + "; a step count is a number"):
        pair.opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(pair.ours, pair.opt))


BAD_TENSOR_HPARAMS = {  # a hyper-parameter the optimizer reads, as a tensor it cannot step with
    "meta_lr": ("adamw", "lr", lambda: torch.tensor(0.1, device="meta")),
    "two_element_lr": ("adamw", "lr", lambda: torch.tensor([0.1, 0.2])),
    "two_element_beta": ("adamw", "betas", lambda: (torch.tensor([0.9, 0.8]), 0.999)),
    "complex_momentum": ("sgd", "momentum", lambda: torch.tensor(0.9 + 0j)),
}


@pytest.mark.parametrize("case", list(BAD_TENSOR_HPARAMS))
def test_load_of_a_bad_tensor_hyper_parameter_changes_nothing(case):
    opt_name, key, value = BAD_TENSOR_HPARAMS[case]
    pair = Pair(opt_name)
    pair.run(2, "before")
    sd = copy.deepcopy(pair.ref.state_dict())
    sd["param_groups"][0][key] = value()
    before = snapshot(pair.ours, pair.opt)
    with pytest.raises(ValueError, match=rf"param group 0 '{key}' holding a .*; a hyper-parameter is a number"):
        pair.opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(pair.ours, pair.opt))


def group_keys():
    """Keys of a param group that no optimizer reads (a library's per-group record), with tensors no
    hyper-parameter could be: several elements, in a list, complex, on the meta device."""
    return {
        "loss_history": torch.tensor([0.5, 0.4, 0.3]),
        "bounds": [torch.zeros(2), 1.0],
        "phase": torch.tensor(1j),
        "shape_only": torch.empty(2, 3, device="meta"),
    }


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("source", ["flatopt", "torch"])
def test_group_keys_the_optimizer_does_not_read_load_as_torch(source, opt_name, engine):
    """A param group key the optimizer does not read is the caller's, whatever it holds: flatopt steps with it,
    exports it, and loads it from its own state dict or torch.optim's as torch.optim does (kept as given, a copy
    of the state dict's), and exports it again; training goes on as torch.optim's."""
    pair = Pair(opt_name, engine)
    pair.both(lambda opt, ps: opt.param_groups[0].update(group_keys()))
    pair.run(2, "with the group keys")
    sd = copy.deepcopy((pair.opt if source == "flatopt" else pair.ref).state_dict())
    loaded = copy.deepcopy(sd)
    pair.opt.load_state_dict(loaded)
    pair.ref.load_state_dict(copy.deepcopy(sd))
    for key, value in group_keys().items():
        ours = pair.opt.param_groups[0][key]
        if key != "shape_only":  # a meta tensor has no values to compare
            assert_same_value(ours, pair.ref.param_groups[0][key], f"loaded from {source}: group 0 {key!r}")
            assert_same_value(ours, value, f"loaded from {source}: group 0 {key!r}")
        assert ours is not loaded["param_groups"][0][key], f"group 0 {key!r} is the state dict's object"
    pair.compare(f"loaded from {source}")
    pair.run(2, f"loaded from {source}")
    again = pair.opt.state_dict()["param_groups"][0]  # flatopt -> flatopt: what it loaded, it exports
    for key in group_keys():
        assert again[key] is pair.opt.param_groups[0][key], f"group 0 {key!r} exported as a copy"
    torch_again = pair.ref.state_dict()["param_groups"][0]
    assert set(again) == set(torch_again), f"group keys {sorted(again)}, torch.optim has {sorted(torch_again)}"


# ---------------------------------------------------------------------------------------------- hooks


def put_test_key(opt):
    opt.state["test"] = 1


@pytest.mark.parametrize("engine", list(ENGINES))
def test_state_dict_pre_hook_key_is_kept_as_torch(engine):
    """torch's test_state_dict_pre_hook: a pre-hook's ``optimizer.state["test"] = 1`` is in the state dict."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    for opt in (pair.opt, pair.ref):
        opt.register_state_dict_pre_hook(put_test_key)
    ours, theirs = pair.opt.state_dict(), pair.ref.state_dict()
    assert ours["state"]["test"] == theirs["state"]["test"] == 1
    assert set(ours["state"]) == set(theirs["state"])
    pair.run(2, "with the key in opt.state")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_load_of_a_state_dict_with_a_key_that_is_no_parameter(engine):
    """torch.optim keeps such a key in opt.state as it is, and loads the parameters' states."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    pair.ref.register_state_dict_pre_hook(put_test_key)
    sd = pair.ref.state_dict()

    def post_hook(opt):
        opt.state["ran_load_state_dict_post_hook"] = True

    for opt in (pair.opt, pair.ref):
        opt.register_load_state_dict_post_hook(post_hook)
        opt.load_state_dict(copy.deepcopy(sd))
        assert opt.state["test"] == 1 and opt.state["ran_load_state_dict_post_hook"] is True
    pair.run(2, "after the load")
    assert pair.opt.state_dict()["state"]["test"] == 1


# ---------------------------------------------------------------------------------------------- the caller's keys

OWN_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}, "lion": {"exp_avg"}}


def callers_keys(p, tag, with_step):
    """Keys a caller puts in ``opt.state[p]``, of every kind torch.optim's load_state_dict treats apart: tensors it
    casts to the parameter's dtype (float64, int64, bool, in a list, in a dict), one under ``step`` it does not cast
    (in a dict; at the top for the optimizers whose state has no ``step`` of its own), and values it keeps."""
    keys = {
        "note": tag,
        "count": 3,
        "nothing": None,
        "ema": torch.linspace(-1, 1, p.numel(), dtype=torch.float64).reshape(p.shape),
        "hits": torch.arange(4),
        "flags": torch.tensor([True, False]),
        "pair": [torch.full((2,), 1.5, dtype=torch.float16), 7],
        "span": (1, torch.tensor([2.0])),
        "nested": {"step": torch.tensor(3), "w": torch.zeros(2, dtype=torch.float64)},
    }
    if with_step:
        keys["step"] = torch.tensor(5)
    return keys


def own_keys_of(opt):
    """The keys of ``opt``'s states (flatopt's optimizer or its torch.optim counterpart)."""
    return OWN_KEYS[{"AdamW": "adamw", "SGD": "sgd", "Lion": "lion", "LionReference": "lion"}[type(opt).__name__]]


def extras_of(opt, p):
    """The keys of ``opt.state[p]`` that are no state of the optimizer's."""
    return {k: v for k, v in opt.state.get(p, {}).items() if k not in own_keys_of(opt)}


def assert_same_value(ours, theirs, what):
    """``ours`` is ``theirs``'s value: of the same type, tensors of the same dtype, device and values (exactly)."""
    assert type(ours) is type(theirs), f"{what}: {type(ours).__name__}, torch.optim has {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.device) == (theirs.dtype, theirs.device), (
            f"{what}: {ours.dtype} on {ours.device}, torch.optim has {theirs.dtype} on {theirs.device}"
        )
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0, msg=lambda m: f"{what}: {m}")
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), f"{what}: keys {sorted(ours)}, torch.optim has {sorted(theirs)}"
        for k in theirs:
            assert_same_value(ours[k], theirs[k], f"{what}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{what}: {len(ours)} items, torch.optim has {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_value(a, b, f"{what}[{i}]")
    else:
        assert ours == theirs, f"{what}: {ours!r}, torch.optim has {theirs!r}"


def assert_extras_as_torch(pair, what, strings=None):
    """Every parameter's keys that are no state of the rule are torch.optim's, value for value. torch.optim's
    load_state_dict turns a str into the text of a generator; flatopt keeps it: ``strings`` gives it then."""
    for i, (p, q) in enumerate(zip(pair.ours, pair.theirs, strict=True)):
        ours, theirs = extras_of(pair.opt, p), extras_of(pair.ref, q)
        assert ours.keys() == theirs.keys(), f"{what}: params[{i}] has {sorted(ours)}, torch.optim {sorted(theirs)}"
        for k in theirs:
            if strings is not None and isinstance(ours[k], str):
                assert ours[k] == strings[i][k], f"{what}: params[{i}][{k!r}] is {ours[k]!r}"
                continue
            assert_same_value(ours[k], theirs[k], f"{what}: params[{i}][{k!r}]")


def put_callers_keys(pair, which=(0, 2)):
    """The same keys in both optimizers' entries of parameters ``which``; returns them, by parameter index."""
    given = {}
    with_step = "step" not in own_keys_of(pair.opt)  # SGD's and Lion's: a key of the caller's
    for i in which:
        given[i] = callers_keys(pair.ours[i], f"params[{i}]", with_step)
        pair.opt.state[pair.ours[i]].update(given[i])
        pair.ref.state[pair.theirs[i]].update(callers_keys(pair.theirs[i], f"params[{i}]", with_step))
    return given


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("opt_name", list(WITH_LION))
def test_callers_keys_are_exported_as_torch(opt_name, engine):
    """state_dict() carries every key of a parameter's entry, as torch.optim does: the caller's as they are (the
    same objects), beside the states; training goes on as torch.optim's and leaves them alone."""
    pair = Pair(opt_name, engine)
    pair.run(2, "before")
    given = put_callers_keys(pair)
    ours, theirs = pair.opt.state_dict(), pair.ref.state_dict()
    assert {k: set(e) for k, e in ours["state"].items()} == {k: set(e) for k, e in theirs["state"].items()}
    for i, keys in given.items():
        for k, v in keys.items():
            assert ours["state"][i][k] is pair.opt.state[pair.ours[i]][k], f"params[{i}][{k!r}] exported as a copy"
            assert_same_value(ours["state"][i][k], v, f"exported params[{i}][{k!r}]")
    pair.run(2, "with the caller's keys")
    assert_extras_as_torch(pair, "after 2 more steps")


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("opt_name", list(WITH_LION))
@pytest.mark.parametrize("source", ["flatopt", "torch"])
def test_callers_keys_load_as_torch(source, opt_name, engine):
    """A state dict with the caller's keys, saved by flatopt or by torch.optim, loads into both as torch.optim
    loads it: the states into the buffers, the other keys into opt.state[p] (tensors cast to the parameter's dtype,
    a ``step`` not, copies of the state dict's), and training goes on as torch.optim's."""
    pair = Pair(opt_name, engine)
    pair.run(2, "before")
    given = put_callers_keys(pair)
    saved = (pair.opt if source == "flatopt" else pair.ref).state_dict()
    sd = copy.deepcopy(saved)
    pair.both(lambda opt, ps: opt.state.clear())  # nothing of the keys left but what the state dict brings
    loaded = copy.deepcopy(sd)
    pair.opt.load_state_dict(loaded)
    pair.ref.load_state_dict(copy.deepcopy(sd))
    strings = {i: {"note": f"params[{i}]"} for i in given}
    assert_extras_as_torch(pair, f"loaded from {source}", strings)
    for i in given:
        for k, v in pair.opt.state[pair.ours[i]].items():
            if isinstance(v, torch.Tensor) and isinstance(loaded["state"][i].get(k), torch.Tensor):
                theirs = loaded["state"][i][k].untyped_storage().data_ptr()
                assert v.untyped_storage().data_ptr() != theirs, f"params[{i}][{k!r}] shares the state dict's storage"
    pair.compare(f"loaded from {source}")
    pair.run(2, f"loaded from {source}")
    assert_extras_as_torch(pair, f"2 steps after loading from {source}", strings)
    again = pair.opt.state_dict()  # flatopt -> flatopt: what it loaded, it exports
    for i in given:
        assert_same_value(again["state"][i]["ema"], sd["state"][i]["ema"].float(), f"params[{i}]['ema']")
        assert again["state"][i]["note"] == f"params[{i}]"


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("fused", [False, True])
def test_callers_keys_are_cast_as_torch_casts_them(fused, engine):
    """Parameters of other dtypes: a tensor goes to the parameter's dtype, except a ``step`` (cast to float32 only
    when the saved group says fused, as torch.optim does); the same state dict loaded into torch.optim.SGD."""
    dtypes = [torch.float64, torch.bfloat16, torch.float16]
    ours = [nn.Parameter(torch.randn(4, 3, dtype=d)) for d in dtypes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = flatopt.SGD(ours, lr=0.1, momentum=0.9, backend="torch", **ENGINES[engine])
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    sd = copy.deepcopy(ref.state_dict())
    sd["param_groups"][0]["fused"] = fused
    for i, p in enumerate(ours):
        sd["state"][i] = {"momentum_buffer": torch.ones(4, 3, dtype=torch.float32), **callers_keys(p, "x", True)}
    opt.load_state_dict(copy.deepcopy(sd))
    ref.load_state_dict(copy.deepcopy(sd))
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        mine = {k: v for k, v in opt.state[p].items() if k not in ("momentum_buffer", "note")}
        torchs = {k: v for k, v in ref.state[q].items() if k not in ("momentum_buffer", "note")}
        assert_same_value(mine, torchs, f"params[{i}] ({p.dtype})")
        assert mine["ema"].dtype == p.dtype
        assert mine["step"].dtype == (torch.float32 if fused else torch.int64)
        assert opt.state[p]["note"] == "x"


def test_callers_keys_of_a_parameter_not_stepped_yet():
    """Keys put in the entry of a parameter that has no state yet are its whole entry in the state dict, as in
    torch.optim; loaded, they stay beside the states that the first step starts."""
    pair = Pair("adamw")
    pair.both(lambda opt, ps: opt.state[ps[1]].update(note="kept", count=torch.tensor([1.0, 2.0])))
    ours, theirs = pair.opt.state_dict(), pair.ref.state_dict()
    assert set(ours["state"]) == set(theirs["state"]) == {1}
    assert ours["state"][1].keys() == theirs["state"][1].keys() == {"note", "count"}
    pair.opt.state.clear()
    pair.opt.load_state_dict(copy.deepcopy(theirs))
    assert extras_of(pair.opt, pair.ours[1]).keys() == {"note", "count"}
    pair.ref.state.clear()  # torch.optim.AdamW fails with a KeyError on an entry without its states
    pair.run(2, "after loading")
    assert pair.opt.state[pair.ours[1]]["note"] == "kept"
    assert set(pair.opt.state_dict()["state"][1]) == {"step", "exp_avg", "exp_avg_sq", "note", "count"}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("reset", list(RESETS))
def test_a_reset_drops_the_callers_keys_as_torch(reset, engine):
    """An edit that empties or replaces an entry takes the caller's keys with it, as in torch.optim, where the
    entry is what the caller left; the other entries keep theirs."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    put_callers_keys(pair, which=range(len(SHAPES)))
    pair.both(RESETS[reset])
    assert_extras_as_torch(pair, f"after {reset}")
    pair.run(2, f"after {reset}")
    assert_extras_as_torch(pair, f"2 steps after {reset}")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_callers_keys_survive_a_new_layout_and_a_state_that_starts(engine):
    """flatopt's own changes of the layout (a param group added, a parameter unfrozen) and of the states (SGD's
    momentum turned on) keep the caller's keys, as torch.optim, which has no such changes, keeps them."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = flatopt.SGD(ours[:2], lr=0.05, backend="torch", **ENGINES[engine])
    ref = torch.optim.SGD(theirs[:2], lr=0.05)
    ours[3].requires_grad_(False)
    theirs[3].requires_grad_(False)

    def train(step):
        for o in (opt, ref):
            Pair.backward([p for g in o.param_groups for p in g["params"] if p.requires_grad], step)
            o.step()
            o.zero_grad()

    train(1)
    for o, ps in ((opt, ours), (ref, theirs)):
        for i in (0, 1):
            o.state[ps[i]].update(note=i, ema=torch.ones(2))
    for step, change in enumerate(("add_group", "unfreeze", "momentum"), start=2):
        for o, ps in ((opt, ours), (ref, theirs)):
            if change == "add_group":
                o.add_param_group({"params": ps[2:]})
                o.state[ps[3]]["note"] = 3  # frozen: not laid out yet
            elif change == "unfreeze":
                ps[3].requires_grad_(True)
            else:
                for group in o.param_groups:
                    group["momentum"] = 0.9
        train(step)
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            mine = {k: v for k, v in opt.state.get(p, {}).items() if k != "momentum_buffer"}
            torchs = {k: v for k, v in ref.state.get(q, {}).items() if k != "momentum_buffer"}
            assert_same_value(mine, torchs, f"after {change}: params[{i}]")
            assert_same(p.detach(), q.detach(), step, f"after {change}: params[{i}]")


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("bad", ["meta_key", "known_shape"])
def test_a_refused_load_with_callers_keys_changes_nothing(bad, engine):
    """A state dict that raises (a key of the caller's that cannot be cast to the parameter's device, or a state
    of another shape) leaves the states, the caller's keys and the groups as they were, whatever came before it
    in the state dict."""
    pair = Pair("adamw", engine)
    pair.run(2, "before")
    pair.opt.state[pair.ours[0]].update(ema=torch.ones(3), count=3)
    sd = copy.deepcopy(pair.ref.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    for entry in sd["state"].values():
        entry["note"] = "loaded"
        entry["ema"] = torch.zeros(3)
    if bad == "meta_key":
        sd["state"][3]["later"] = torch.zeros(3, device="meta")
        pattern = r"'later' for parameter 3 \(params\[3\] of param group 0 .*\), which cannot be cast as torch\.optim"
    else:
        sd["state"][3]["exp_avg"] = torch.zeros(2, 2)
        pattern = r"'exp_avg' of shape \(2, 2\) for parameter 3"
    before = snapshot(pair.ours, pair.opt)
    keys = {i: dict(pair.opt.state[p]) for i, p in enumerate(pair.ours)}
    with pytest.raises(ValueError, match=pattern):
        pair.opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(pair.ours, pair.opt))
    for i, p in enumerate(pair.ours):
        assert pair.opt.state[p].keys() == keys[i].keys(), f"params[{i}]: {sorted(pair.opt.state[p])}"
        assert all(pair.opt.state[p][k] is v for k, v in keys[i].items() if k not in OWN_KEYS["adamw"]), i
    pair.run(2, "after the failed load")


@pytest.mark.parametrize("engine", ["step", "in_backward"])
def test_callers_keys_beside_8_bit_states(engine):
    """With ``state_dtype="int8"`` opt.state also holds each state's scales (``exp_avg_absmax``): they are no key of
    the caller's, so the state dict leaves them out (its ``"flatopt"`` entry carries them), and a state dict that
    has one under a parameter's state is refused rather than put beside the scales."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 65))
    opt = flatopt.AdamW([p], lr=0.01, state_dtype="int8", backend="torch", **ENGINES[engine])
    for step in range(2):
        Pair.backward([p], step)
        opt.step()
        opt.zero_grad()
    assert "exp_avg_absmax" in opt.state[p]
    opt.state[p].update(note="kept", ema=torch.ones(3, dtype=torch.float64))
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "note", "ema"}
    del opt.state[p]["note"], opt.state[p]["ema"]
    opt.load_state_dict(copy.deepcopy(sd))
    assert opt.state[p]["note"] == "kept" and opt.state[p]["ema"].dtype == torch.float32
    assert {"exp_avg_absmax", "exp_avg_sq_absmax"} <= set(opt.state[p])
    before = snapshot([p], opt)
    sd["state"][0]["exp_avg_absmax"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"unexpected state \['exp_avg_absmax'\] for parameter 0 \(with state_dtype"):
        opt.load_state_dict(sd)
    assert_unchanged(before, snapshot([p], opt))


@pytest.mark.parametrize("flatten", [False, True])
def test_callers_keys_through_torch_distributed_checkpoint_as_torch(flatten):
    """torch.distributed.checkpoint's get_optimizer_state_dict / set_optimizer_state_dict (one process, a plain
    model) carry the caller's keys between flatopt and torch.optim as between two torch.optim optimizers: kept in
    the nested form; left out by the flattened form's load, which takes the keys the loading optimizer's entries
    have (torch's own behaviour, on both)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    makers = {
        "flatopt": lambda m: flatopt.AdamW(m, lr=0.1, backend="torch"),
        "torch": lambda m: torch.optim.AdamW(m.parameters(), lr=0.1),
    }
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def trained(name):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        opt = makers[name](model)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        return model, opt

    saved, loaded = {}, {}
    for source in makers:
        model, opt = trained(source)
        opt.state[model[0].weight].update(count=7, ema=torch.ones(2, dtype=torch.float64))
        saved[source] = get_optimizer_state_dict(model, opt, options=options)
        for target in makers:
            model, opt = trained(target)
            set_optimizer_state_dict(model, opt, copy.deepcopy(saved[source]), options=options)
            loaded[source, target] = {k: v for k, v in opt.state[model[0].weight].items() if k not in OWN_KEYS["adamw"]}
    assert saved["flatopt"].keys() == saved["torch"].keys()
    if not flatten:
        assert saved["flatopt"]["state"].keys() == saved["torch"]["state"].keys()
        assert saved["flatopt"]["state"]["0.weight"].keys() == saved["torch"]["state"]["0.weight"].keys()
    for (source, target), keys in loaded.items():
        assert_same_value(keys, loaded["torch", "torch"], f"{source} -> {target}")
    assert loaded["torch", "torch"].keys() == (set() if flatten else {"count", "ema"})


@pytest.mark.requires_cuda
@pytest.mark.parametrize("engine", list(ENGINES))
def test_on_the_gpu_callers_keys_of_a_cpu_checkpoint_go_to_the_parameters_device(engine):
    """The caller's tensors of a state dict saved on the CPU load onto the parameter's device, as torch.optim's."""
    pair = Pair("adamw", engine, backend=None, device="cuda")
    pair.run(2, "before")
    sd = copy.deepcopy(pair.ref.state_dict())
    sd = {
        "state": {k: {n: t.cpu() for n, t in e.items()} for k, e in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    for i, p in enumerate(pair.ours):
        sd["state"][i].update(callers_keys(p.cpu(), f"params[{i}]", with_step=False))
    pair.opt.load_state_dict(copy.deepcopy(sd))
    pair.ref.load_state_dict(copy.deepcopy(sd))
    assert_extras_as_torch(pair, "a CPU checkpoint", {i: {"note": f"params[{i}]"} for i in range(len(SHAPES))})
    assert pair.opt.state[pair.ours[0]]["ema"].device.type == "cuda"
    pair.run(2, "after loading a CPU checkpoint")


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("opt_name", list(WITH_LION))
def test_an_amsgrad_state_is_refused_by_adamw_alone(opt_name, engine):
    """``max_exp_avg_sq`` (torch.optim.AdamW's amsgrad state) is refused by flatopt.AdamW, which has no amsgrad, before
    anything changes; SGD and Lion keep it as the caller's key, as torch.optim.SGD keeps any key it is given."""
    pair = Pair(opt_name, engine)
    pair.run(2, "before")
    sd = copy.deepcopy(pair.ref.state_dict())
    first = next(iter(sd["state"]))
    sd["state"][first]["max_exp_avg_sq"] = torch.full_like(pair.theirs[first], 0.25)
    if opt_name == "adamw":
        before = copy.deepcopy(pair.opt.state_dict())
        with pytest.raises(ValueError, match=r"unexpected state \['max_exp_avg_sq'\].*amsgrad"):
            pair.opt.load_state_dict(copy.deepcopy(sd))
        assert_same_value(pair.opt.state_dict()["state"], before["state"], "after the refused load")
        return
    pair.opt.load_state_dict(copy.deepcopy(sd))
    pair.ref.load_state_dict(copy.deepcopy(sd))
    mine, theirs = pair.opt.state[pair.ours[first]], pair.ref.state[pair.theirs[first]]
    assert_same_value(mine["max_exp_avg_sq"], theirs["max_exp_avg_sq"], "the amsgrad state, kept")
    pair.run(2, "after loading")
    again = pair.opt.state_dict()["state"][first]["max_exp_avg_sq"]
    assert_same_value(again, theirs["max_exp_avg_sq"], "exported again")


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.1),
        lambda m: flatopt.AdamW(m, lr=0.1, backend="torch"),
        lambda m: flatopt.AdamW(m, lr=0.1, backend="torch", in_backward=True),
        lambda m: flatopt.SGD(m, lr=0.1, momentum=0.9, backend="torch"),
    ],
    ids=["torch", "flatopt", "flatopt-in-backward", "flatopt-sgd"],
)
def test_opt_state_is_empty_until_a_first_step_as_torch_optim_s(make):
    """torch.optim's opt.state is empty until a parameter's first step; flatopt's entries exist from construction
    (views of the buffers), but bool(opt.state) says what torch's says: torch.distributed.checkpoint reads it."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = make(model)
    assert not opt.state
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt.state
    opt.state.clear()  # a reset, pending until the next step
    assert not opt.state
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt.state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process: DCP says so
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("in_backward", [False, True])
def test_a_new_optimizer_resumes_through_torch_distributed_checkpoint(tmp_path, in_backward, full):
    """The usual DCP resume (outside FSDP2 too): a new model and optimizer, get_optimizer_state_dict as the
    template, dcp.load into it, set_optimizer_state_dict. DCP steps an optimizer whose opt.state is empty once
    with lr 0 so that its state_dict() has every state to load into; flatopt's opt.state must say it is empty."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=full)

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        return model, flatopt.AdamW(model, lr=0.1, backend="torch", in_backward=in_backward)

    def train(model, opt, steps):
        for i in range(steps):
            model(torch.full((2, 4), 0.5 + i)).sum().backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    train(model, opt, 3)
    dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)}, checkpoint_id=str(tmp_path))
    want = copy.deepcopy(opt.state_dict())
    train(model, opt, 1)

    new_model, new_opt = make()
    state = {"optim": get_optimizer_state_dict(new_model, new_opt, options=options)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(new_model, new_opt, state["optim"], options=options)
    got = new_opt.state_dict()
    assert got["state"].keys() == want["state"].keys() == {0, 1, 2, 3}
    for k, entry in want["state"].items():
        for name, t in entry.items():
            assert torch.equal(got["state"][k][name], t), (k, name)
