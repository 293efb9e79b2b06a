"""Pure-torch reference of every kernel: the ground truth of the tests and the ``"torch"`` backend.

Each update's math lives once, in its rule (``flatopt.rules``; re-exported here as ``adamw_math``,
``sgd_math``, ``lion_math``): hyper-parameters by column name, floats or tensors of the table's dtype that
broadcast against the data (one value per element when a buffer holds several groups), math in float32 for
float32, bfloat16 and float16 buffers and in float64 for float64 ones (:func:`flatopt.layout.compute_dtype`),
new values returned without writing anything. The ``*_step`` functions apply a rule to a flat buffer with the
same arguments as the Triton launchers in ``flatopt.kernels``.
"""

import torch

from flatopt.layout import ALIGN, compute_dtype
from flatopt.precision import check_master, load_param, store_param
from flatopt.quantize import QBLOCK, dequantize, quantize
from flatopt.rules import ADAMW, LION, SGD

adamw_math, sgd_math, lion_math = ADAMW.math, SGD.math, LION.math

__all__ = ["adamw_math", "sgd_math", "lion_math", "adamw_step", "sgd_step", "lion_step"]


def runs(meta, numel):
    """On the CPU: the launch's elements as runs ``(start, end, group, steps)`` of consecutive parameters sharing
    param group (an int, the row of the table), completed steps (a float) and active flag, the inactive runs left
    out. UNIFORM: one run. Host work of a few operations over the launch's parameters (not its elements), then
    Python per run: the parameters of a flat buffer lie in order, so ``meta.param_of_granule`` is non-decreasing
    and each parameter's granules are found by a binary search."""
    if meta.uniform:
        first = meta.first
        return [(0, numel, int(meta.host("param_group")[first]), float(meta.host("steps")[first]))]
    owner = meta.param_of_granule
    if owner.numel() == 0:
        return []
    ids = torch.arange(int(owner[0]), int(owner[-1]) + 1, dtype=owner.dtype, device=owner.device)
    begin = torch.searchsorted(owner, ids)  # each parameter's first granule
    owns = torch.searchsorted(owner, ids, right=True) > begin  # parameters of no element own no granule
    ids, begin = ids[owns].long(), begin[owns]
    group, steps = meta.param_group.long()[ids], meta.steps[ids]
    active = torch.ones_like(ids, dtype=torch.bool) if meta.active is None else meta.active.bool()[ids]
    change = (group[1:] != group[:-1]) | (steps[1:] != steps[:-1]) | (active[1:] != active[:-1])
    firsts = [0, *(torch.nonzero(change).flatten() + 1).tolist()]
    starts = begin[firsts].tolist()
    bounds = [*starts, owner.numel()]
    return [
        (a * ALIGN, min(b * ALIGN, numel), g, st)
        for a, b, g, st, on in zip(bounds, bounds[1:], group[firsts].tolist(), steps[firsts].tolist(),
                                   active[firsts].tolist())
        if on
    ]  # fmt: skip


def _pieces(meta, hparams, numel):
    """The launch's elements as pieces ``(start, end, hyper-parameters, completed steps, active mask)``.

    UNIFORM: one piece with scalars. Otherwise, on the CPU: one piece per run of consecutive parameters
    sharing param group, step count and active flag, with scalars (inactive runs are left out; see
    :func:`runs`); the host reads the small tables, which costs nothing there. On other devices: one piece
    whose hyper-parameters, steps and mask are given per element, with no host synchronisation. Either way
    every element sees the same values of the table, so the results are identical.
    """
    if meta.uniform:
        return [(0, numel, hparams[meta.param_group[meta.first].long()], meta.steps[meta.first], None)]
    owner = meta.param_of_granule.long()
    if owner.device.type != "cpu":
        pidx = torch.repeat_interleave(owner, ALIGN)[:numel]
        cols = hparams.index_select(0, meta.param_group.long()[pidx]).t()
        active = None if meta.active is None else meta.active.bool()[pidx]
        return [(0, numel, cols, meta.steps[pidx], active)]
    return [
        (a, b, hparams[g], torch.tensor(steps, dtype=meta.steps.dtype, device=meta.steps.device), None)
        for a, b, g, steps in runs(meta, numel)
    ]


def _run(meta, hparams, numel, found_inf, update, dtype):
    """Apply ``update(start, end, h, steps)`` (a list of (buffer slice, new value)) to each piece where the
    step applies (not where the piece's mask is off, nor anywhere when ``found_inf``), then advance the
    step counters of the launch's active parameters. ``dtype``: the dtype of the new values."""
    ok = None if found_inf is None else found_inf.reshape(()) == 0
    for start, end, h, steps, active in _pieces(meta, hparams, numel):
        keep = active if ok is None else (ok if active is None else active & ok)
        for dst, new in update(start, end, h, steps):
            rows = keep
            if keep is not None and keep.dim() and keep.numel() != new.numel():  # a scale per QBLOCK elements
                rows = keep.reshape(-1, QBLOCK)[:, 0]
            dst.copy_(new if rows is None else torch.where(rows, new, dst.to(new.dtype)))
    advance_steps(meta, ok)


