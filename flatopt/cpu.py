"""The CPU backend (``backend="cpu"``, the default for CPU parameters): each launch over flat buffers steps in
place, one call per piece, with no full-size temporaries.

A piece is a run of consecutive parameters sharing param group, step count and active flag
(:func:`flatopt.reference.runs`; one piece for a buffer with one group, equal steps and every parameter active),
so the hyper-parameters and the step count of a piece are scalars read on the host, where reading them costs
nothing. Each piece is stepped by:

* AdamW: ``torch._fused_adamw_``, the vectorised, multi-threaded kernel of ``torch.optim.AdamW(fused=True)`` on the
  CPU, over the piece's slices of the flat buffers (float32, bfloat16, float16, float64: it upcasts to float32 as
  flatopt's rule does, and computes float64 in float64).
* SGD: ``torch._fused_sgd_`` where it steps the buffer's dtype right (:func:`fused_sgd_steps`, checked once per
  dtype: float32 and float64). torch 2.13's CPU kernel for bfloat16 and float16 stores no parameter in its
  vectorised loop, so most parameters would not move. Those buffers are stepped by two or three in-place
  ``addcmul`` passes (:func:`_sgd_low_precision`: each computes in float32 with its scalar in float32 and rounds
  once) where the group has no dampening, no Nesterov momentum, no ``maximize`` and no ``grad_scale``; otherwise a
  chunk at a time by the float32 kernel over float32 copies (the chunked path below), which rounds once as the
  rule does.
* Lion: the chunked path (torch has no Lion kernel). A chunk's gradient is read where it lies when one gradient
  (a slice of the flat buffer, or a gradient step() reads in place) holds it, and gathered into a scratch buffer
  when the chunk spans several.

The chunked path steps ``CHUNK`` elements at a time with torch's in-place operations, the temporaries being
scratch buffers of one chunk, reused, that stay in the cache: each element is read from memory and written back
once, as a fused kernel does. bfloat16 and float16 chunks are upcast into float32 scratch buffers, computed in float32,
and rounded once when stored.

Buffers stored with fewer bytes (a master buffer, stochastic rounding, states of another dtype than the parameters:
see :mod:`flatopt.precision`) are stepped by the pure-torch reference (:mod:`flatopt.reference`), which computes
them exactly as the kernels do: torch's fused CPU kernels take states of the parameters' dtype only.

The arguments are those of the Triton launchers (:mod:`flatopt.kernels`) and of :mod:`flatopt.reference`; the math
is the rule's (:mod:`flatopt.rules`), with the single roundings in a different order (an FMA where the reference
rounds a product first): the results agree with the reference to the tests' tolerances, not bit for bit.
GradScaler's ``found_inf`` skips the whole launch (read on the host), ``grad_scale`` leaves the unscaled
gradients in ``grad`` (and in the gradients read in place) as torch's fused kernels do; the step counts advance as
the reference advances them, before the pieces run (each piece was given its count), and go back if one raises.
"""

import bisect
import functools
import math
import threading
import weakref

import torch

from flatopt import reference
from flatopt.layout import compute_dtype
from flatopt.reference import advance_steps, gather, runs
from flatopt.rules import ADAMW, LION, SGD

__all__ = ["adamw_step", "sgd_step", "lion_step", "CHUNK"]

# Elements per chunk of the chunked path: 512 KiB of float32 per scratch buffer, a chunk's tensors and temporaries
# (2 MiB for float32 Lion, 3.5 MiB for bfloat16 Lion with its upcast copies) small enough to stay in the caches
# between its operations, large enough that each operation's fixed cost (dispatch, a parallel region: tens of
# microseconds with 2 threads) is small against its work. On a 2-core Intel Xeon (2 MiB L2 per core), a GPT-2-style
# 4.3M-parameter model's training loop with Lion (step times, in one process per chunk size): bfloat16 5.6 ms in
# 128K-element chunks, 6.2 in 256K, 6.9 in 512K; float32 4.3, 4.3 and 4.9; 14M parameters, bfloat16 19.3 ms in 128K
# and 23.0 in 512K. On a 2-core AMD EPYC (1 MiB L2 per core, 32 MiB L3), 14M-element float32 Lion took 18 ms in
# 64K-element chunks, 12.5 in 256K and 1M, 24 in 4M; 14M-element bfloat16 SGD with momentum (the chunked path) 16.5
# ms in 64K, 8.7 in 256K, 6.3-7.4 in 512K.
CHUNK = 1 << 17

