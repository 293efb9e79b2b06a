"""Pure-torch reference of every kernel: the ground truth of the tests and the ``"torch"`` backend.

The ``*_math`` functions hold each update rule once. Their hyper-parameters are floats or float32
tensors that broadcast against the data (one value per element when a buffer holds several groups),
the math runs in float32 whatever the storage dtype, and they return the new values without
writing anything. The ``*_step`` functions apply them to a flat buffer with the same arguments as
the Triton launchers in ``flatopt.kernels``.
"""

import torch

from flatopt.kernels.adamw import NUM_HPARAMS as ADAMW_HP
from flatopt.kernels.lion import NUM_HPARAMS as LION_HP
from flatopt.kernels.sgd import NUM_HPARAMS as SGD_HP
from flatopt.layout import ALIGN

__all__ = ["adamw_math", "sgd_math", "lion_math", "adamw_step", "sgd_step", "lion_step"]


def one_minus_pow(log_beta, t):
    """1 - beta**t from log(beta), in float64."""
    return -torch.expm1(torch.as_tensor(t, dtype=torch.float64) * torch.as_tensor(log_beta, dtype=torch.float64))


def adamw_math(p, g, m, v, *, t, lr, beta1, omb1, beta2, omb2, log_beta1, log_beta2, eps, weight_decay, grad_sign):
    """One AdamW update (torch.optim.AdamW's order of operations); ``t`` counts this step."""
    g = g * grad_sign
    p = p * (1.0 - lr * weight_decay)
    m = m + omb1 * (g - m)
    v = v * beta2 + omb2 * g * g
    step_size = (lr / one_minus_pow(log_beta1, t)).float()
    bias_correction2_sqrt = one_minus_pow(log_beta2, t).sqrt().float()
    denom = v.sqrt() / bias_correction2_sqrt + eps
    return p + (-step_size) * (m / denom), m, v


def sgd_math(p, g, buf, *, first, lr, momentum, one_minus_dampening, weight_decay, nesterov, grad_sign):
    """One SGD update (torch.optim.SGD); ``first`` is True where the momentum buffer is not yet set.

    Returns the new parameter and momentum buffer (None when ``buf`` is None).
    """
    d = g * grad_sign + weight_decay * p
    if buf is not None:
        buf = torch.where(first, d, buf * momentum + one_minus_dampening * d)
        with_momentum = torch.where(nesterov != 0, d + momentum * buf, buf)
        d = torch.where(momentum != 0, with_momentum, d)
    return p + (-lr) * d, buf


def lion_math(p, g, m, *, lr, beta1, omb1, beta2, omb2, weight_decay):
    """One Lion update (Chen et al. 2023, decoupled weight decay as in lion-pytorch)."""
    p = p * (1.0 - lr * weight_decay)
    c = m * beta1 + omb1 * g
    p = p + (-lr) * torch.sign(c)
    m = m * beta2 + omb2 * g
    return p, m


def _pieces(meta, hparams, numel):
    """The launch's elements as pieces ``(start, end, hyper-parameters, completed steps, active mask)``.

    UNIFORM: one piece with scalars. Otherwise, on the CPU: one piece per run of consecutive parameters
    sharing param group, step count and active flag, with scalars (inactive runs are left out); the
    host reads the small tables, which costs nothing there. On other devices: one piece whose
    hyper-parameters, steps and mask are given per element, with no host synchronisation. Either way
    every element sees the same float32 values, so the results are identical.
    """
    if meta.uniform:
        return [(0, numel, hparams[meta.param_group[meta.first].long()], meta.steps[meta.first], None)]
    owner = meta.param_of_granule.long()
    if owner.device.type != "cpu":
        pidx = torch.repeat_interleave(owner, ALIGN)[:numel]
        cols = hparams.index_select(0, meta.param_group.long()[pidx]).t()
        active = None if meta.active is None else meta.active.bool()[pidx]
        return [(0, numel, cols, meta.steps[pidx], active)]
    group, steps = meta.param_group.long()[owner], meta.steps[owner]
    active = torch.ones_like(owner, dtype=torch.bool) if meta.active is None else meta.active.bool()[owner]
    change = (group[1:] != group[:-1]) | (steps[1:] != steps[:-1]) | (active[1:] != active[:-1])
    bounds = [0, *(torch.nonzero(change).flatten() + 1).tolist(), owner.numel()]
    return [
        (a * ALIGN, min(b * ALIGN, numel), hparams[group[a]], steps[a], None)
        for a, b in zip(bounds, bounds[1:])
        if active[a]
    ]


