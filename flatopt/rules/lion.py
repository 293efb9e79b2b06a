"""Lion's rule (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), with decoupled weight
decay as lion-pytorch applies it::

    p   <- p * (1 - lr * weight_decay)
    c   <- beta1 * m + (1 - beta1) * g
    p   <- p - lr * sign(c)
    m   <- beta2 * m + (1 - beta2) * g
"""

import torch

from flatopt.rules.base import Rule, beta_values, check_at_least_zero, check_betas, check_lr, group_number, lr_value


def values(group):
    return dict(lr=lr_value(group), **beta_values(group), weight_decay=group_number(group, "weight_decay"))


def check(group):
    check_lr(group["lr"])
    check_betas(group["betas"], one_ok=True)
    check_at_least_zero(group, "weight_decay", "weight_decay")


def lion_math(p, g, m, *, steps, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay):
    """One Lion update (``steps`` is not read: Lion has no bias correction)."""
    p = p * (1.0 - lr * weight_decay)
    c = m * beta1 + one_minus_beta1 * g
    p = p + (-lr) * torch.sign(c)
    m = m * beta2 + one_minus_beta2 * g
    return p, m


LION = Rule(
    name="Lion",
    key="lion",
    columns=("lr", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "weight_decay"),
    values=values,
    check=check,
    math=lion_math,
    state_names=("exp_avg",),
)
