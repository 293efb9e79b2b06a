"""flatopt.AdamW: the torch.optim face of :data:`flatopt.rules.ADAMW`."""

from flatopt import _docs, rules
from flatopt.optimizer import FlatOptimizer
from flatopt.options import check_torch_options
from flatopt.torch_compat import scalar_betas


class AdamW(FlatOptimizer):
    rule = rules.ADAMW

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
            self.rule.name,
            amsgrad=amsgrad,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        defaults = dict(lr=lr, betas=scalar_betas(betas), eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **options)


AdamW.__doc__ = rf"""Implements AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"),
    with torch.optim.AdamW's arguments, defaults and numerics (math in float32, float64 for float64
    parameters; states in the parameter's dtype unless ``state_dtype`` says otherwise)::

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
