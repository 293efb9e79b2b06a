"""SGD's rule: momentum, dampening, Nesterov and (coupled) weight decay, as torch.optim.SGD."""

import torch

from flatopt.rules.base import Rule, check_at_least_zero, check_lr, group_number, lr_value


def values(group):
    return dict(
        lr=lr_value(group),
        momentum=group_number(group, "momentum"),
        one_minus_dampening=1.0 - group_number(group, "dampening"),
        weight_decay=group_number(group, "weight_decay"),
        nesterov=1.0 if group["nesterov"] else 0.0,
        grad_sign=-1.0 if group["maximize"] else 1.0,
    )


def check(group):  # torch.optim.SGD compares with < 0.0, so NaN passes
    check_lr(group["lr"], nan_ok=True)
    check_at_least_zero(group, "momentum", "momentum", nan_ok=True)
    check_at_least_zero(group, "weight_decay", "weight_decay", nan_ok=True)
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def sgd_math(p, g, buf, *, steps, lr, momentum, one_minus_dampening, weight_decay, nesterov, grad_sign):
    """One SGD update. ``buf`` is None when no group of the buffer uses momentum; where ``steps`` is 0 it is
    set to the update itself, and where ``momentum`` is 0 it is returned unchanged."""
    d = g * grad_sign + weight_decay * p
    if buf is not None:
        new_buf = torch.where(steps == 0, d, buf * momentum + one_minus_dampening * d)
        with_momentum = torch.where(nesterov != 0, d + momentum * new_buf, new_buf)
        d = torch.where(momentum != 0, with_momentum, d)
        buf = torch.where(momentum != 0, new_buf, buf)
    return p + (-lr) * d, buf


SGD = Rule(
    name="SGD",
    key="sgd",
    columns=(
        "lr",
        "momentum",
        "one_minus_dampening",
        "weight_decay",
        "nesterov",  # 1.0 or 0.0
        "grad_sign",  # -1.0 when maximize
    ),
    values=values,
    check=check,
    math=sgd_math,
    state_names=("momentum_buffer",),
    state_used=lambda name, group: group["momentum"] != 0,
    torch_keys=(("foreach", None), ("fused", None), ("differentiable", False)),
)
