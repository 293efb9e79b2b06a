"""flatopt.Lion: the torch.optim face of :data:`flatopt.rules.LION`."""

from flatopt import _docs, rules
from flatopt.optimizer import FlatOptimizer
from flatopt.options import check_torch_options


class Lion(FlatOptimizer):
    rule = rules.LION

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
        check_torch_options(self.rule.name, use_triton=use_triton, decoupled_weight_decay=decoupled_weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, **options)


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
            default) is taken, since flatopt steps with its own kernels (Triton, CPU or torch) as
            ``backend`` says (default: False)
        decoupled_weight_decay (bool, optional): only False: lion-pytorch's ``True`` divides
            the weight decay by the constructor's ``lr``; pass ``weight_decay / lr`` instead,
            which decays the same (default: False)
        {_docs.FLAT}
{_docs.NOTES}"""