_scratch = threading.local()


def _scratch_buffers(dtype, count):
    """``count`` scratch buffers of CHUNK elements of ``dtype``, kept per thread and reused at every launch."""
    have = getattr(_scratch, "buffers", None)
    if have is None:
        have = _scratch.buffers = {}
    bufs = have.get(dtype)
    if bufs is None or len(bufs) < count or bufs[0].numel() != CHUNK:
        bufs = have[dtype] = [torch.empty(CHUNK, dtype=dtype, device="cpu") for _ in range(count)]
    return bufs[:count]


def _check(rule, param, grad, states, hparams, meta):
    """What the in-place calls need of the buffers, checked before anything changes (once per set of tensors: weak
    references to the tensors last checked are kept in ``meta.checked``, and a launch with the same objects is not
    checked again; the step engine's launches, over its buffers, are such launches. A weak reference does not keep a
    gradient alive that its engine frees: in-backward buckets, ``flat=False``, a caller's tensors)."""
    seen = (param, grad, *states, hparams)
    last = meta.checked
    if last is not None and last[0] is rule and len(last) == len(seen) + 1:
        if all(ref is None if t is None else ref is not None and ref() is t for ref, t in zip(last[1:], seen)):
            return
    rule.check_table(hparams, param.dtype)
    named = [("param", param), ("grad", grad), *((n, t) for n, t in zip(rule.state_names, states) if t is not None)]
    for name, t in named:
        if t.device.type != "cpu":
            raise ValueError(
                f"backend='cpu' steps CPU tensors, and {name} is on {t.device}; use backend='triton' for CUDA "
                "tensors (the default there)"
            )
        if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(
                f"backend='cpu' steps flat, contiguous 1-D buffers in place; {name} has shape {tuple(t.shape)} and "
                f"strides {t.stride()}: pass a 1-D view with stride 1 (a flat buffer or a slice of one)"
            )
        if t.dtype != param.dtype or t.numel() != param.numel():
            raise ValueError(
                f"backend='cpu': {name} is {t.dtype} of {t.numel()} elements, the parameters {param.dtype} of "
                f"{param.numel()}; every buffer of a launch has the parameters' dtype and length"
            )
    meta.checked = (rule, *(None if t is None else weakref.ref(t) for t in seen))


def _step(rule, param, grad, states, *, hparams, meta, grad_scale, found_inf, sources):
    """Check, gather the gradients from ``sources`` (as the reference does; with ``sources.store`` False, only
    those :func:`_in_place` leaves where they lie), then step the pieces (:func:`_run`)."""
    _check(rule, param, grad, states, hparams, meta)
    piece, flat = _piece_of(rule, param.dtype)
    _run(rule, piece, param, grad, states, hparams, meta, _in_place(grad, sources, meta, flat), grad_scale, found_inf)


def step_own(rule, param, grad, states, *, hparams, meta, own):
    """One launch of ``rule`` over flat buffers whose gradients of their own ``own`` (``[(start, end, tensor)]`` in
    buffer order, each tensor of its parameter's shape and strides) are read where they lie, the others' from
    ``grad``: what the ``*_step`` functions do with ``store=False`` sources, no ``grad_scale`` nor ``found_inf``,
    for buffers :func:`steps_fused` accepts (the step engine's CPU lane: flatopt.engines.cpu_lane)."""
    _check(rule, param, grad, states, hparams, meta)
    piece, flat = _piece_of(rule, param.dtype)
    own = [(s, e, _memory_order(g, e - s, flat)) for s, e, g in own]
    _run(rule, piece, param, grad, states, hparams, meta, own, None, None)


def steps_fused(rule, param, states, precision):
    """Whether the parameters and ``states`` of a launch (``precision``: its master buffer, rounding seed and scales,
    as the launchers take them) are stepped by this backend's own pieces, not by the reference."""
    return not _compact(param, states, precision) and _piece_of(rule, param.dtype)[0] is not None


