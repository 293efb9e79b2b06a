"""flatopt.SGD: the torch.optim face of :data:`flatopt.rules.SGD`."""

from flatopt import _docs, rules
from flatopt.optimizer import FlatOptimizer
from flatopt.options import check_torch_options


class SGD(FlatOptimizer):
    rule = rules.SGD

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
        check_torch_options(self.rule.name, foreach=foreach, differentiable=differentiable, fused=fused)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, **options)


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
