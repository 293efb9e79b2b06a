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
"""

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
        self.device = devices[0] if devices else None
        self.dtype = torch.float64 if torch.float64 in dtypes else torch.float32

    def norm_of(self, grads):
        """The total norm of ``grads`` (torch.nn.utils.clip_grad_norm_'s), on the device, in the norms' dtype."""
        norms = [torch.linalg.vector_norm(g, self.norm_type, dtype=self.dtype).to(self.device) for g in grads]
        if not norms:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.linalg.vector_norm(torch.stack(norms), self.norm_type)

    def know_all(self, grads):
        """Every gradient of the pass is known before its first bucket is stepped: clip by their total norm."""
        self.exact = self.norm_of(grads)

    def divisor(self, grad, out):
        """Fold the norm of ``grad`` (a bucket's, about to be stepped) into the running norm and write the
        bucket's divisor, ``max(1, (n + 1e-6) / c)``, into ``out`` (a [1] tensor on the bucket's device, kept
        at one address so that the bucket's launch replays from its CUDA graph); returns ``out``."""
        norm = torch.linalg.vector_norm(grad, self.norm_type, dtype=self.dtype).to(self.device)
        self.running = norm if self.running is None else _combine(self.running, norm, self.norm_type)
        if self.exact is not None:
            n = self.exact
        elif self.prev is None:
            n = self.running
        else:
            n = torch.maximum(self.prev, self.running)
        out.copy_(torch.clamp_min((n + EPS) / self.max_norm, 1.0).reshape(1))
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
