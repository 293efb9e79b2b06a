"""flatopt.AdamW."""

import math
from types import SimpleNamespace

import torch

from flatopt import _docs, functional
from flatopt.optimizer import FlatOptimizer
from flatopt.options import check_torch_options


class AdamW(FlatOptimizer):
    _state_names = ("exp_avg", "exp_avg_sq")
    _exported_step = True
    _functional = staticmethod(functional.adamw)

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        **options,
    ):
        check_torch_options(
            "AdamW",
            amsgrad=amsgrad,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **options)

    @staticmethod
    def _check_hparams(group):
        lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if group.get("amsgrad", False):
            raise ValueError("flatopt.AdamW does not implement amsgrad; use torch.optim.AdamW(amsgrad=True)")

    @staticmethod
    def _hparam_row(group):
        lr = group["lr"]
        beta1, beta2 = (float(b) for b in group["betas"])
        return [
            0.0 if isinstance(lr, torch.Tensor) else float(lr),
            beta1,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            math.log(beta1) if beta1 > 0 else -math.inf,
            math.log(beta2) if beta2 > 0 else -math.inf,
            float(group["eps"]),
            float(group["weight_decay"]),
            -1.0 if group["maximize"] else 1.0,
        ]


AdamW.__doc__ = rf"""Implements AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"),
    with torch.optim.AdamW's arguments, defaults and numerics (math in float32; states in the
    parameter's dtype)::

        p   <- p * (1 - lr * weight_decay)
        m   <- beta1 * m + (1 - beta1) * g
        v   <- beta2 * v + (1 - beta2) * g * g
        p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    Args:
        {_docs.PARAMS}
        lr (float or Tensor, optional): learning rate (default: 1e-3)
        betas (tuple[float, float], optional): coefficients of the running averages of the
            gradient and its square (default: (0.9, 0.999))
        eps (float, optional): term added to the denominator (default: 1e-8)
        weight_decay (float, optional): decoupled weight decay coefficient (default: 1e-2)
        amsgrad (bool, optional): only False: AMSGrad is not implemented; use
            ``torch.optim.AdamW(amsgrad=True)`` for it (default: False)
        maximize (bool, optional): maximize the objective instead of minimizing (default: False)
        {_docs.FOREACH}
        {_docs.CAPTURABLE}
        {_docs.DIFFERENTIABLE}
        {_docs.FUSED}
        {_docs.FLAT}
{_docs.NOTES}"""


# The rule of AdamW as the base class reads it (see flatopt.optimizer.FlatOptimizer.rule).
AdamW.rule = SimpleNamespace(
    name="AdamW",
    state_names=AdamW._state_names,
    exported_step=AdamW._exported_step,
    row=AdamW._hparam_row,
    check=AdamW._check_hparams,
    uses_state=lambda name, group: True,
    functional=AdamW._functional,
)
