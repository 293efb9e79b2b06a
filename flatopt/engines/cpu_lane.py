"""The CPU step's lane: the ordinary step of a CPU training loop, with a fraction of the general step's host work.

On the CPU the host's work around the kernel is part of every step, and a training loop's steps repeat one shape:
``zero_grad()`` set every ``.grad`` to None, backward gave each parameter a gradient of its own (of its shape,
dtype and strides), and nothing else changed. The general step (:meth:`FlatStepEngine.step`) handles every case
there is: it plans the gradients' settling (:meth:`flatopt.grads.GradLanding.plan`), applies the plan, wraps the
gradients read in place (:class:`flatopt.layout.GradSources`) and launches through the functional entry points. The
lane checks that a step has the ordinary shape and then does only what such a step needs, computing what the
general step computes with the same pieces of the CPU backend (:func:`flatopt.cpu.step_own`):

1. nothing to reconcile or re-lay-out (``opt.state`` unedited, ``param_groups`` and ``requires_grad`` as laid out,
   the first and last parameter of each buffer in place, and on the CPU every parameter's address, no full binding
   check due);
2. every parameter's ``.grad`` a tensor of its own, outside the flat gradient buffers, of the buffer's dtype and
   device, dense, without autograd history; those of at least ``IN_PLACE_MIN`` elements of their view's shape and
   strides (16-byte aligned, as the general step asks); then the hyper-parameters refreshed, as the general step
   refreshes them once it has looked at the gradients, and every buffer one the CPU backend's own pieces step;
3. one batched copy of the small ones into their slots, the version counters bumped, each buffer stepped reading
   the large ones where they lie. ``.grad`` stays autograd's tensor, as in the general step.

Anything else leaves the step to the general path, before anything changes: a ``.grad`` that is None or a view of
the buffer, another dtype, device or layout, ``create_graph``, GradScaler's ``grad_scale`` or ``found_inf``, states
stored with fewer bytes (a master copy, stochastic rounding, another state dtype), a step inside ``capture()``, a
first step (it names the parameters without a gradient), a step with a full binding check (every 256th).
"""

import torch

from flatopt import cpu
from flatopt.functional import table_for

__all__ = ["CpuLane"]

MISSES = 3  # steps in a row whose gradients the lane could not take, after which it looks every EVERY-th step only
EVERY = 8


