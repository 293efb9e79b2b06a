"""Functional entry points: one keyword-only signature per optimizer, dispatching to the Triton
kernels (``backend="triton"``), the CPU backend (``backend="cpu"``: torch's fused CPU kernels and chunked
in-place code, see :mod:`flatopt.cpu`) or the pure-torch reference (``backend="torch"``).

``hparams`` is the ``[groups, num_hparams]`` table of the rule's rows: float32 for float32, bfloat16 and
float16 buffers, float64 for float64 ones (the dtype their math runs in). A float64 table also steps a
float32, bfloat16 or float16 buffer: see :func:`table_for`.

``master``, ``rounding_seed``, ``rng_base`` and ``scales`` (every entry point's, keyword-only) store parameters and
states with fewer bytes (see :mod:`flatopt.precision`): the master buffer (float32, or int16 remainders) of bfloat16
or float16 parameters, stochastic rounding's seed (None: round to nearest), the index in its whole flat buffer of
the launch's first element (a launch over a slice of a buffer draws the random bits of those elements), and, for
8-bit states (int8 or uint8 codes: :mod:`flatopt.quantize`), one float32 scale buffer per state (a list in the
states' order; None: the states are floats).
"""

import torch

from flatopt import reference
from flatopt.layout import compute_dtype

BACKENDS = ("triton", "cpu", "torch")


def _impl(name, backend):
    if backend == "triton":
        from flatopt import kernels

        return getattr(kernels, name)
    if backend == "cpu":
        from flatopt import cpu

        return getattr(cpu, name)
    if backend == "torch":
        return getattr(reference, name)
    raise ValueError(f"Invalid backend: {backend!r}; expected one of {BACKENDS}")


def table_for(param, hparams):
    """The table a launch over ``param`` reads: ``hparams`` itself, or, for a float64 table (an optimizer's on a
    device that also holds float64 parameters) and a buffer whose math is float32, its float32 rounding: the
    values of a float32 table of the same rows, so such a buffer steps exactly as it would with one. A small
    conversion per launch, made only on devices holding parameters of both kinds."""
    if hparams.dtype == torch.float64 and compute_dtype(param.dtype) == torch.float32:
        return hparams.float()
    return hparams


def adamw(
    param, grad, exp_avg, exp_avg_sq, *, hparams, meta, grad_scale=None, found_inf=None, backend="triton", sources=None,
    master=None, rounding_seed=None, rng_base=0, scales=None,
):  # fmt: skip
    """One AdamW step over flat buffers; see :mod:`flatopt.kernels.adamw`. ``sources``: a
    :class:`flatopt.layout.GradSources`, to read the gradients from where they lie and store them
    into ``grad`` while stepping."""
    _impl("adamw_step", backend)(
        param, grad, exp_avg, exp_avg_sq, hparams=table_for(param, hparams), meta=meta,
        grad_scale=grad_scale, found_inf=found_inf, sources=sources,
        master=master, rounding_seed=rounding_seed, rng_base=rng_base, scales=scales,
    )  # fmt: skip


def sgd(
    param, grad, momentum_buffer, *, hparams, meta, grad_scale=None, found_inf=None, backend="triton", sources=None,
    master=None, rounding_seed=None, rng_base=0, scales=None,
):  # fmt: skip
    """One SGD step over flat buffers; see :mod:`flatopt.kernels.sgd` (``sources``: as for adamw)."""
    _impl("sgd_step", backend)(
        param, grad, momentum_buffer, hparams=table_for(param, hparams), meta=meta,
        grad_scale=grad_scale, found_inf=found_inf, sources=sources,
        master=master, rounding_seed=rounding_seed, rng_base=rng_base, scales=scales,
    )  # fmt: skip


def lion(
    param, grad, exp_avg, *, hparams, meta, grad_scale=None, found_inf=None, backend="triton", sources=None,
    master=None, rounding_seed=None, rng_base=0, scales=None,
):  # fmt: skip
    """One Lion step over flat buffers; see :mod:`flatopt.kernels.lion` (``sources``: as for adamw)."""
    _impl("lion_step", backend)(
        param, grad, exp_avg, hparams=table_for(param, hparams), meta=meta,
        grad_scale=grad_scale, found_inf=found_inf, sources=sources,
        master=master, rounding_seed=rounding_seed, rng_base=rng_base, scales=scales,
    )  # fmt: skip
