"""SGD with momentum, dampening, Nesterov and weight decay over one flat buffer in one launch.

Same math as ``torch.optim.SGD``, in float32 for float32, bfloat16 and float16 buffers and in float64
for float64 ones (``COMPUTE``). A parameter whose step count is 0 initialises its momentum buffer with
the update itself, as torch does.
"""

import triton
import triton.language as tl

from flatopt.rules import SGD

from .common import as_block, begin_step, column, finish_step, launch, load_grad
from .storage import load_param, load_state, store_param, store_state

# The columns of the hyper-parameter table that the kernel reads, where flatopt.rules.SGD puts them.
LR = column(SGD, "lr")
MOMENTUM = column(SGD, "momentum")
ONE_MINUS_DAMPENING = column(SGD, "one_minus_dampening")
WEIGHT_DECAY = column(SGD, "weight_decay")
NESTEROV = column(SGD, "nesterov")
GRAD_SIGN = column(SGD, "grad_sign")
NUM_HPARAMS = SGD.num_hparams


@triton.jit
def sgd_kernel(
    p_ptr,  # parameters, updated in place
    g_ptr,  # gradients (unscaled in place when HAS_GRAD_SCALE)
    buf_ptr,  # momentum_buffer, or None when no group uses momentum
    buf_scale_ptr,  # its scales (8-bit codes, QUANT), or None
    # then the arguments launch() passes every kernel, in its order (common.py's docstring says what each is)
    hp_ptr, param_of_granule_ptr, param_group_ptr, step_ptr, active_ptr, grad_scale_ptr, found_inf_ptr, counter_ptr,
    src_ptr, start_ptr, numel_ptr, n_elements, param_lo, param_hi, w_ptr, seed, rng_base,
    NUM_HP: tl.constexpr, GRANULE: tl.constexpr, UNIFORM: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK_SIZE: tl.constexpr, STEP_BLOCK: tl.constexpr,
    GATHER: tl.constexpr, GATHER_STORE: tl.constexpr, MASTER: tl.constexpr, STOCHASTIC: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,  # buf_ptr is a buffer (not None)
):  # fmt: skip
    COMPUTE = hp_ptr.dtype.element_ty  # the math's dtype, the table's: see common.py
    offsets, row, steps, active, inv_scale, skipped = begin_step(
        n_elements, hp_ptr, param_of_granule_ptr, param_group_ptr, step_ptr, active_ptr, grad_scale_ptr,
        found_inf_ptr, param_lo, NUM_HP, GRANULE, UNIFORM, HAS_ACTIVE, HAS_GRAD_SCALE, HAS_FOUND_INF, BLOCK_SIZE,
        GATHER, COMPUTE, QUANT,
    )  # fmt: skip
    lr = tl.load(row + LR)
    weight_decay = tl.load(row + WEIGHT_DECAY)
    grad_sign = tl.load(row + GRAD_SIGN)

    p = load_param(p_ptr, w_ptr, offsets, active, MASTER, COMPUTE)
    g = load_grad(
        g_ptr, offsets, active, inv_scale, HAS_GRAD_SCALE, GATHER, GATHER_STORE, src_ptr, start_ptr, numel_ptr,
        param_of_granule_ptr, n_elements, GRANULE, BLOCK_SIZE, COMPUTE,
    )  # fmt: skip
    d = g * grad_sign + weight_decay * p
    if HAS_MOMENTUM:
        momentum = tl.load(row + MOMENTUM)
        one_minus_dampening = tl.load(row + ONE_MINUS_DAMPENING)
        nesterov = tl.load(row + NESTEROV)
        uses_buf = active & (as_block(momentum, offsets) != 0.0)
        buf = load_state(buf_ptr, buf_scale_ptr, offsets, uses_buf, GRANULE, QUANT, COMPUTE)
        buf = tl.where(steps == 0.0, d, buf * momentum + one_minus_dampening * d)
        store_state(buf_ptr, buf_scale_ptr, offsets, buf, uses_buf, GRANULE, QUANT)
        d_momentum = tl.where(nesterov != 0.0, d + momentum * buf, buf)
        d = tl.where(momentum != 0.0, d_momentum, d)
    p = p + (-lr) * d

    store_param(p_ptr, w_ptr, offsets, p, active, steps, seed, rng_base, MASTER, STOCHASTIC)
    finish_step(counter_ptr, step_ptr, active_ptr, param_lo, param_hi, skipped, UNIFORM, HAS_ACTIVE, STEP_BLOCK)


def sgd_step(param, grad, momentum_buffer, **launch_args):
    """One SGD step over a flat buffer; ``momentum_buffer`` is None when no group uses momentum.
    ``launch_args``: see :func:`flatopt.kernels.common.launch`."""
    has_momentum = momentum_buffer is not None
    launch(sgd_kernel, SGD, (param, grad, momentum_buffer), dict(HAS_MOMENTUM=has_momentum), **launch_args)
