"""torch's optimizer test inputs for AdamW and SGD, as tables of our own, and the comparison of a flatopt
optimizer with the torch.optim optimizer it stands in for. A helper for ``test_optim_db.py`` and
``test_property.py``, not a test file.

The tables are written from ``torch/testing/_internal/common_optimizers.py`` (torch 2.4 to 2.13):
``optim_inputs_func_adam`` (which ``optim_inputs_func_adamw`` returns) and ``optim_inputs_func_sgd``, every
configuration they list for any device (CPU, CUDA, MPS); ``get_error_inputs_for_all_optims``,
``optim_error_inputs_func_adam`` and ``optim_error_inputs_func_sgd``; and the ``OptimizerInfo`` entries'
``scheduler_inputs``, ``supported_impls`` and ``not_og_supported_flags``. torch's module is not imported for
them (it needs ``expecttest``, and its shape changes between versions); ``test_optim_db.py`` checks that the
installed torch lists nothing these tables lack.
"""

import copy
from dataclasses import dataclass, field

import torch
from conftest import TOL
from torch.optim.lr_scheduler import (
    ConstantLR,
    ExponentialLR,
    LinearLR,
    PolynomialLR,
    ReduceLROnPlateau,
    StepLR,
)

import flatopt


@dataclass(frozen=True)
class Input:
    """One constructor configuration of torch's database.

    Args:
        desc: torch's description of it.
        kwargs: the constructor's keyword arguments (call :meth:`make` for a fresh copy: tensors are never
            shared between two optimizers, whose schedulers would both write them).
        refused: None if flatopt takes the configuration, else a regex of the ValueError it raises.
        derived: not in torch's lists, derived from one that flatopt refuses (the same without the refused flag).
    """

    desc: str
    kwargs: dict = field(default_factory=dict)
    refused: str | None = None
    derived: bool = False

    def make(self, **changes):
        kwargs = copy.deepcopy(self.kwargs)
        kwargs.update(changes)
        return kwargs


AMSGRAD = r"flatopt\.AdamW does not take amsgrad=True: it does not implement amsgrad; use torch\.optim\.AdamW\(amsgrad"

ADAMW_INPUTS = (
    Input("default"),
    Input("non-default lr", dict(lr=0.01)),
    Input("nonzero weight_decay", dict(weight_decay=0.1)),
    Input("maximize", dict(weight_decay=0.1, maximize=True)),
    Input("amsgrad", dict(weight_decay=0.1, amsgrad=True), refused=AMSGRAD),
    Input("capturable", dict(capturable=True)),
    Input("capturable, amsgrad", dict(weight_decay=0.1, amsgrad=True, capturable=True), refused=AMSGRAD),
    Input(
        "Tensor lr with capturable and amsgrad",
        dict(lr=torch.tensor(0.001), amsgrad=True, capturable=True),
        refused=AMSGRAD,
    ),
    Input(
        "Tensor lr, Tensor betas, with capturable and amsgrad",
        dict(
            lr=torch.tensor(0.001),
            betas=(torch.tensor([[[0.9]]]), torch.tensor([[0.99]])),
            amsgrad=True,
            capturable=True,
        ),
        refused=AMSGRAD,
    ),
    Input(
        "Tensor lr, multi-dimensional Tensor betas, with capturable",
        dict(lr=torch.tensor(0.001), betas=(torch.tensor([[[0.9]]]), torch.tensor([[0.99]])), capturable=True),
        derived=True,
    ),
    Input(
        "Tensor lr, Tensor betas, with capturable",
        dict(lr=torch.tensor(0.001), betas=(torch.tensor(0.9), torch.tensor(0.99)), amsgrad=False, capturable=True),
    ),
    Input("Tensor lr", dict(lr=torch.tensor(0.01))),
)