def _run(rule, piece, param, grad, states, hparams, meta, own, grad_scale, found_inf):
    """Advance the step counts, then call ``piece(meta, param, states, segments, h, steps, grad_scale)`` for each
    active piece unless ``found_inf`` skips the launch. ``segments``: the piece as ``(start, end, gradient)`` runs,
    the gradient a slice of ``grad`` or one of ``own`` (see :func:`_in_place`); ``h``: the piece's row by column
    name, floats; ``steps``: its completed steps. A piece that raises leaves the step counts as they were."""
    ok = None if found_inf is None else found_inf.reshape(()) == 0
    pieces = []
    if ok is None or bool(ok):
        if grad_scale is not None:
            grad_scale = grad_scale.reshape(()).to("cpu")
        rows = hparams.tolist()
        pieces = [(a, b, rule.named(rows[group]), steps) for a, b, group, steps in runs(meta, param.numel()) if b > a]
    # the counts advance before the pieces run (each piece was given its count above): the first operations after a
    # kernel that streamed the buffers through the caches cost several times what they cost before it
    advance_steps(meta, ok)
    try:
        for start, end, h, steps in pieces:
            piece(meta, param, states, _segments(meta, start, end, grad, own), h, steps, grad_scale)
    except BaseException:
        advance_steps(meta, ok, -1)
        raise


def _piece_of(rule, dtype):
    """(piece, flat): the function that steps a piece of ``rule`` over buffers of ``dtype`` (None: no torch kernel
    steps them as the rule does, and the reference steps them), and whether it takes 1-D gradients (else contiguous
    ones of any shape: torch's fused kernels read their tensors' memory in order)."""
    if rule is ADAMW:
        return _adamw_piece, False
    if rule is LION:
        return _lion_piece, True
    if rule is not SGD:
        return None, True
    if fused_sgd_steps(dtype):
        return _sgd_fused_piece, False
    if fused_sgd_steps(compute_dtype(dtype)):
        return _sgd_chunked_piece, True
    return None, True  # no torch kernel steps as the rule does, for the buffers nor for their math's dtype


def _in_place(grad, sources, meta, flat=True):
    """The gradients read where they lie, ``[(start, end, tensor)]`` in buffer order (1-D in memory order, or with
    ``flat`` False the tensor itself where it is contiguous): with ``sources.store`` False, every source tensor
    (checked as the reference checks them); otherwise none, the sources gathered into ``grad`` first, as the
    reference and the kernels store them."""
    if sources is None or sources.store:
        gather(grad, sources, meta)
        return []
    sources.check(meta, grad)
    return [(start, start + n, _memory_order(g, n, flat)) for start, n, g in sources.pieces() if n > 0]


def _memory_order(g, n, flat):
    """Gradient ``g`` (``n`` elements, dense) as the pieces read it: its memory in order, 1-D where ``flat``; a
    contiguous one as it is where the piece takes any shape (torch's fused kernels)."""
    if g.is_contiguous() and (not flat or g.dim() == 1):
        return g
    return g.as_strided((n,), (1,))


SLICES_MAX = 4096  # slices kept per StepMeta, all lists together (a layout's pieces need a few per parameter)


def _slices(meta, segments, tensors):
    """For each of ``tensors`` (the launch's parameters' and states' buffers) its slices over the segments' bounds,
    kept in ``meta.cuts`` for the next step with the same bounds (a slice costs about a microsecond of host time,
    and a step takes a few per parameter read in place). An entry holds the tensors themselves, so their ``id`` is
    not reused while it lives; the buffers are the launch's, which the meta describes. For the parameters' and the
    states' buffers only, which are never released: a view kept of the gradient buffer would hold its storage.
    At most SLICES_MAX slices are kept, all entries together (the cache starts again when a new entry would pass
    it)."""
    key = (tuple(map(id, tensors)), tuple([s for s, _, _ in segments]), segments[-1][1])
    hit = meta.cuts.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], tensors)):
        return hit[1]
    count = len(segments) * len(tensors)
    _room(meta, count)
    out = [[t[s:e] for s, e, _ in segments] for t in tensors]
    meta.cuts[key] = (tensors, out)
    meta.cut_slices += count
    return out


def _room(meta, count):
    """Make room for ``count`` more slices in ``meta.cuts`` (see SLICES_MAX): all of them dropped when needed."""
    if meta.cut_slices + count > SLICES_MAX:
        meta.cuts.clear()
        meta.cut_slices = 0


