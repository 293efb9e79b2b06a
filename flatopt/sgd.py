"""flatopt.SGD: the torch.optim face of :data:`flatopt.rules.SGD`."""

from flatopt import _docs, rules
from flatopt.optimizer import FlatOptimizer, reject_kwargs


class SGD(FlatOptimizer):
    rule = rules.SGD
    # what FlatOptimizer reads, delegated to the rule
    _state_names = rule.state_names
    _exported_step = rule.exported_step
    _functional = staticmethod(rule.functional)
    _check_hparams = staticmethod(rule.check)
    _hparam_row = staticmethod(rule.row)
    _uses_state = staticmethod(rule.uses_state)

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
        flat=True,
        backend=None,
        skip_unused=False,
        in_backward=False,
        bucket_size=None,
        **kwargs,
    ):
        reject_kwargs(self.rule.name, kwargs, foreach=foreach, differentiable=differentiable, fused=fused)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(
            params,
            defaults,
            flat=flat,
            backend=backend,
            skip_unused=skip_unused,
            in_backward=in_backward,
            bucket_size=bucket_size,
        )


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
