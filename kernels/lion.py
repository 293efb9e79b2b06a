"""Lion over one flat buffer in one launch: the update of ``flatopt.rules.lion`` (Chen et al. 2023, decoupled
weight decay as lion-pytorch applies it), in float32 for float32, bfloat16 and float16 buffers and in float64
for float64 ones (``COMPUTE``); the state has the parameter's dtype.
"""

import triton
import triton.language as tl

from flatopt.rules import LION

from .common import begin_step, column, finish_step, launch, load_grad
from .storage import load_param, load_state, store_param, store_state

# The columns of the hyper-parameter table that the kernel reads, where flatopt.rules.LION puts them.
LR = column(LION, "lr")
BETA1 = column(LION, "beta1")
ONE_MINUS_BETA1 = column(LION, "one_minus_beta1")
BETA2 = column(LION, "beta2")
ONE_MINUS_BETA2 = column(LION, "one_minus_beta2")
WEIGHT_DECAY = column(LION, "weight_decay")
NUM_HPARAMS = LION.num_hparams


@triton.jit
def lion_kernel(
    p_ptr,  # parameters, updated in place
    g_ptr,  # gradients (unscaled in place when HAS_GRAD_SCALE)
    m_ptr,  # exp_avg
    m_scale_ptr,  # its scales (8-bit codes, QUANT), or None
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
    beta1 = tl.load(row + BETA1)
    omb1 = tl.load(row + ONE_MINUS_BETA1)
    beta2 = tl.load(row + BETA2)
    omb2 = tl.load(row + ONE_MINUS_BETA2)
    weight_decay = tl.load(row + WEIGHT_DECAY)

    p = load_param(p_ptr, w_ptr, offsets, active, MASTER, COMPUTE)
    g = load_grad(
        g_ptr, offsets, active, inv_scale, HAS_GRAD_SCALE, GATHER, GATHER_STORE, src_ptr, start_ptr, numel_ptr,
        param_of_granule_ptr, n_elements, GRANULE, BLOCK_SIZE, COMPUTE,
    )  # fmt: skip
    m = load_state(m_ptr, m_scale_ptr, offsets, active, GRANULE, QUANT, COMPUTE)

    p = p * (1.0 - lr * weight_decay)
    c = m * beta1 + omb1 * g
    sign = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0))
    p = p + (-lr) * sign
    m = m * beta2 + omb2 * g

    store_param(p_ptr, w_ptr, offsets, p, active, steps, seed, rng_base, MASTER, STOCHASTIC)
    store_state(m_ptr, m_scale_ptr, offsets, m, active, GRANULE, QUANT)
    finish_step(counter_ptr, step_ptr, active_ptr, param_lo, param_hi, skipped, UNIFORM, HAS_ACTIVE, STEP_BLOCK)


def lion_step(param, grad, exp_avg, **launch_args):
    """One Lion step over a flat buffer; ``launch_args``: see :func:`flatopt.kernels.common.launch`."""
    launch(lion_kernel, LION, (param, grad, exp_avg), **launch_args)