SGD_INPUTS = (
    Input("default"),
    Input("non-default lr", dict(lr=1e-2)),
    Input("tensor lr", dict(lr=torch.tensor(0.001))),
    Input("non-zero weight_decay", dict(weight_decay=0.5)),
    Input("momentum", dict(momentum=0.9)),
    Input("maximize", dict(weight_decay=0.1, maximize=True)),
    Input("dampening", dict(momentum=0.9, dampening=0.5)),
    Input("weight_decay w/ momentum", dict(momentum=0.9, weight_decay=0.1)),
    Input("nesterov", dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
)


@dataclass(frozen=True)
class Optim:
    """One optimizer of torch's database with its flatopt counterpart."""

    name: str
    ours: type
    theirs: type
    inputs: tuple
    scheduler_inputs: tuple  # lists of scheduler constructors (OptimizerInfo.scheduler_inputs)
    # float32 tolerances for runs of 20 steps on torch's weight/bias problem, where SGD's momentum buffer reaches
    # about 150 (float32's spacing there is 1.5e-5) and keeps the rounding of those steps: flatopt and torch.optim
    # each stay within 3e-5 of a float64 run, and within 2.3e-5 of each other
    run_tol: dict | None = None
    not_og_supported_flags: tuple = ("foreach", "differentiable", "fused", "maximize", "capturable")

    def supported(self):
        return [i for i in self.inputs if i.refused is None]

    def refused(self):
        return [i for i in self.inputs if i.refused is not None]


OPTIMS = {
    "AdamW": Optim(
        "AdamW",
        flatopt.AdamW,
        torch.optim.AdamW,
        ADAMW_INPUTS,
        ((lambda o: StepLR(o, gamma=0.9, step_size=10), lambda o: ReduceLROnPlateau(o)),),  # OptimizerInfo's default
    ),
    "SGD": Optim(
        "SGD",
        flatopt.SGD,
        torch.optim.SGD,
        SGD_INPUTS,
        (
            (lambda o: StepLR(o, gamma=0.9, step_size=10),),
            (lambda o: LinearLR(o, start_factor=0.4, end_factor=0.8, total_iters=4),),
            (
                lambda o: StepLR(o, gamma=0.9, step_size=10),
                lambda o: LinearLR(o, start_factor=0.4, end_factor=0.6, total_iters=4),
            ),
            (
                lambda o: StepLR(o, gamma=0.99, step_size=10),
                lambda o: ExponentialLR(o, gamma=0.99),
                lambda o: ReduceLROnPlateau(o),
            ),
            (lambda o: ConstantLR(o, factor=0.4, total_iters=4),),
            (lambda o: PolynomialLR(o, power=0.9, total_iters=4),),
            (lambda o: StepLR(o, gamma=0.9, step_size=10), lambda o: ReduceLROnPlateau(o)),
        ),
        run_tol=dict(atol=6e-5, rtol=2e-5),
    ),
}

# torch's "global cliquey" implementation flags (supported_impls of both entries): torch's tests add each config
# with all three False, and with each one True. What flatopt takes of them, and the error for the rest.
CLIQUEY_FLAGS = ("foreach", "fused", "differentiable")
TAKES = {("foreach", None), ("fused", None), ("fused", True), ("differentiable", False)}


def refusal(cls_name, flag, value):
    """The regex of flatopt's error for ``flag=value``: it names the option and says what to do."""
    what = {
        "foreach": r"it always steps each flat buffer with one fused kernel.*drop 'foreach'",
        "fused": r"it always steps each flat buffer with one fused kernel; drop 'fused' \(or pass fused=True\)",
        "differentiable": rf"its step updates the parameters in place outside autograd and is not differentiable; "
        rf"use torch\.optim\.{cls_name}\(differentiable=True\)",
    }[flag]
    return rf"flatopt\.{cls_name} does not take {flag}={value!r}: {what}"


def reference_kwargs(kwargs, device):
    """torch.optim's arguments for flatopt's: ``capturable`` (which flatopt takes and ignores, and which only
    changes torch's implementation) is dropped on the CPU, where torch.optim refuses it at the step."""
    kwargs = dict(kwargs)
    if torch.device(device).type == "cpu":
        kwargs.pop("capturable", None)
    return kwargs


def scheduler_step(scheduler, loss):
    if isinstance(scheduler, ReduceLROnPlateau):
        scheduler.step(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
    else:
        scheduler.step()


def assert_matches(ours, theirs, pairs, where, tol=None):
    """flatopt's optimizer ``ours`` against torch.optim's ``theirs``: every parameter, every state tensor torch
    keeps (step counts exactly), and which parameters have state in the state dicts.

    Args:
        pairs: ``(name, flatopt's parameter, torch's parameter)`` for every parameter.
        where: what the failure message names first (the step, the example).
        tol: ``dict(atol=, rtol=)``; default: ``conftest.TOL`` for the parameter's dtype.
    """
    held = {q for group in theirs.param_groups for q in group["params"]}
    for name, p, q in pairs:
        t = tol or TOL[q.dtype]
        torch.testing.assert_close(p.detach(), q.detach(), **t, msg=lambda m: f"{where}, {name}: {m}")
        if q not in held:  # removed from the groups: torch.optim keeps its state, flatopt drops it (documented)
            assert p not in ours.state, f"{where}, {name}: flatopt keeps state for a parameter its groups lost"
            continue
        mine_all = ours.state.get(p, {})
        for key, value in theirs.state.get(q, {}).items():
            if value is None:  # torch.optim.SGD's momentum_buffer before a momentum step, in some versions
                continue
            mine = mine_all.get(key)
            assert mine is not None, f"{where}, {name}: torch.optim keeps state '{key}', flatopt has none"
            if key == "step":
                assert float(mine) == float(value), f"{where}, {name}: step {float(mine)}, torch.optim's {float(value)}"
            else:
                torch.testing.assert_close(mine, value, **t, msg=lambda m: f"{where}, {name}.{key}: {m}")
    ours_keys, theirs_keys = state_keys(ours), state_keys(theirs)
    assert ours_keys == theirs_keys, (
        f"{where}: state_dict()['state'] differs in its keys: flatopt {ours_keys}, torch.optim {theirs_keys}"
    )


def state_keys(opt):
    """What ``opt.state_dict()['state']`` holds: each parameter's state keys (anything else as it is)."""
    return {k: sorted(v) if isinstance(v, dict) else v for k, v in opt.state_dict()["state"].items()}
