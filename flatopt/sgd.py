"""flatopt.SGD."""

from types import SimpleNamespace

import torch

from flatopt import _docs, functional
from flatopt.optimizer import FlatOptimizer
from flatopt.options import check_torch_options


class SGD(FlatOptimizer):
    _state_names = ("momentum_buffer",)
    _functional = staticmethod(functional.sgd)

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
        **options,
    ):
        check_torch_options("SGD", foreach=foreach, differentiable=differentiable, fused=fused)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, **options)

    @staticmethod
    def _check_hparams(group):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if group["momentum"] < 0.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']}")
        if group["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @staticmethod
    def _hparam_row(group):
        lr = group["lr"]
        return [
            0.0 if isinstance(lr, torch.Tensor) else float(lr),
            float(group["momentum"]),
            1.0 - float(group["dampening"]),
            float(group["weight_decay"]),
            1.0 if group["nesterov"] else 0.0,
            -1.0 if group["maximize"] else 1.0,
        ]

    def _uses_state(self, name, group):
        return group["momentum"] != 0


SGD.__doc__ = rf"""Implements stochastic gradient descent, optionally with momentum, dampening, Nesterov
    momentum and (coupled) weight decay, with torch.optim.SGD's arguments, defaults and numerics::

        d   <- g + weight_decay * p
        buf <- d at the first step, then momentum * buf + (1 - dampening) * d
        d   <- d + momentum * buf if nesterov else buf        (when momentum != 0)
        p   <- p - lr * d

    Args:
        {_docs.PARAMS}
        lr (float or Tensor, optional): learning rate (default: 1e-3)
        momentum (float, optional): momentum factor (default: 0)
        dampening (float, optional): dampening for momentum (default: 0)
        weight_decay (float, optional): L2 penalty (default: 0)
        nesterov (bool, optional): enables Nesterov momentum (default: False)
        maximize (bool, optional): maximize the objective instead of minimizing (default: False)
        {_docs.FOREACH}
        {_docs.DIFFERENTIABLE}
        {_docs.FUSED}
        {_docs.FLAT}
{_docs.NOTES}"""


# The rule of SGD as the base class reads it (see flatopt.optimizer.FlatOptimizer.rule).
SGD.rule = SimpleNamespace(
    name="SGD",
    state_names=SGD._state_names,
    exported_step=False,
    row=SGD._hparam_row,
    check=SGD._check_hparams,
    uses_state=lambda name, group: group["momentum"] != 0,
    functional=SGD._functional,
)
