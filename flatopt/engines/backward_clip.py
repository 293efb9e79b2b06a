"""Clipping by the global gradient norm in in-backward mode (``max_grad_norm=c``), bucket by bucket.

A bucket is stepped as soon as its gradients exist, before the others are computed, so the total
norm of the pass is not known when the first buckets are stepped. Each bucket's gradient ``g`` is
divided, inside the bucket's own kernel launch (as GradScaler's scale is), by::

    max(1, (n + 1e-6) / c)        that is, multiplied by min(1, c / (n + 1e-6)), up to a rounding

    n = max(N_prev, N_so_far)     N_prev: total norm of the previous stepped pass's gradients (unknown on
                                          the first pass, which uses N_so_far alone)
                                  N_so_far: norm of this pass's gradients stepped so far, this bucket's included

When every gradient is known before the first bucket is stepped (``opt.step()`` stepping the
gradients accumulated in ``.grad``), ``n`` is their total norm, and the coefficient is exactly
torch.nn.utils.clip_grad_norm_'s. Norms are taken in float32 (float64 when a buffer is float64), on
the device, with no host synchronisation; ``N_so_far`` is combined from the buckets' norms
(``norm_type`` 2: ``hypot``, 1: sum, inf: maximum).

Under FSDP2 (:mod:`flatopt.engines.fsdp_backward`) a fully_shard group plays the bucket's part and every norm
is global: the engine all-reduces each group's norm from the ranks' local shards (:meth:`BackwardClip.fold`
takes it), so ``n``, and the divisor, are the same on every rank.

:class:`ClipCalls` answers ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``) over an in-backward
optimizer's parameters, for both in-backward engines (see :mod:`flatopt.clip_patch`).
"""

import math

import torch

EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


def _combine(a, b, norm_type):
    """The ``norm_type`` norm of the concatenation of two vectors, from their norms."""
    if norm_type == 2.0:
        return torch.hypot(a, b)
    if norm_type == 1.0:
        return a + b
    return torch.maximum(a, b)


class BackwardClip:
    """The running norm and clip coefficients of one in-backward optimizer.

    Args:
        max_norm (float): ``c``, the optimizer's ``max_grad_norm``.
        norm_type (float): 1.0, 2.0 or inf.
    """

    def __init__(self, max_norm, norm_type):
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.prev = None  # total norm of the previous stepped pass (a device tensor), None before the first
        self.last = None  # the same, as handed out: the total norm of the last stepped pass, before clipping
        self.running = None  # norm of the gradients stepped so far in the pass in progress
        self.exact = None  # the total norm of a pass whose gradients are all known before its first bucket
        self.device, self.dtype = None, torch.float32  # where and in what the norms are kept

    def begin(self, devices, dtypes):
        """A pass begins (its first gradient, or step() stepping what ``.grad`` holds)."""
        self.running = self.exact = None
        self.place(devices, dtypes)

    def place(self, devices, dtypes):
        """Where the norms are kept: the first device of the parameters, in float64 when a buffer is float64."""
        self.device = devices[0] if devices else None
        self.dtype = torch.float64 if torch.float64 in dtypes else torch.float32

    def export(self):
        """What a state dict keeps of the clip (its ``"flatopt"`` entry's ``"clip"``): None before the first stepped
        pass; then ``norm_type`` and ``prev_norm``, ``N_prev`` as a CPU tensor of the norms' dtype (its exact value:
        a host copy, made when the state dict is)."""
        if self.prev is None:
            return None
        return {"norm_type": self.norm_type, "prev_norm": self.prev.detach().to("cpu", copy=True)}

    def restore(self, prev, devices, dtypes):
        """A loaded state dict's ``N_prev`` (a checked one-element tensor), or None (unknown, as at a run's start):
        put where the norms are kept, once, so that no pass copies it."""
        self.running = self.exact = None
        if prev is None:
            self.prev = self.last = None
            return
        self.place(devices, dtypes)
        self.prev = self.last = prev.detach().reshape(()).to(self.device, self.dtype, copy=True)

    def norm_of(self, grads):
        """The total norm of ``grads`` (torch.nn.utils.clip_grad_norm_'s), on the device, in the norms' dtype."""
        norms = [
            torch.linalg.vector_norm(g, self.norm_type, dtype=self.dtype).to(self.device) for g in grads if g.numel()
        ]  # an empty gradient (an empty shard) adds nothing, and has no inf norm
        if not norms:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.linalg.vector_norm(torch.stack(norms), self.norm_type)

    def know_all(self, grads):
        """Every gradient of the pass is known before its first bucket is stepped: clip by their total norm."""
        self.know_total(self.norm_of(grads))

    def know_total(self, total):
        """Every gradient of the pass is known before its first bucket is stepped, and ``total`` (a device
        tensor) is their total norm: clip by it."""
        self.exact = total

    def divisor(self, grad, out):
        """Fold the norm of ``grad`` (a bucket's, about to be stepped) into the running norm and write the
        bucket's divisor, ``max(1, (n + 1e-6) / c)``, into ``out`` (a [1] tensor on the bucket's device, kept
        at one address so that the bucket's launch replays from its CUDA graph); returns ``out``."""
        return self.fold(torch.linalg.vector_norm(grad, self.norm_type, dtype=self.dtype).to(self.device), out)

    def fold(self, norm, out=None):
        """Fold ``norm`` (a device tensor: the norm of the gradients about to be stepped) into the running norm
        and return the divisor of their launch, ``max(1, (n + 1e-6) / c)``, as a [1] tensor: written into
        ``out`` when given, a new one on the norms' device otherwise."""
        self.running = norm if self.running is None else _combine(self.running, norm, self.norm_type)
        if self.exact is not None:
            n = self.exact
        elif self.prev is None:
            n = self.running
        else:
            n = torch.maximum(self.prev, self.running)
        divisor = torch.clamp_min((n + EPS) / self.max_norm, 1.0).reshape(1)
        if out is None:
            return divisor
        out.copy_(divisor)
        return out

    def end(self):
        """The pass was stepped whole: record its total norm (before clipping) for the next pass and callers."""
        total = self.exact if self.exact is not None else self.running
        if total is None:
            total = torch.zeros((), dtype=self.dtype, device=self.device)
        self.prev = self.last = total
        self.running = self.exact = None

    def drop(self):
        """The pass in progress is dropped (it raised): the previous pass's norm stays."""
        self.running = self.exact = None