class CpuLane:
    """The lane of one :class:`~flatopt.engines.step.FlatStepEngine` on the CPU backend, for one layout: the engine
    makes a new one whenever it lays its parameters out anew (so that no buffer of an old layout stays alive here).
    Whether the CPU backend's own pieces step the buffers is found again when a state buffer changes (SGD's momentum
    buffer allocated when a group turns momentum on)."""

    def __init__(self):
        self.entries = None  # per buffer: (buf, [(param, grad view, start, numel, strides, shape)]) of the layout
        self.key = None  # the states of every buffer the eligibility below was found for
        self.fused = False  # whether the CPU backend's own pieces step every buffer (with those states)
        self.misses = 0  # steps in a row whose gradients the lane could not take

    def step(self, eng, in_place_min):
        """Step ``eng``'s buffers if this is an ordinary step and return True; return False otherwise, having changed
        nothing but what the general step's own first checks change (the hyper-parameters' tables, refreshed once
        the gradients are known to be the ordinary ones, as the general step refreshes them once it has looked at
        the gradients). Gradients of ``in_place_min`` elements and more are read where they lie, the others copied
        in. After MISSES steps in a row whose gradients it could not take (a parameter that never gets one,
        gradients set by hand into the buffer), it looks at the gradients only every EVERY-th step, until it takes
        them again: a loop whose steps never have the ordinary shape pays that look on one step in EVERY."""
        if self.misses >= MISSES and eng.checked_steps % EVERY:
            return False
        opt = eng.opt
        state = opt.state
        if state is not eng.installed or state.changes or eng.recording or eng.sources is not None:
            return False
        if eng.steps_written():  # a step count written in place: the general step follows it first
            return False
        if eng.full_check_due() or eng.members_changed() or not eng.ends_bound() or not eng.reads_in_place():
            return False
        if self.entries is None:
            self.entries = [(buf, _rows(buf)) for buf in eng.buffers]
        scan = self._scan(eng, self.entries, in_place_min)
        if scan is None:
            self.misses += 1
            return False
        self.misses = 0
        eng.refresh_hparams()  # raises for a changed group that is invalid, as the general step does
        states = self._states(eng)
        if states is None:  # a buffer the reference steps (see the module docstring)
            return False
        dst, src, owns, masked = scan
        slots = eng.landing.slots
        # the step (see FlatStepEngine.step: the same order of work, the checks above standing for the plan's)
        eng.checked_steps += 1
        if masked:  # every parameter has its gradient now: no mask (the general step's rule, skip_unused or not)
            eng._set_masks(())
        slots.settled()
        eng.landing.pooled.clear()
        if dst:
            torch._foreach_copy_(dst, src)
        eng._count_updates((), ())
        rule = opt.rule
        for (buf, _), held, own in zip(self.entries, states, owns):
            table = table_for(buf.data, opt.hparams.on(buf.device))
            cpu.step_own(rule, buf.data, buf.grad, held, hparams=table, meta=buf.meta, own=own)
        eng.keep_padding_zero()
        return True

    @staticmethod
    def _scan(eng, entries, least):
        """(views, gradients to copy into them, per buffer the gradients read in place, whether a mask is set) if
        every gradient has the ordinary shape (see the module docstring); None otherwise. Changes nothing."""
        slots = eng.landing.slots
        if any(slots.released(b) for b in range(len(entries))):
            return None
        spans = eng.landing.spans()  # a .grad inside one of them is a view of the buffers, not a gradient
        lo, hi = spans[0] if len(spans) == 1 else (0, 0)
        strided = torch.strided
        dst, src, owns, masked = [], [], [], False
        for buf, rows in entries:
            masked = masked or buf.meta.active is not None  # an earlier step left parameters out
            dtype, device = buf.dtype, buf.grad.get_device()
            own = []
            for p, view, start, numel, stride, shape in rows:
                g = p.grad
                if g is None or g.layout is not strided:  # (a sparse tensor has no data pointer)
                    return None
                at = g.data_ptr()
                if lo <= at < hi or g.dtype is not dtype or g.requires_grad or g.get_device() != device:
                    return None
                if len(spans) > 1 and any(a <= at < b for a, b in spans):
                    return None
                if numel < least:
                    dst.append(view)
                    src.append(g)
                elif g.stride() == stride and g.shape == shape and at % 16 == 0:
                    own.append((start, start + numel, g))
                else:
                    return None
            owns.append(own)
        return dst, src, owns, masked

    def _states(self, eng):
        """Per buffer its states (in the rule's order), when the CPU backend's own pieces step every buffer; None
        otherwise. Found again when a state buffer changed (SGD's momentum buffer allocated)."""
        names = eng.opt.rule.state_names
        states = [tuple(buf.states.get(n) for n in names) for buf, _ in self.entries]
        key = self.key
        if key is not None and len(key) == len(states):
            if all(a is b for old, new in zip(key, states) for a, b in zip(old, new)):
                return states if self.fused else None
        self.key = states
        self.fused = all(
            buf.master is None
            and not buf.stochastic
            and not buf.quantized
            and buf.grad is not None
            and cpu.steps_fused(eng.opt.rule, buf.data, held, {})
            for (buf, _), held in zip(self.entries, states)
        )
        return states if self.fused else None


def _rows(buf):
    """What the lane looks at per parameter of ``buf``: (param, gradient view, start, numel, strides, shape)."""
    return [(p, v, at, v.numel(), v.stride(), v.shape) for p, v, at in zip(buf.params, buf.grad_views, buf.starts)]