def _segments(meta, start, end, grad, own):
    """Elements ``[start, end)`` as ``(s, e, gradient)`` runs: the gradients of ``own`` (sorted, each within one
    piece: a piece is whole parameters) and the slices of ``grad`` between them. The runs' bounds and the slices of
    ``grad`` are kept in ``meta.cuts`` for the next step whose gradients read in place lie at the same offsets,
    where ``grad`` is a buffer that is never released (its storage cannot be resized: a view kept of a gradient
    buffer that zero_grad() releases would hold its storage)."""
    key = ("segments", id(grad), start, end, tuple([s for s, _, _ in own]))
    hit = meta.cuts.get(key)
    if hit is None or hit[0] is not grad:
        hit = _segments_of(start, end, grad, own)
        if grad.untyped_storage().resizable():
            return _fill(hit[1], hit[2], own)
        _room(meta, len(hit[1]))
        meta.cuts[key] = hit
        meta.cut_slices += len(hit[1])
    return _fill(hit[1], hit[2], own)


def _segments_of(start, end, grad, own):
    """(grad, runs, holes): the runs of elements ``[start, end)``, those between the gradients of ``own`` as
    ``(s, e, slice of grad)``, and ``holes``, ``(run index, own index)`` of each run that one of ``own`` fills."""
    runs_, holes, at = [], [], start
    first = bisect.bisect_left(own, (start,)) if own else 0
    for j in range(first, len(own)):
        s, e, _ = own[j]
        if s >= end:
            break
        if s > at:
            runs_.append((at, s, grad[at:s]))
        holes.append((len(runs_), j))
        runs_.append((s, e, None))
        at = e
    if at < end:
        runs_.append((at, end, grad[at:end]))
    return grad, runs_, holes


def _fill(runs_, holes, own):
    out = list(runs_)
    for k, j in holes:
        out[k] = own[j]
    return out


def _compact(param, states, precision):
    """Whether a launch stores with fewer bytes (``precision``: the launchers' ``master``, ``rounding_seed`` and
    ``rng_base``), which the reference steps (see the module docstring)."""
    return (
        precision.get("master") is not None
        or precision.get("rounding_seed") is not None
        or precision.get("scales") is not None
        or any(t is not None and t.dtype != param.dtype for t in states)
    )


def _kernel_scale(grads, grad_scale):
    """The ``grad_scale`` a fused kernel reads (float32), or None after dividing ``grads`` by it here: the reference
    divides by it in the math's dtype, which float32 holds exactly but for a float64 scale of float64 gradients."""
    if grad_scale is None or grad_scale.dtype == torch.float32:
        return grad_scale
    if grads[0].dtype == torch.float64 and grad_scale.dtype == torch.float64:
        torch._foreach_div_(grads, grad_scale)
        return None
    return grad_scale.float()


# ------------------------------------------------------------------------------------------------- AdamW
def adamw_step(param, grad, exp_avg, exp_avg_sq, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None,
               sources=None, **precision):  # fmt: skip
    """One AdamW step over flat buffers (``block_size``: the kernels', ignored here)."""
    if _compact(param, (exp_avg, exp_avg_sq), precision):
        reference.adamw_step(param, grad, exp_avg, exp_avg_sq, hparams=hparams, meta=meta, grad_scale=grad_scale,
                                    found_inf=found_inf, sources=sources, **precision)  # fmt: skip
        return
    _step(ADAMW, param, grad, (exp_avg, exp_avg_sq), hparams=hparams, meta=meta, grad_scale=grad_scale,
          found_inf=found_inf, sources=sources)  # fmt: skip