GONE = (
    "the backward pass applied them to the parameters and freed them as they arrived, so this call would find none "
    "and clip nothing"
)
ALREADY = "The parameters have already been updated with the unclipped gradients of that pass"
CLIP_OFF = (
    "turn clipping off in the framework (max_grad_norm=0 in transformers' TrainingArguments, gradient_clip_val=None "
    "in Lightning's Trainer)"
)


def _shown(value):
    """An argument as a message shows it: as the caller gave it, a one-element tensor as its number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


class ClipCalls:
    """How an in-backward engine answers ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` over its
    parameters (:mod:`flatopt.clip_patch` asks it). The engine has ``cls``, ``clip`` (a :class:`BackwardClip`,
    or None without ``max_grad_norm``), ``applied`` (a pass stepped and freed its gradients since the last
    ``step()`` or ``zero_grad()``), and :meth:`pending_norm`."""

    clip_doc = "docs/in-backward.md, 'Clipping'"  # where the running-norm clip is described

    def pending_norm(self):
        """The total norm of the gradients still in ``.grad`` (with ``max_grad_norm``), without clipping them."""
        raise NotImplementedError

    def restore_prev_norm(self, prev):
        """``load_state_dict()``: the loaded ``N_prev`` (a checked one-element tensor), or None (unknown), on the
        device and in the dtype this engine keeps its norms in (with ``max_grad_norm``)."""
        if self.clip is not None:
            self.clip.restore(prev, self.devices, [b.dtype for b in self.buffers])

    def clip_call(self, max_norm, norm_type, error_if_nonfinite, run_torch):
        """A call of torch.nn.utils.clip_grad_norm_ (or of ``opt.clip_grad_norm_``) over this optimizer's
        parameters; ``run_torch()`` makes torch's call as it was asked. Returns the total norm before clipping,
        as torch does, or raises before anything changes:

        * after a pass that stepped its gradients (and freed them) since the last step() or zero_grad(): the
          norm that pass was clipped by in backward when the optimizer was built with the same
          ``max_grad_norm`` and ``norm_type``; otherwise RuntimeError, since those gradients are gone;
        * otherwise every gradient is still in ``.grad``, not yet stepped (micro-batches of an accumulation
          window, under no_step(), or set by hand): torch's call clips them for real; with ``max_grad_norm``
          (the same value) the optimizer clips them itself when it steps them, and the call returns their
          total norm and changes nothing."""
        clip = self.clip
        asked = f"clip_grad_norm_(max_norm={_shown(max_norm)!r}, norm_type={_shown(norm_type)!r})"
        try:
            max_norm, norm_type = float(max_norm), float(norm_type)
        except (TypeError, ValueError, RuntimeError):
            return run_torch()  # torch's own error for the arguments
        same = clip is not None and clip.max_norm == max_norm and clip.norm_type == norm_type
        if clip is not None and not same:
            raise RuntimeError(self._another_clipping(asked))
        if self.applied:
            if clip is None:
                raise RuntimeError(self._gone(asked, max_norm, norm_type))
            norm = clip.last.clone()
        elif clip is None:
            return run_torch()  # the gradients are in .grad: clipped for real, stepped later as they are then
        else:  # measured apart: the optimizer's own running norm is left as it is
            norm = self.pending_norm()
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. "
                + (
                    "In in-backward mode the pass has already updated the parameters with them. "
                    if self.applied
                    else ""
                )
                + "To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        return norm

    def _another_clipping(self, asked):
        clip = self.clip
        return (
            f"{self.cls}(in_backward=True, max_grad_norm={clip.max_norm!r}, norm_type={clip.norm_type!r}) clips its "
            f"gradients in backward, and {asked} asks for another clipping, which the gradients, applied during "
            f"backward, cannot get. Give the optimizer and the clipping call the same max_norm and norm_type, or "
            f"{CLIP_OFF}"
        )

    def _gone(self, asked, max_norm, norm_type=None):
        """The refusal of a clipping call after a stepped pass, for an optimizer built without max_grad_norm."""
        order = "" if norm_type in (None, 2.0) else f" and norm_type={norm_type!r}"
        return (
            f"{self.cls}(in_backward=True): {asked} cannot clip the gradients: {GONE}. Pass "
            f"max_grad_norm={max_norm!r}{order} to {self.cls}, which then clips in backward by the running norm "
            f"({self.clip_doc}), or {CLIP_OFF}, or use in_backward=False (step mode). {ALREADY}"
        )

    def clip_with_norm_call(self, max_norm, run_torch):
        """A call of torch.nn.utils.clip_grads_with_norm_ (torch 2.6 and later: the second half of clip_grad_norm_,
        given the total norm) over this optimizer's parameters, answered as :meth:`clip_call` answers
        clip_grad_norm_ with the optimizer's norm type: ``max_norm=inf`` clips nothing (never refused); with
        ``max_grad_norm``, another value is refused and the same one changes nothing (the optimizer clipped the
        gradients in backward, or clips those still in ``.grad`` when it steps them); without it, torch's call on
        gradients still in ``.grad``, and a refusal after a stepped pass (they are gone)."""
        try:
            value = float(max_norm)
        except (TypeError, ValueError, RuntimeError):
            return run_torch()  # torch's own error for the argument
        clip, asked = self.clip, f"clip_grads_with_norm_(max_norm={_shown(max_norm)!r})"
        if value == math.inf:
            return None if self.applied else run_torch()
        if clip is not None:
            if clip.max_norm != value:
                raise RuntimeError(self._another_clipping(asked))
            return None
        if self.applied:
            raise RuntimeError(self._gone(asked, value))
        return run_torch()

    def clip_value_call(self, run_torch):
        """A call of torch.nn.utils.clip_grad_value_ over this optimizer's parameters: refused after a pass that
        stepped its gradients since the last step() or zero_grad() (they are gone); torch's call otherwise."""
        if self.applied:
            raise RuntimeError(
                f"{self.cls}(in_backward=True): clip_grad_value_ cannot clip the gradients: {GONE}. Clip each gradient "
                "in a hook registered after the optimizer, which runs before the step "
                "(p.register_post_accumulate_grad_hook(lambda p: p.grad.clamp_(-v, v)) for each parameter), turn "
                f"value clipping off in the framework, or use in_backward=False (step mode). {ALREADY}"
            )
        return run_torch()