def _run(meta, hparams, numel, found_inf, update):
    """Apply ``update(start, end, h, steps)`` (a list of (buffer slice, new value)) to each piece where the
    step applies (not where the piece's mask is off, nor anywhere when ``found_inf``), then advance the
    step counters of the launch's active parameters."""
    ok = None if found_inf is None else found_inf.reshape(()) == 0
    for start, end, h, steps, active in _pieces(meta, hparams, numel):
        keep = active if ok is None else (ok if active is None else active & ok)
        for dst, new in update(start, end, h, steps):
            dst.copy_(new if keep is None else torch.where(keep, new, dst.float()))
    steps = meta.steps[meta.first : meta.stop]
    inc = torch.ones_like(steps)
    if meta.active is not None:
        inc = inc * meta.active[meta.first : meta.stop].float()
    if ok is not None:
        inc = inc * ok.float()
    steps.add_(inc)


def gather(grad, sources, meta):
    """``sources`` (a :class:`flatopt.layout.GradSources`, or None): checked as the kernels check them,
    then each gradient copied into its place in the flat ``grad``, as the kernels' GATHER mode reads them."""
    if sources is None:
        return
    sources.check(meta, grad)
    for start, n, g in zip(sources.start.tolist(), sources.numel.tolist(), sources.tensors):
        if g is not None:
            grad[start : start + n].copy_(g.as_strided((n,), (1,)))  # memory order, as the kernel reads it


def _unscale(grad, grad_scale):
    """The float32 gradient divided by ``grad_scale``, and the (buffer, value) pair to store back:
    torch's fused kernels leave the unscaled gradient in ``.grad`` when they step."""
    g = grad.float()
    if grad_scale is None:
        return g, []
    g = g / grad_scale.reshape(()).float()
    return g, [(grad, g)]


def adamw_step(
    param, grad, exp_avg, exp_avg_sq, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None, sources=None
):
    assert hparams.shape[1] == ADAMW_HP
    gather(grad, sources, meta)

    def update(s, e, h, steps):
        g, store_grad = _unscale(grad[s:e], grad_scale)
        p, m, v = adamw_math(
            param[s:e].float(), g, exp_avg[s:e].float(), exp_avg_sq[s:e].float(), t=steps + 1,
            lr=h[0], beta1=h[1], omb1=h[2], beta2=h[3], omb2=h[4], log_beta1=h[5], log_beta2=h[6],
            eps=h[7], weight_decay=h[8], grad_sign=h[9],
        )  # fmt: skip
        return [(param[s:e], p), (exp_avg[s:e], m), (exp_avg_sq[s:e], v), *store_grad]

    _run(meta, hparams, param.numel(), found_inf, update)


def sgd_step(
    param, grad, momentum_buffer, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None, sources=None
):
    assert hparams.shape[1] == SGD_HP
    gather(grad, sources, meta)

    def update(s, e, h, steps):
        g, store_grad = _unscale(grad[s:e], grad_scale)
        buf = None if momentum_buffer is None else momentum_buffer[s:e].float()
        p, new_buf = sgd_math(
            param[s:e].float(), g, buf, first=steps == 0, lr=h[0], momentum=h[1], one_minus_dampening=h[2],
            weight_decay=h[3], nesterov=h[4], grad_sign=h[5],
        )  # fmt: skip
        writes = [(param[s:e], p), *store_grad]
        if buf is not None:
            writes.append((momentum_buffer[s:e], torch.where(h[1] != 0, new_buf, buf)))
        return writes

    _run(meta, hparams, param.numel(), found_inf, update)


def lion_step(param, grad, exp_avg, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None, sources=None):
    assert hparams.shape[1] == LION_HP
    gather(grad, sources, meta)

    def update(s, e, h, steps):
        g, store_grad = _unscale(grad[s:e], grad_scale)
        p, m = lion_math(
            param[s:e].float(), g, exp_avg[s:e].float(),
            lr=h[0], beta1=h[1], omb1=h[2], beta2=h[3], omb2=h[4], weight_decay=h[5],
        )  # fmt: skip
        return [(param[s:e], p), (exp_avg[s:e], m), *store_grad]

    _run(meta, hparams, param.numel(), found_inf, update)
