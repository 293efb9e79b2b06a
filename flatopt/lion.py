"""flatopt.Lion."""

from types import SimpleNamespace

import torch

from flatopt import _docs, functional
from flatopt.optimizer import FlatOptimizer
from flatopt.options import check_torch_options


class Lion(FlatOptimizer):
    _state_names = ("exp_avg",)
    _functional = staticmethod(functional.lion)

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0.0,
        use_triton=False,
        decoupled_weight_decay=False,
        **options,
    ):
        check_torch_options("Lion", use_triton=use_triton, decoupled_weight_decay=decoupled_weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, **options)

    @staticmethod
    def _check_hparams(group):
        lr, betas = group["lr"], group["betas"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta <= 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")

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
            float(group["weight_decay"]),
        ]


Lion.__doc__ = rf"""Implements Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"),
    with decoupled weight decay as lion-pytorch applies it::

        p   <- p * (1 - lr * weight_decay)
        p   <- p - lr * sign(beta1 * m + (1 - beta1) * g)
        m   <- beta2 * m + (1 - beta2) * g

    Args:
        {_docs.PARAMS}
        lr (float or Tensor, optional): learning rate (default: 1e-4)
        betas (tuple[float, float], optional): interpolation factor of the update and decay of
            the running average (default: (0.9, 0.99))
        weight_decay (float, optional): decoupled weight decay coefficient (default: 0.0)
        use_triton (bool, optional): lion-pytorch's choice of implementation; only False (its
            default) is taken, since flatopt steps with its own kernels, Triton or torch as
            ``backend`` says (default: False)
        decoupled_weight_decay (bool, optional): only False: lion-pytorch's ``True`` divides
            the weight decay by the constructor's ``lr``; pass ``weight_decay / lr`` instead,
            which decays the same (default: False)
        {_docs.FLAT}
{_docs.NOTES}"""


# The rule of Lion as the base class reads it (see flatopt.optimizer.FlatOptimizer.rule).
Lion.rule = SimpleNamespace(
    name="Lion",
    state_names=Lion._state_names,
    exported_step=False,
    row=Lion._hparam_row,
    check=Lion._check_hparams,
    uses_state=lambda name, group: True,
    functional=Lion._functional,
)