def _adamw_piece(meta, param, states, segments, h, steps, scale):
    exp_avg, exp_avg_sq = states
    grads = [g for _, _, g in segments]
    params, avgs, avg_sqs = _slices(meta, segments, (param, exp_avg, exp_avg_sq))
    # The kernel computes the bias corrections 1 - beta**t in float64 from the betas it is given: betas
    # rebuilt from the table's logarithms, as the rule computes them (a float32 table's beta2 = 0.999 is off by
    # 1.3e-8, which 1 - beta2**3 = 0.003 would magnify to 1.3e-5)
    torch._fused_adamw_(
        params, grads, avgs, avg_sqs, [], [torch.tensor(steps + 1.0, device="cpu")] * len(segments),
        lr=h["lr"], beta1=math.exp(h["log_beta1"]), beta2=math.exp(h["log_beta2"]),
        weight_decay=h["weight_decay"], eps=h["eps"], amsgrad=False, maximize=h["grad_sign"] < 0,
        grad_scale=_kernel_scale(grads, scale),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------- SGD
def sgd_step(param, grad, momentum_buffer, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None,
             sources=None, **precision):  # fmt: skip
    """One SGD step over flat buffers (``block_size``: the kernels', ignored here)."""
    if not steps_fused(SGD, param, (momentum_buffer,), precision):  # the reference (see the module docstring)
        reference.sgd_step(param, grad, momentum_buffer, hparams=hparams, meta=meta, grad_scale=grad_scale,
                                  found_inf=found_inf, sources=sources, **precision)  # fmt: skip
        return
    _step(SGD, param, grad, (momentum_buffer,), hparams=hparams, meta=meta, grad_scale=grad_scale,
          found_inf=found_inf, sources=sources)  # fmt: skip


def _sgd_momentum(states, h):
    """The momentum a piece steps with: none where its group has none, or where no group has one (no buffer), the
    rule leaving the buffer alone."""
    return h["momentum"] if states[0] is not None else 0.0


def _sgd_fused_piece(meta, param, states, segments, h, steps, scale):
    """One ``torch._fused_sgd_`` call for the piece (buffers whose dtype it steps as the rule does)."""
    momentum = _sgd_momentum(states, h)
    if momentum != 0.0:
        params, bufs = _slices(meta, segments, (param, states[0]))
    else:
        (params,), bufs = _slices(meta, segments, (param,)), []
    _fused_sgd(params, [g for _, _, g in segments], bufs, h, momentum, steps == 0, scale)


def _sgd_chunked_piece(meta, param, states, segments, h, steps, scale):
    """bfloat16 and float16 buffers: in-place addcmul passes where they step the group as the rule does, the float32
    kernel a chunk at a time otherwise."""
    momentum, first = _sgd_momentum(states, h), steps == 0
    low = _low_precision_steps(h, momentum, first, scale)
    for s, e, g in segments:
        buf = states[0][s:e] if momentum != 0.0 else None
        if low:
            _sgd_low_precision(param[s:e], g, buf, h, momentum, first)
        else:
            _sgd_chunked(param[s:e], g, buf, h, momentum, first, scale)


def _fused_sgd(params, grads, bufs, h, momentum, first, scale):
    """``torch._fused_sgd_`` over lists of slices (``bufs`` empty without momentum)."""
    torch._fused_sgd_(
        params, grads, bufs, weight_decay=h["weight_decay"], momentum=momentum,
        lr=h["lr"], dampening=1.0 - h["one_minus_dampening"], nesterov=h["nesterov"] != 0,
        maximize=h["grad_sign"] < 0, is_first_step=first, grad_scale=_kernel_scale(grads, scale),
    )  # fmt: skip


def _sgd_chunked(param, grad, buf, h, momentum, first, scale):
    """SGD over bfloat16 or float16 slices, a chunk at a time: the parameters, gradients and buffer upcast into float32
    scratch buffers, ``torch._fused_sgd_`` over those (the float32 step, rounded once), the parameters and the buffer
    (and, with ``scale``, the unscaled gradients) stored back."""
    dtype = compute_dtype(param.dtype)
    pf_all, gf_all, bf_all = _scratch_buffers(dtype, 3)
    for s in range(0, param.numel(), CHUNK):
        e = min(s + CHUNK, param.numel())
        n, p, g = e - s, param[s:e], grad[s:e]
        pf, gf = pf_all[:n].copy_(p), gf_all[:n].copy_(g)
        b = None if buf is None else buf[s:e]
        bf = None if b is None else bf_all[:n].copy_(b)
        scale_f = None if scale is None else scale.to(dtype)
        _fused_sgd([pf], [gf], [] if bf is None else [bf], h, momentum, first, scale_f)
        p.copy_(pf)
        if b is not None:
            b.copy_(bf)
        if scale is not None:
            g.copy_(gf)  # the unscaled gradient stays in .grad, as torch's fused kernels leave it


def _low_precision_steps(h, momentum, first, scale):
    """Whether :func:`_sgd_low_precision` steps a piece: momentum without dampening (but on the first step, which
    ignores it) nor Nesterov, or no momentum nor weight decay; no ``maximize``, no ``grad_scale``."""
    if momentum == 0.0:
        plain = h["weight_decay"] == 0.0
    else:
        plain = h["nesterov"] == 0 and (first or h["one_minus_dampening"] == 1.0)
    return plain and scale is None and h["grad_sign"] > 0


@functools.cache
def _one(dtype):
    return torch.ones(1, dtype=dtype, device="cpu")


def _sgd_low_precision(param, grad, buf, h, momentum, first):
    """SGD over bfloat16 or float16 slices (see :func:`_low_precision_steps` for the groups it takes), in place, with
    ``addcmul``: ``torch.addcmul(x, y, one, value=v)`` computes ``x + v * y`` in float32 with ``v`` in float32
    and rounds once (``add``'s ``alpha`` would be rounded to the tensors' dtype first: momentum 0.9 would be
    0.8984 in bfloat16). The momentum buffer is ``g + momentum * buf`` (``g`` itself on the first step), then
    with weight decay ``+ weight_decay * p``, rounded after each; the parameters take ``-lr`` times the stored
    buffer. So two roundings where the rule rounds once (with weight decay: three, where torch's foreach SGD
    rounds four times), and two passes over the buffers (three with weight decay) where the float32 copies take
    six: within a rounding of the rule's values, the tests' tolerance. Without momentum: ``p - lr * g``, rounded
    once."""
    one = _one(param.dtype)
    lr, wd = h["lr"], h["weight_decay"]
    if buf is None:  # no momentum (nor weight decay): p - lr * g, rounded once
        param.addcmul_(grad, one, value=-lr)
        return
    if first:
        buf.copy_(grad)
    else:
        torch.addcmul(grad, buf, one, value=momentum, out=buf)
    if wd != 0.0:
        buf.addcmul_(param, one, value=wd)
    param.addcmul_(buf, one, value=-lr)


@functools.cache
def fused_sgd_steps(dtype):
    """Whether ``torch._fused_sgd_`` steps buffers of ``dtype`` on the CPU as the rule does: 256 elements stepped with
    momentum, dampening and weight decay, once per dtype, against the rule's math (rounded to ``dtype``). With torch
    2.13 it does for float32 and float64, not for bfloat16 and float16: its vectorised loop for them stores no
    parameter and reads the momentum buffer as float32."""
    x = torch.linspace(-1.0, 1.0, 256, dtype=torch.float64)
    p, g, b = (t.to(dtype) for t in (x, x.flip(0) * 0.5, x * x))
    row = dict(lr=0.5, momentum=0.9, one_minus_dampening=0.75, weight_decay=0.1, nesterov=0.0, grad_sign=1.0)
    math_dtype = compute_dtype(dtype)
    hp = {
        k: torch.tensor(v, dtype=math_dtype, device="cpu") for k, v in row.items()
    }  # the rule reads tensors, as a table's row
    want = SGD.math(*(t.to(math_dtype) for t in (p, g, b)), steps=torch.tensor(1.0, device="cpu"), **hp)
    try:
        _fused_sgd([p], [g], [b], row, 0.9, False, None)
    except RuntimeError:  # no kernel for this dtype
        return False
    tol = dict(rtol=2**-6, atol=2**-8)  # a rounding or two of bfloat16 apart
    return all(torch.allclose(got.to(math_dtype), w.to(dtype).to(math_dtype), **tol) for got, w in zip((p, b), want))


# -------------------------------------------------------------------------------------------------- Lion
def lion_step(param, grad, exp_avg, *, hparams, meta, grad_scale=None, found_inf=None, block_size=None,
              sources=None, **precision):  # fmt: skip
    """One Lion step over flat buffers (``block_size``: the kernels', ignored here)."""
    if _compact(param, (exp_avg,), precision):
        reference.lion_step(param, grad, exp_avg, hparams=hparams, meta=meta, grad_scale=grad_scale,
                                   found_inf=found_inf, sources=sources, **precision)  # fmt: skip
        return
    _step(LION, param, grad, (exp_avg,), hparams=hparams, meta=meta, grad_scale=grad_scale, found_inf=found_inf,
          sources=sources)  # fmt: skip


def _lion_piece(meta, param, states, segments, h, steps, scale):
    _lion_chunked(param, states[0], segments, h, scale)


def _chunk_parts(segments, s, e, k):
    """The gradient of elements ``[s, e)`` as ``(lo, hi, slice)`` parts of ``segments`` (sorted ``(start, end,
    gradient)`` runs covering them), searched from index ``k``; and the index to search the next chunk from."""
    while segments[k][1] <= s:
        k += 1
    parts, j = [], k
    while j < len(segments) and segments[j][0] < e:
        a, b, g = segments[j]
        lo, hi = max(a, s), min(b, e)
        parts.append((lo, hi, g[lo - a : hi - a]))
        j += 1
    return parts, k


def _lion_chunked(param, exp_avg, segments, h, scale):
    """Lion over the elements the ``segments`` cover (sorted ``(start, end, gradient)`` runs: slices of the flat
    gradient buffer and gradients read where they lie), a chunk at a time: ``p * (1 - lr * weight_decay) + (-lr) *
    sign(m * beta1 + (1 - beta1) * g)``, ``m * beta2 + (1 - beta2) * g``, each interpolation of ``m`` and ``g``
    one ``lerp`` (a pass over the chunk where the rule's order of roundings takes three: five passes in all rather
    than nine). Its rounding differs from the rule's by an ulp or so, as the Triton kernel's fused multiply-adds do,
    and so may the sign of a sum that close to zero; float32 values hardly ever cancel to that point. bfloat16 and
    float16 ones (8 and 11 bits) do: there the sum inside ``sign`` is computed in the rule's roundings, exactly
    zero where the rule's is. A chunk's gradient is read in place when one segment
    holds it, and otherwise gathered into a scratch buffer that stays in the cache (a gradient read in place is not
    copied into the flat buffer first: a write and a read of its bytes through memory less). bfloat16 and float16
    chunks are upcast into float32 scratch buffers and rounded once when stored back (operations mixing dtypes would
    spare the copies, but run several times slower); where one gradient holds the chunk, unscaled, the state's
    ``lerp`` runs in the buffers' dtype, whose kernel computes in float32 and rounds once: the same values, without
    the copy of the state back out. With ``scale``, the unscaled gradients are left where they lie, as
    torch's fused kernels leave them in ``.grad``."""
    dtype = compute_dtype(param.dtype)
    upcast = param.dtype != dtype
    c_all, g_all, *up = _scratch_buffers(dtype, 5 if upcast else 2)
    if scale is not None:
        scale = scale.to(dtype)
    lr, wd = h["lr"], h["weight_decay"]
    beta1, omb1, omb2 = h["beta1"], h["one_minus_beta1"], h["one_minus_beta2"]
    decay = (
        1.0 - torch.tensor(lr, dtype=dtype, device="cpu") * wd
    ).item()  # rounded as the rule rounds it in the table's dtype
    k = 0
    for s in range(segments[0][0], segments[-1][1], CHUNK):
        e = min(s + CHUNK, segments[-1][1])
        n, p, m = e - s, param[s:e], exp_avg[s:e]
        c = c_all[:n]
        parts, k = _chunk_parts(segments, s, e, k)
        gathered = upcast or len(parts) > 1
        if gathered:
            gf = g_all[:n]
            for lo, hi, g in parts:
                gf[lo - s : hi - s].copy_(g)
        else:
            gf = parts[0][2]
        if upcast:
            pf, mf = up[0][:n].copy_(p), up[1][:n].copy_(m)
        else:
            pf, mf = p, m
        if scale is not None:
            gf.div_(scale)
            if gathered:
                for lo, hi, g in parts:
                    g.copy_(gf[lo - s : hi - s])  # the unscaled gradient stays where it lies
        # the gradient in the buffers' dtype where one part holds it unscaled: the state's lerp reads it there
        low = parts[0][2] if upcast and scale is None and len(parts) == 1 else None
        if upcast:  # m * beta1 + (1 - beta1) * g in the rule's roundings (see the docstring)
            omb1_g = gf.mul_(omb1) if low is not None else torch.mul(gf, omb1, out=up[2][:n])
            torch.mul(mf, beta1, out=c).add_(omb1_g).sign_()
        else:  # the same in one pass
            torch.lerp(gf, mf, beta1, out=c).sign_()
        if wd != 0.0:
            pf.mul_(decay)
        pf.add_(c, alpha=-lr)
        if low is not None:  # m * beta2 + (1 - beta2) * g, one lerp in float32 rounded once: as below, one pass
            m.lerp_(low, omb2)
        else:
            mf.lerp_(gf, omb2)  # m * beta2 + (1 - beta2) * g, in one pass
        if upcast:
            p.copy_(pf)
            if low is None:
                m.copy_(mf)
