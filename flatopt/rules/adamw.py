"""AdamW's rule (Loshchilov & Hutter, decoupled weight decay), torch.optim.AdamW's order of operations."""

import math

import torch

from flatopt.rules.base import Rule, beta_values, check_at_least_zero, check_betas, check_lr, group_number, lr_value


def values(group):
    betas = beta_values(group)
    return dict(
        lr=lr_value(group),
        **betas,
        log_beta1=log_or_minus_inf(betas["beta1"]),
        log_beta2=log_or_minus_inf(betas["beta2"]),
        eps=group_number(group, "eps"),
        weight_decay=group_number(group, "weight_decay"),
        grad_sign=-1.0 if group["maximize"] else 1.0,
    )


def log_or_minus_inf(beta):
    """log(beta) in float64, -inf for 0: the bias corrections 1 - beta**t are computed from it."""
    return math.log(beta) if beta > 0 else -math.inf


def check(group):
    check_lr(group["lr"])
    check_at_least_zero(group, "eps", "epsilon")
    check_betas(group["betas"], one_ok=False)
    check_at_least_zero(group, "weight_decay", "weight_decay")
    if group.get("amsgrad", False):
        raise ValueError("flatopt.AdamW does not implement amsgrad; use torch.optim.AdamW(amsgrad=True)")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError(
            "flatopt.AdamW implements decoupled weight decay only; a param group with decoupled_weight_decay=False "
            "asks for Adam's L2 penalty added to the gradient: use torch.optim.Adam for it, or set it back to True"
        )


def check_args(defaults):
    """torch.optim.AdamW's check of its constructor's betas (not of later param groups): both floats or both
    tensors."""
    b1, b2 = defaults["betas"]
    if not ((isinstance(b1, float) and isinstance(b2, float)) or (torch.is_tensor(b1) and torch.is_tensor(b2))):
        raise ValueError("betas must be either both floats or both Tensors")


def one_minus_pow(log_beta, t):
    """1 - beta**t from log(beta), in float64."""
    return -torch.expm1(torch.as_tensor(t, dtype=torch.float64) * torch.as_tensor(log_beta, dtype=torch.float64))


def adamw_math(
    p, g, m, v, *, steps, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay,
    grad_sign,
):  # fmt: skip
    """One AdamW update; ``beta1`` is not read (``one_minus_beta1`` is)."""
    t = steps + 1
    g = g * grad_sign
    p = p * (1.0 - lr * weight_decay)
    m = m + one_minus_beta1 * (g - m)  # torch's lerp(grad, 1 - beta1) for a weight below 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    step_size = (lr / one_minus_pow(log_beta1, t)).to(p.dtype)  # p: the math's dtype (float32 or float64)
    bias_correction2_sqrt = one_minus_pow(log_beta2, t).sqrt().to(p.dtype)
    denom = v.sqrt() / bias_correction2_sqrt + eps
    return p + (-step_size) * (m / denom), m, v


ADAMW = Rule(
    name="AdamW",
    key="adamw",
    columns=(
        "lr",
        "beta1",  # not read by the update (one_minus_beta1 is)
        "one_minus_beta1",
        "beta2",
        "one_minus_beta2",
        "log_beta1",  # see log_or_minus_inf
        "log_beta2",
        "eps",
        "weight_decay",
        "grad_sign",  # -1.0 when maximize
    ),
    values=values,
    check=check,
    math=adamw_math,
    state_names=("exp_avg", "exp_avg_sq"),
    exported_step=True,
    check_args=check_args,
    torch_keys=(
        ("foreach", None),
        ("fused", None),
        ("capturable", False),
        ("differentiable", False),
        ("amsgrad", False),
        ("decoupled_weight_decay", True),
    ),  # fmt: skip
    kept_keys=(("decoupled_weight_decay", True),),  # torch.optim.AdamW.__setstate__
    nonnegative_states=("exp_avg_sq",),
    zeros_stay_zero=lambda group: group["eps"] > 0,  # with eps=0 the padding's update is 0 / 0
)