def advance_steps(meta, ok=None, by=1):
    """Add ``by`` (one; -1 takes it back) to the completed steps of the launch's active parameters (``ok``: a bool
    tensor, False when found_inf skipped the step, or None)."""
    if meta.active is None and ok is None and meta.steps.device.type == "cpu":  # every CPU step: no torch operation
        meta.host("steps")[meta.first : meta.stop] += by
        return
    whole = meta.first == 0 and meta.stop == len(meta.steps)
    steps = meta.steps if whole else meta.steps[meta.first : meta.stop]
    seen = meta.steps_version == meta.steps._version  # no write of the caller's pending: this one is not theirs
    if meta.active is None and ok is None:
        steps.add_(by)
    else:
        inc = torch.full_like(steps, by)
        if meta.active is not None:
            inc = inc * meta.active[meta.first : meta.stop].float()
        if ok is not None:
            inc = inc * ok.float()
        steps.add_(inc)
    if seen:
        meta.steps_version = meta.steps._version


def gather(grad, sources, meta):
    """``sources`` (a :class:`flatopt.layout.GradSources`, or None): checked as the kernels check them,
    then each gradient copied into its place in the flat ``grad``, as the kernels' GATHER mode reads them."""
    if sources is None:
        return
    sources.check(meta, grad)
    for start, n, g in sources.pieces():
        grad[start : start + n].copy_(g.as_strided((n,), (1,)))  # memory order, as the kernel reads it


def _unscale(grad, grad_scale, dtype):
    """The gradient in ``dtype`` (the math's) divided by ``grad_scale``, and the (buffer, value) pair to store
    back: torch's fused kernels leave the unscaled gradient in ``.grad`` when they step."""
    g = grad.to(dtype)
    if grad_scale is None:
        return g, []
    g = g / grad_scale.reshape(()).to(dtype)
    return g, [(grad, g)]


def step(
    rule, param, grad, states, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None, sources=None,
    master=None, rounding_seed=None, rng_base=0, scales=None,
):  # fmt: skip
    """One step of ``rule`` (a :class:`flatopt.rules.Rule`) over the flat ``param``, ``grad`` and ``states`` (in
    ``rule.state_names`` order; None for a state no group uses), with flatopt.kernels.common.launch's
    arguments (``block_size`` is the kernels' and changes nothing here). The math runs in
    ``compute_dtype(param.dtype)``, the dtype of ``hparams``; the states may have another dtype (they are
    upcast, and rounded to nearest when stored). ``master``, ``rounding_seed``, ``rng_base``: see
    :mod:`flatopt.precision` (the master buffer, float32 or int16; stochastic rounding's seed, and the index in
    the whole flat buffer of ``param``'s first element); ``scales``: for 8-bit states, their scales (see
    :mod:`flatopt.quantize`), one per state in ``states``' order."""
    rule.check_table(hparams, param.dtype)
    check_master(param, master, rounding_seed)
    gather(grad, sources, meta)
    dtype = compute_dtype(param.dtype)

    def update(s, e, h, steps):
        g, store_grad = _unscale(grad[s:e], grad_scale, dtype)
        old = [None if x is None else x[s:e].to(dtype) for x in states]
        if scales is not None:
            old = [None if x is None else dequantize(x[s:e], a[s // QBLOCK : e // QBLOCK], x.dtype == torch.int8)
                   for x, a in zip(states, scales)]  # fmt: skip
        w = None if master is None else master[s:e]
        x = param[s:e].to(dtype) if w is None else load_param(param[s:e], w)
        p, *new = rule.math(x, g, *old, steps=steps, **rule.named(h))
        index = None
        if rounding_seed is not None:
            index = torch.arange(s + rng_base, e + rng_base, dtype=torch.int64, device=param.device)
        stored = store_param(param[s:e], w, p, rounding_seed, index, steps)
        if scales is not None:
            for x, a, v in zip(states, scales, new):
                if x is not None:
                    q, absmax = quantize(v, x.dtype == torch.int8)
                    stored += [(x[s:e], q), (a[s // QBLOCK : e // QBLOCK], absmax)]
            return [*stored, *store_grad]
        return [*stored, *((x[s:e], v) for x, v in zip(states, new) if x is not None), *store_grad]

    _run(meta, hparams, param.numel(), found_inf, update, dtype)
    unscaled_back(grad, sources, grad_scale, found_inf)


def unscaled_back(grad, sources, grad_scale, found_inf):
    """After a step that gathered gradients from ``sources`` built with ``store=False`` (their ``.grad`` is where
    they lie) into ``grad`` and unscaled them there: the unscaled gradients go back where they were read, as torch's
    fused kernels leave them in ``.grad`` (and as the Triton kernels write them back)."""
    if sources is None or sources.store or grad_scale is None:
        return
    if found_inf is not None and bool(found_inf.reshape(()) != 0):
        return  # skipped: nothing was unscaled
    for start, n, g in sources.pieces():
        g.as_strided((n,), (1,)).copy_(grad[start : start + n])


def adamw_step(param, grad, exp_avg, exp_avg_sq, **launch_args):
    step(ADAMW, param, grad, (exp_avg, exp_avg_sq), **launch_args)


def sgd_step(param, grad, momentum_buffer, **launch_args):
    step(SGD, param, grad, (momentum_buffer,), **launch_args)


def lion_step(param, grad, exp_avg, **launch_args):
    step(LION, param, grad, (exp_avg,), **launch_args)
