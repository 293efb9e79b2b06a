"""AdamW over one flat buffer in one launch (Loshchilov & Hutter, decoupled weight decay).

Same math and order of operations as ``torch.optim.AdamW`` (non-amsgrad), in float32 for float32,
bfloat16 and float16 buffers and in float64 for float64 ones (``COMPUTE``); the states have the
parameter's dtype.
"""

import triton
import triton.language as tl

from flatopt.rules import ADAMW

from .common import begin_step, column, finish_step, launch, load_grad, one_minus_pow
from .storage import load_param, load_state, store_param, store_state

# The columns of the hyper-parameter table that the kernel reads, where flatopt.rules.ADAMW puts them.
LR = column(ADAMW, "lr")
ONE_MINUS_BETA1 = column(ADAMW, "one_minus_beta1")
BETA2 = column(ADAMW, "beta2")
ONE_MINUS_BETA2 = column(ADAMW, "one_minus_beta2")
LOG_BETA1 = column(ADAMW, "log_beta1")
LOG_BETA2 = column(ADAMW, "log_beta2")
EPS = column(ADAMW, "eps")
WEIGHT_DECAY = column(ADAMW, "weight_decay")
GRAD_SIGN = column(ADAMW, "grad_sign")
NUM_HPARAMS = ADAMW.num_hparams


@triton.jit
def adamw_kernel(
    p_ptr,  # parameters, updated in place
    g_ptr,  # gradients (unscaled in place when HAS_GRAD_SCALE, as torch's fused kernel does)
    m_ptr,  # exp_avg
    v_ptr,  # exp_avg_sq
    m_scale_ptr,  # its scales (8-bit codes, QUANT), or None
    v_scale_ptr,  # its scales (8-bit codes, QUANT), or None
    # then the arguments launch() passes every kernel, in its order (common.py's docstring says what each is)
    hp_ptr, param_of_granule_ptr, param_group_ptr, step_ptr, active_ptr, grad_scale_ptr, found_inf_ptr, counter_ptr,
    src_ptr, start_ptr, numel_ptr, n_elements, param_lo, param_hi, w_ptr, seed, rng_base,
    NUM_HP: tl.constexpr, GRANULE: tl.constexpr, UNIFORM: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK_SIZE: tl.constexpr, STEP_BLOCK: tl.constexpr,
    GATHER: tl.constexpr, GATHER_STORE: tl.constexpr, MASTER: tl.constexpr, STOCHASTIC: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    COMPUTE = hp_ptr.dtype.element_ty  # the math's dtype, the table's: see common.py
    offsets, row, steps, active, inv_scale, skipped = begin_step(
        n_elements, hp_ptr, param_of_granule_ptr, param_group_ptr, step_ptr, active_ptr, grad_scale_ptr,
        found_inf_ptr, param_lo, NUM_HP, GRANULE, UNIFORM, HAS_ACTIVE, HAS_GRAD_SCALE, HAS_FOUND_INF, BLOCK_SIZE,
        GATHER, COMPUTE, QUANT,
    )  # fmt: skip
    lr = tl.load(row + LR)
    omb1 = tl.load(row + ONE_MINUS_BETA1)
    beta2 = tl.load(row + BETA2)
    omb2 = tl.load(row + ONE_MINUS_BETA2)
    log_beta1 = tl.load(row + LOG_BETA1)
    log_beta2 = tl.load(row + LOG_BETA2)
    eps = tl.load(row + EPS)
    weight_decay = tl.load(row + WEIGHT_DECAY)
    grad_sign = tl.load(row + GRAD_SIGN)

    p = load_param(p_ptr, w_ptr, offsets, active, MASTER, COMPUTE)
    g = load_grad(
        g_ptr, offsets, active, inv_scale, HAS_GRAD_SCALE, GATHER, GATHER_STORE, src_ptr, start_ptr, numel_ptr,
        param_of_granule_ptr, n_elements, GRANULE, BLOCK_SIZE, COMPUTE,
    )  # fmt: skip
    m = load_state(m_ptr, m_scale_ptr, offsets, active, GRANULE, QUANT, COMPUTE)
    v = load_state(v_ptr, v_scale_ptr, offsets, active, GRANULE, QUANT, COMPUTE)
    g = g * grad_sign

    t = steps + 1.0
    p = p * (1.0 - lr * weight_decay)
    m = m + omb1 * (g - m)  # torch's lerp(grad, 1 - beta1) for a weight below 0.5
    v = v * beta2 + omb2 * g * g
    step_size = lr / one_minus_pow(log_beta1, t)
    bias_correction2_sqrt = tl.sqrt(one_minus_pow(log_beta2, t))
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p + (-step_size) * (m / denom)

    store_param(p_ptr, w_ptr, offsets, p, active, steps, seed, rng_base, MASTER, STOCHASTIC)
    store_state(m_ptr, m_scale_ptr, offsets, m, active, GRANULE, QUANT)
    store_state(v_ptr, v_scale_ptr, offsets, v, active, GRANULE, QUANT)
    finish_step(counter_ptr, step_ptr, active_ptr, param_lo, param_hi, skipped, UNIFORM, HAS_ACTIVE, STEP_BLOCK)


def adamw_step(param, grad, exp_avg, exp_avg_sq, **launch_args):
    """One AdamW step over a flat buffer; ``launch_args``: see :func:`flatopt.kernels.common.launch`."""
    launch(adamw_kernel, ADAMW, (param, grad, exp_avg, exp_avg_sq), **launch_args)
