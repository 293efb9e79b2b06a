"""Functional entry points: one keyword-only signature per optimizer, dispatching to the Triton
kernels (``backend="triton"``) or the pure-torch reference (``backend="torch"``)."""

from flatopt import reference

BACKENDS = ("triton", "torch")


def _impl(name, backend):
    if backend == "triton":
        from flatopt import kernels

        return getattr(kernels, name)
    if backend == "torch":
        return getattr(reference, name)
    raise ValueError(f"Invalid backend: {backend!r}; expected one of {BACKENDS}")


def adamw(
    param, grad, exp_avg, exp_avg_sq, *, hparams, meta, grad_scale=None, found_inf=None, backend="triton", sources=None
):
    """One AdamW step over flat buffers; see :mod:`flatopt.kernels.adamw`. ``sources``: a
    :class:`flatopt.layout.GradSources`, to read the gradients from where they lie and store them
    into ``grad`` while stepping."""
    _impl("adamw_step", backend)(
        param, grad, exp_avg, exp_avg_sq, hparams=hparams, meta=meta, grad_scale=grad_scale, found_inf=found_inf,
        sources=sources,
    )  # fmt: skip


def sgd(
    param, grad, momentum_buffer, *, hparams, meta, grad_scale=None, found_inf=None, backend="triton", sources=None
):
    """One SGD step over flat buffers; see :mod:`flatopt.kernels.sgd` (``sources``: as for adamw)."""
    _impl("sgd_step", backend)(
        param, grad, momentum_buffer, hparams=hparams, meta=meta, grad_scale=grad_scale, found_inf=found_inf,
        sources=sources,
    )  # fmt: skip


def lion(param, grad, exp_avg, *, hparams, meta, grad_scale=None, found_inf=None, backend="triton", sources=None):
    """One Lion step over flat buffers; see :mod:`flatopt.kernels.lion` (``sources``: as for adamw)."""
    _impl("lion_step", backend)(
        param, grad, exp_avg, hparams=hparams, meta=meta, grad_scale=grad_scale, found_inf=found_inf,
        sources=sources,
    )  # fmt: skip
