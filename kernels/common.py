"""Pieces shared by every optimizer kernel: the per-element parameter lookup, the step
counter update, and the launch parameters.

Every kernel steps one flat buffer in one launch. After its buffers (``p_ptr``, ``g_ptr``, then its
states) every kernel takes the same arguments, which :func:`launch` passes, in this order:

* ``hp_ptr``: ``[groups, NUM_HP]`` of the ``COMPUTE`` dtype, one row of hyper-parameters per param group, its
  columns where the kernel's rule (``flatopt.rules``) puts them; each kernel reads them by name (:func:`column`).
* ``param_of_granule_ptr``: int32, the index of the parameter that owns each ``GRANULE``-element
  granule of the buffer (parameter starts are ``GRANULE``-aligned, so a granule never spans two).
* ``param_group_ptr``: int32 ``[params]``, the param group (row of ``hparams``) of each parameter.
* ``step_ptr``: float32 ``[params]``, each parameter's number of completed steps.
* ``active_ptr``: uint8 ``[params]`` or None; where 0, the parameter is left untouched this step.
* ``grad_scale_ptr``, ``found_inf_ptr``: float32 ``[1]`` or None, GradScaler's (see load_scale_and_skip).
* ``counter_ptr``: int32 ``[1]``, zero between launches; the last program to finish uses it to
  advance ``steps`` once every program has read them, so the whole step is one launch.
* ``src_ptr``, ``start_ptr``, ``numel_ptr`` (``GATHER``, a launch's ``sources=``, a
  :class:`flatopt.layout.GradSources`): int64 ``[params]``; the gradients are read from each
  parameter's own gradient tensor at ``src`` instead of from the flat gradient buffer, and stored
  into it as the kernel steps (see gather_grad). This saves the read back of a copy into the buffer
  before the step: ``capture()`` steps this way (``benchmarks/profile_step.py`` times it alone). With
  ``GATHER_STORE`` off (sources built with ``store=False``) nothing is stored into the buffer: the step
  reads each gradient where it lies and leaves it there (unscaled in place under ``HAS_GRAD_SCALE``).
* ``n_elements``: the length of the flat buffers.
* ``param_lo``, ``param_hi``: the launch steps parameters ``[param_lo, param_hi)`` of the buffer.
  ``param_of_granule`` holds absolute parameter indices, so a launch over a slice of the buffer
  (in-backward mode steps one bucket of consecutive parameters at a time) passes the slice of
  ``param_of_granule`` and the whole ``param_group``/``steps``/``active`` tables.
* ``w_ptr``, ``seed``, ``rng_base`` (see :mod:`flatopt.precision`): the master buffer (``MASTER`` 1: float32
  master copy; 2: int16 remainders; 0: None), stochastic rounding's seed (read when ``STOCHASTIC``) and the
  index of the launch's first element in its whole flat buffer (the random bits' counter). See
  load_param and store_param.
* the compile-time ``NUM_HP``, ``GRANULE``, ``UNIFORM``, ``HAS_ACTIVE``, ``HAS_GRAD_SCALE``,
  ``HAS_FOUND_INF``, ``BLOCK_SIZE``, ``STEP_BLOCK``, ``GATHER``, ``GATHER_STORE``, ``MASTER`` and ``STOCHASTIC``,
  passed by name.

The states may have another float dtype than the parameters (``state_dtype``): each kernel loads them
``.to(COMPUTE)`` and stores them ``.to(their dtype)``, rounded to nearest even.

The update math runs in the dtype of the hyper-parameter table, ``COMPUTE = hp_ptr.dtype.element_ty`` in
each kernel: :func:`launch` checks that it is float64 for float64 buffers and float32 for float32, bfloat16
and float16 ones (:func:`flatopt.layout.compute_dtype`), which are upcast after loading and rounded back
to their dtype when stored. So the rows need no conversion, and each buffer dtype compiles its own kernel.

``UNIFORM`` buffers (one param group, equal steps, no ``active`` mask) read those scalars once
per program instead of per element.
"""

import torch
import triton
import triton.language as tl

from flatopt import precision
from flatopt.layout import ALIGN as GRANULE  # elements per param_of_granule entry: parameter starts align to it

from .storage import check_scales

# Elements of each buffer per program, whatever the dtype: 16 KiB of float32, 8 KiB of bfloat16/float16
# (32 KiB of float64).
# On an H100 (benchmarks/profile_step.py), 8192 bf16 elements per program (16 KiB, as float32 has) ran
# AdamW at 93.5-95.5 % of the floor where 4096 ran at 97.7-99.3 %; bf16 SGD was within 0.5 % either way.
BLOCK_SIZE = 4096
NUM_WARPS = 8
STEP_BLOCK = 1024  # step counters advanced per block (by every program in a UNIFORM launch, else by the last)


def column(rule, name):
    """The index of column ``name`` of ``rule``'s hyper-parameter table (a :class:`flatopt.rules.Rule`), as a
    constant the kernels can read: ``LR = column(ADAMW, "lr")``, then ``tl.load(row + LR)``."""
    return tl.constexpr(rule.columns.index(name))


@triton.jit
def load_param_meta(
    offsets,  # int64 element offsets of this program
    mask,  # offsets < n_elements
    param_of_granule_ptr,  # int32 [n_elements // GRANULE]
    param_group_ptr,  # int32 [n_params]
    step_ptr,  # float32 [n_params], completed steps
    active_ptr,  # uint8 [n_params] or None
    param_lo,  # first parameter of this launch (UNIFORM reads its group and steps)
    GRANULE: tl.constexpr,
    UNIFORM: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    """Returns (group row, completed steps, active) for each element (scalars when UNIFORM)."""
    if UNIFORM:
        group = tl.load(param_group_ptr + param_lo)
        steps = tl.load(step_ptr + param_lo)
        active = mask
    else:
        pidx = tl.load(param_of_granule_ptr + offsets // GRANULE, mask=mask, other=0)
        group = tl.load(param_group_ptr + pidx, mask=mask, other=0)
        steps = tl.load(step_ptr + pidx, mask=mask, other=0.0)
        active = mask
        if HAS_ACTIVE:
            active = mask & (tl.load(active_ptr + pidx, mask=mask, other=0) != 0)
    return group, steps, active


@triton.jit
def load_scale_and_skip(
    grad_scale_ptr,  # float32 [1] or None: gradients are divided by it (GradScaler)
    found_inf_ptr,  # float32 [1] or None: when non-zero the whole step is skipped
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    COMPUTE: tl.constexpr,  # the math's dtype
):
    """Returns (inverse grad scale in COMPUTE, skipped as 0.0/1.0)."""
    inv_scale = 1.0
    if HAS_GRAD_SCALE:
        inv_scale = 1.0 / tl.load(grad_scale_ptr).to(COMPUTE)
    skipped = 0.0
    if HAS_FOUND_INF:
        skipped = (tl.load(found_inf_ptr).to(tl.float32) != 0.0).to(tl.float32)
    return inv_scale, skipped


@triton.jit
def as_block(x, offsets):
    """``x`` (a float32 scalar or block) as a block shaped like ``offsets``. Needed before a scalar
    condition is ANDed into a block mask: the interpreter cannot broadcast a scalar bool; the
    compiler folds this away."""
    return tl.zeros_like(offsets).to(tl.float32) + x


@triton.jit
def drop_if_skipped(active, offsets, skipped):
    """``active`` where this step is not skipped."""
    return active & (as_block(skipped, offsets) == 0.0)


@triton.jit
def begin_step(
    n_elements,  # length of the flat buffers
    hp_ptr,  # [groups, NUM_HP], of the COMPUTE dtype
    param_of_granule_ptr,
    param_group_ptr,
    step_ptr,
    active_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    param_lo,
    NUM_HP: tl.constexpr,
    GRANULE: tl.constexpr,
    UNIFORM: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GATHER: tl.constexpr,
    COMPUTE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """What every kernel starts with. Returns this program's element offsets, the pointer to each
    element's row of the hyper-parameter table, its completed steps, where the step applies
    (``active``: in bounds, parameter active, no inf found), the inverse grad scale and whether
    found_inf skips the step. With GATHER (non-zero: the gradients are gathered, in loads of GATHER
    elements; see gather_grad) or QUANT (8-bit states, a scale per granule: see store_state) the offsets are a
    [BLOCK_SIZE // GRANULE, GRANULE] block, one granule per row; the kernels' elementwise code is the same
    for both."""
    pid = tl.program_id(0).to(tl.int64)
    if GATHER:
        offsets = granule_rows(pid, BLOCK_SIZE, GRANULE)
    elif QUANT:
        offsets = granule_rows(pid, BLOCK_SIZE, GRANULE)
    else:
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    group, steps, active = load_param_meta(
        offsets, mask, param_of_granule_ptr, param_group_ptr, step_ptr, active_ptr, param_lo, GRANULE, UNIFORM,
        HAS_ACTIVE,
    )  # fmt: skip
    inv_scale, skipped = load_scale_and_skip(grad_scale_ptr, found_inf_ptr, HAS_GRAD_SCALE, HAS_FOUND_INF, COMPUTE)
    if HAS_FOUND_INF:
        active = drop_if_skipped(active, offsets, skipped)
    row = hp_ptr + group * NUM_HP  # always in bounds: masked lanes read group 0
    return offsets, row, steps, active, inv_scale, skipped


@triton.jit
def granule_rows(pid, BLOCK_SIZE: tl.constexpr, GRANULE: tl.constexpr):
    """Program ``pid``'s element offsets as a [BLOCK_SIZE // GRANULE, GRANULE] block, one granule per row."""
    granules = pid * (BLOCK_SIZE // GRANULE) + tl.arange(0, BLOCK_SIZE // GRANULE)
    return granules[:, None] * GRANULE + tl.arange(0, GRANULE)[None, :]


@triton.jit
def load_grad(
    g_ptr, offsets, active, inv_scale, HAS_GRAD_SCALE: tl.constexpr, GATHER: tl.constexpr, GATHER_STORE: tl.constexpr,
    src_ptr, start_ptr, numel_ptr, param_of_granule_ptr, n_elements, GRANULE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    COMPUTE: tl.constexpr,
):  # fmt: skip
    """The gradient in the COMPUTE dtype, divided by the grad scale and stored back unscaled (as torch's fused
    kernels leave it) when HAS_GRAD_SCALE. With GATHER it is read from each parameter's own
    gradient tensor (gather_grad) and, with GATHER_STORE, stored into the flat gradient buffer: every element,
    also where the step does not apply (an inactive parameter, a step skipped by found_inf), which gets
    the gradient as read, as a copy into the buffer before the step would have left it. Without GATHER_STORE
    the buffer is not written: under HAS_GRAD_SCALE the unscaled gradient goes back where it was read."""
    if GATHER:
        in_bounds = offsets < n_elements
        g, where, inside = gather_grad(
            offsets, in_bounds, src_ptr, start_ptr, numel_ptr, param_of_granule_ptr, n_elements, GRANULE, BLOCK_SIZE,
            g_ptr.dtype.element_ty, GATHER, COMPUTE,
        )  # fmt: skip
        stored = g
        if HAS_GRAD_SCALE:
            g = g * inv_scale
            stored = tl.where(active, g, stored)
            if not GATHER_STORE:
                tl.store(where, g.to(g_ptr.dtype.element_ty), mask=inside & active)
        if GATHER_STORE:
            tl.store(g_ptr + offsets, stored.to(g_ptr.dtype.element_ty), mask=in_bounds)
    else:
        g = tl.load(g_ptr + offsets, mask=active).to(COMPUTE)
        if HAS_GRAD_SCALE:
            g = g * inv_scale
            tl.store(g_ptr + offsets, g.to(g_ptr.dtype.element_ty), mask=active)
    return g


@triton.jit
def gather_grad(
    offsets, in_bounds, src_ptr, start_ptr, numel_ptr, param_of_granule_ptr, n_elements, GRANULE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DTYPE: tl.constexpr, VEC: tl.constexpr, COMPUTE: tl.constexpr,
):  # fmt: skip
    """The gradient of each element of a GATHER block ([BLOCK_SIZE // GRANULE, GRANULE], one granule
    per row; a granule belongs to one parameter) in the COMPUTE dtype, read from where the parameter's
    gradient lies instead of from the flat buffer: ``src[i]``, the address of parameter i's
    gradient (contiguous, of the buffer's dtype, 16-byte aligned), whose element k is the buffer's
    element ``start[i] + k`` for k < ``numel[i]``. Lanes past the parameter's end (the alignment
    padding) read 0. ``VEC`` > 1 promises that every ``numel[i]`` is a multiple of it (16 bytes'
    worth of elements): the compiler then loads 16 bytes at a time (checked in the sm_90 PTX: 4 x
    fp32 or 8 x bf16 per load, where an element-exact mask gives single-element loads). Returns the
    gradient, the addresses read and the mask of the lanes read (the padding's are off)."""
    pid = tl.program_id(0).to(tl.int64)
    granules = pid * (BLOCK_SIZE // GRANULE) + tl.arange(0, BLOCK_SIZE // GRANULE)
    in_buffer = granules * GRANULE < n_elements
    param = tl.load(param_of_granule_ptr + granules, mask=in_buffer, other=0)
    src = tl.load(src_ptr + param, mask=in_buffer, other=0).to(tl.pointer_type(DTYPE))
    start = tl.load(start_ptr + param, mask=in_buffer, other=0)
    numel = tl.load(numel_ptr + param, mask=in_buffer, other=0)
    into = tl.multiple_of(granules * GRANULE - start, GRANULE)  # where the row starts in the gradient
    lane = tl.arange(0, GRANULE)[None, :]
    limit = numel - into  # lanes of the row inside the parameter
    if VEC > 1:  # every numel is a multiple of VEC, so the mask is constant over VEC lanes: vector loads
        limit = tl.multiple_of(limit, VEC)
    inside = in_bounds & (lane < limit[:, None])
    where = tl.multiple_of(src + into, 16)[:, None] + lane
    return tl.load(where, mask=inside, other=0.0).to(COMPUTE), where, inside


@triton.jit
def one_minus_pow(log_beta, steps):
    """1 - beta**steps from log(beta) (computed in float64 on the host), accurate for beta near 1; in the
    dtype of ``log_beta`` (the table's: float64 for float64 buffers), as ``steps`` (float32) is promoted to it.

    Uses Kahan's expm1(x) = (u - 1) * x / log(u) with u = exp(x), which cancels the rounding of exp.
    """
    x = steps * log_beta
    u = tl.exp(x)
    em1 = tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(u))
    em1 = tl.where(u == 0.0, -1.0, em1)
    return -em1


@triton.jit
def advance_steps(
    step_ptr, active_ptr, start, stop, first_block, block_stride, inc, HAS_ACTIVE: tl.constexpr,
    STEP_BLOCK: tl.constexpr,
):  # fmt: skip
    """steps[i] += inc (times active[i] when HAS_ACTIVE) for i in [start, stop), in blocks of STEP_BLOCK:
    blocks first_block, first_block + block_stride, ... (block indices, so no product overflows int32)."""
    for b in range(first_block, tl.cdiv(stop - start, STEP_BLOCK), block_stride):
        idx = start + b * STEP_BLOCK + tl.arange(0, STEP_BLOCK)
        m = idx < stop
        d = inc
        if HAS_ACTIVE:
            d = d * (tl.load(active_ptr + idx, mask=m, other=0) != 0).to(tl.float32)
        s = tl.load(step_ptr + idx, mask=m, other=0.0)
        tl.store(step_ptr + idx, s + d, mask=m)


@triton.jit
def finish_step(
    counter_ptr,  # int32 [1], zero on entry to the launch
    step_ptr,  # float32 [n_params]
    active_ptr,  # uint8 [n_params] or None
    param_lo,  # this launch steps parameters [param_lo, param_hi)
    param_hi,
    skipped,  # 1.0 when found_inf skipped this step
    UNIFORM: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    STEP_BLOCK: tl.constexpr,
):
    """Advance the step count of every active parameter of the launch, once every program has read
    the counts it needs, and re-zero the counter.

    The last program to finish does it. The increment of ``counter`` is made by one thread of the
    program, so a barrier first waits for every warp of the program to reach this point: each
    warp's reads of the step counters have completed by then (the values it stored depend on them).
    The last program writes the counters only after seeing every program's increment, so no program
    reads an advanced count. Nothing a program stores is read by another, so the increment needs no
    release fence: a relaxed atomic, which keeps thousands of programs from each waiting on a fence.

    A UNIFORM launch reads only ``steps[param_lo]``, so the programs advance the other counts
    themselves, a block of ``STEP_BLOCK`` each, and the last program only ``steps[param_lo]``: the
    launch does not end with one program walking thousands of counts.
    """
    inc = 1.0 - skipped
    if UNIFORM:  # program p advances blocks p, p + programs, ... of [param_lo + 1, param_hi)
        advance_steps(
            step_ptr, active_ptr, param_lo + 1, param_hi, tl.program_id(0), tl.num_programs(0), inc, HAS_ACTIVE,
            STEP_BLOCK,
        )  # fmt: skip
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="relaxed")
    if done == tl.num_programs(0) - 1:
        stop = param_lo + 1 if UNIFORM else param_hi
        advance_steps(step_ptr, active_ptr, param_lo, stop, 0, 1, inc, HAS_ACTIVE, STEP_BLOCK)
        tl.atomic_xchg(counter_ptr, 0)


def launch_meta(n_elements, block_size=None):
    """Grid and launch options shared by the launchers: each program steps BLOCK_SIZE elements."""
    block = block_size or BLOCK_SIZE
    grid = (triton.cdiv(n_elements, block),)
    return grid, dict(BLOCK_SIZE=block, STEP_BLOCK=STEP_BLOCK, GRANULE=GRANULE, num_warps=NUM_WARPS)


def check_flat(meta, *tensors, states=()):
    """The launchers' argument checks: 1-D, contiguous, one device, equal lengths, one dtype (``states`` may have
    another float dtype), and a length that is a multiple of GRANULE when the kernel looks parameters up by granule
    (``meta.uniform`` is False). A UNIFORM launch reads no ``param_of_granule`` and masks by ``n_elements``, so it
    takes any length (``flat=False`` steps each parameter's own tensor that way)."""
    first = tensors[0]
    for t in (*tensors, *states):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"flat buffers must be 1-D and contiguous, got shape {tuple(t.shape)}")
        own_dtype = t.dtype if any(t is s for s in states) else first.dtype  # states: a float dtype, or codes
        if t.device != first.device or t.numel() != first.numel() or t.dtype != own_dtype:
            raise ValueError(
                "flat buffers must share device, dtype and length: "
                f"{first.device}/{first.dtype}/{first.numel()} vs {t.device}/{t.dtype}/{t.numel()}"
            )
    if not meta.uniform and first.numel() % GRANULE:
        raise ValueError(f"flat buffer length {first.numel()} is not a multiple of GRANULE={GRANULE}")


def launch(
    kernel, rule, buffers, constexprs=None, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None,
    sources=None, master=None, rounding_seed=None, rng_base=0, scales=None,
):  # fmt: skip
    """Check and launch ``kernel``, the kernel of ``rule`` (a :class:`flatopt.rules.Rule`), over the flat
    ``buffers``: parameter, gradient, then the rule's states (None for a state no param group uses).
    ``constexprs``: the kernel's own compile-time arguments. The keyword arguments are every launcher's:

    * ``hparams``: the ``[groups, rule.num_hparams]`` table, a ``rule.row(group)`` per param group: float32, or
      float64 for float64 buffers (see :meth:`flatopt.rules.Rule.check_table`).
    * ``meta``: the buffer's :class:`flatopt.layout.StepMeta`.
    * ``grad_scale``, ``found_inf``: GradScaler's float32 ``[1]`` tensors, or None.
    * ``block_size``: elements per program (None: BLOCK_SIZE).
    * ``sources``: a :class:`flatopt.layout.GradSources`, to read each parameter's gradient from where it
      lies instead (GATHER; see gather_grad), storing it into the flat gradient buffer unless the sources were
      built with ``store=False`` (GATHER_STORE).
    * ``master``, ``rounding_seed``, ``rng_base``: the master buffer (float32 or int16), stochastic rounding's
      seed (None: round to nearest) and the launch's first element's index in its whole flat buffer (see
      :mod:`flatopt.precision`).
    * ``scales``: for 8-bit states (int8 or uint8 codes), one float32 scale buffer per state, a scale per GRANULE
      elements (:mod:`flatopt.quantize`); None for float states.
    """
    param = buffers[0]
    rule.check_table(hparams, param.dtype)
    check_flat(meta, *buffers[:2], states=[b for b in buffers[2:] if b is not None])
    precision.check_master(param, master, rounding_seed)
    states = buffers[2:]
    check_scales(states, scales, param.numel(), GRANULE)
    if sources is not None:
        sources.check(meta, buffers[1])
        if (block_size or BLOCK_SIZE) % GRANULE:
            raise ValueError(f"a launch that gathers its gradients needs a block size that is a multiple of {GRANULE}")
    grid, opts = launch_meta(param.numel(), block_size)
    kernel[grid](
        *buffers, *(scales if scales is not None else [None] * len(states)), hparams,
        meta.param_of_granule, meta.param_group, meta.steps, meta.active,
        grad_scale, found_inf, meta.counter,
        *(sources.tables() if sources is not None else (None, None, None)),
        param.numel(), meta.first, meta.stop,
        master, 0 if rounding_seed is None else rounding_seed, rng_base,
        NUM_HP=rule.num_hparams, UNIFORM=meta.uniform, HAS_ACTIVE=meta.active is not None,
        HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        GATHER=0 if sources is None else sources.vec, GATHER_STORE=sources is None or sources.store,
        MASTER=0 if master is None else 1 if master.dtype == torch.float32 else 2,
        STOCHASTIC=rounding_seed is not None, QUANT=scales is not None,
        **(constexprs or {}), **opts,
    )  # fmt: skip
