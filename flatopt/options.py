"""flatopt's own constructor options, parsed in one place, and torch.optim's implementation options.

Every optimizer takes torch.optim's (or lion-pytorch's) arguments under their own names, plus the
options below as keyword arguments. The options are parsed once, by the base class, into one
:class:`FlatOptions`; an unknown keyword raises TypeError as for any function.
"""

import math
from dataclasses import dataclass

from torch import nn

from flatopt import precision as precision_options
from flatopt.distributed import is_ddp, is_fsdp

DEFAULT_BUCKET_SIZE = 2**25  # elements: 128 MiB of float32 staging gradient in in-backward mode
GATHER = "gather"  # direct_grads: no covered layer nor copying hook; step() reads the gradients in place
NORM_TYPES = (1.0, 2.0, math.inf)  # the norms in-backward clipping (max_grad_norm) takes

# torch.optim's implementation options (and lion-pytorch's): name -> (whether a value changes nothing for flatopt,
# why another value is refused and what to do, the hint for a constructor that does not take the option). A
# constructor whose signature has the option takes it at the values that change nothing and raises ValueError at the
# others; one that does not raises TypeError, as torch.optim does for options it does not know.
TORCH_ONLY_KWARGS = {
    "foreach": (
        lambda v: v is None,
        "it always steps each flat buffer with one fused kernel, not with torch.optim's foreach or for-loop "
        "implementation (whose rounding differs); drop 'foreach'",
        "{cls} always steps each flat buffer with one fused kernel, so drop 'foreach'",
    ),
    "fused": (
        lambda v: v is None or bool(v),
        "it always steps each flat buffer with one fused kernel; drop 'fused' (or pass fused=True)",
        "{cls} always steps each flat buffer with one fused kernel, so drop 'fused'",
    ),
    "capturable": (
        lambda v: True,  # step counts and hyper-parameters live on the device anyway; capture() records the step
        "",
        "capture() records {cls}'s step in a CUDA graph without it, so drop 'capturable'",
    ),
    "differentiable": (
        lambda v: not v,
        "its step updates the parameters in place outside autograd and is not differentiable; use "
        "torch.optim.{name}(differentiable=True)",
        "{cls}'s step is not differentiable, so drop 'differentiable'",
    ),
    "amsgrad": (lambda v: not v, "it does not implement amsgrad; use torch.optim.AdamW(amsgrad=True)", None),
    "use_triton": (
        lambda v: not v,
        "it steps with its own kernels, as backend= says (Triton on CUDA, torch's fused CPU kernels on the CPU); "
        "drop 'use_triton'",
        None,
    ),
    "decoupled_weight_decay": (
        lambda v: not v,
        "it does not implement lion-pytorch's decoupled weight decay (weight_decay divided by the constructor's "
        "lr); pass weight_decay=weight_decay / lr instead, which decays the same",
        None,
    ),
}


def check_torch_options(cls_name, **options):
    """Check the torch.optim (or lion-pytorch) implementation options a constructor's signature takes:
    ignored at a value that changes nothing for flatopt, ValueError saying why and what to do at any other."""
    cls = f"flatopt.{cls_name}"
    for name, value in options.items():
        accepted, why, _ = TORCH_ONLY_KWARGS[name]
        if not accepted(value):
            raise ValueError(f"{cls} does not take {name}={value!r}: " + why.format(name=cls_name))


def unexpected_keyword(cls_name, name):
    """The TypeError for a keyword argument the constructor does not take, with a hint for torch.optim's
    options that this optimizer does not take."""
    hint = TORCH_ONLY_KWARGS[name][2] if name in TORCH_ONLY_KWARGS else None
    hint = "" if hint is None else "; " + hint.format(cls=f"flatopt.{cls_name}")
    return TypeError(f"{cls_name}.__init__() got an unexpected keyword argument '{name}'{hint}")


@dataclass(frozen=True)
class FlatOptions:
    """flatopt's own options (see the optimizers' docstrings, ``flatopt._docs.FLAT``).

    Attributes:
        flat: parameters, gradients and states in flat buffers (False: the caller's tensors, one
            launch per parameter).
        backend: ``"triton"``, ``"cpu"``, ``"torch"`` or None (chosen from the parameters' devices).
        skip_unused: leave parameters whose ``.grad`` is None untouched at a step, as torch.optim
            does (False: step them with a zero gradient).
        in_backward: step buckets of parameters during backward.
        bucket_size: elements of consecutive parameters stepped by one launch in in-backward mode.
        allow_several_ranks: in-backward mode under several distributed ranks that share no
            parameters (pipeline stages, independent runs); refused otherwise.
        direct_grads: in step mode, the covered layers (see :mod:`flatopt.landing`) of the model
            write their gradients straight into the flat gradient buffer: True everywhere, None (the
            default) on GPUs only (:attr:`flatopt.grads.GradLanding.direct_on_cpu`), False nowhere.
            ``"gather"``: no layer covered and no copying hook on any device: ``step()`` reads the
            gradients where autograd left them, as on the CPU (see docs/gradients.md).
        model: the model whose covered layers write into the buffer when ``params`` are parameters or
            param groups rather than the module itself (None: ``params`` if it is a module).
        accumulation_steps: in in-backward mode, the backward passes per optimizer step: the first
            ``accumulation_steps - 1`` after a ``step()`` or ``zero_grad()`` accumulate in ``.grad``, the
            next one steps with the sum.
        max_grad_norm: in in-backward mode, clip the gradients by their global norm in backward (see
            :mod:`flatopt.engines.backward_clip`); None: no clipping.
        norm_type: the norm of ``max_grad_norm``: 1.0, 2.0 or inf.
        master_weights, stochastic_rounding, state_dtype: how parameters and states are stored (see
            :mod:`flatopt.precision`); :attr:`precision` holds the three.
    """

    flat: bool = True
    backend: str | None = None
    skip_unused: bool = True
    in_backward: bool = False
    bucket_size: int = DEFAULT_BUCKET_SIZE
    allow_several_ranks: bool = False
    direct_grads: bool | str | None = None
    model: object = None
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    master_weights: str | None = None
    stochastic_rounding: bool = False
    state_dtype: object = None

    @property
    def precision(self):
        """The storage options as one :class:`flatopt.precision.Precision`."""
        return precision_options.Precision(self.master_weights, self.stochastic_rounding, self.state_dtype)

    @classmethod
    def parse(cls, cls_name, kwargs):
        """The options from a constructor's remaining keyword arguments, checked before anything is built."""
        names = cls.__dataclass_fields__
        for name in kwargs:
            if name not in names:
                raise unexpected_keyword(cls_name, name)
        flat = bool(kwargs.get("flat", True))
        in_backward = bool(kwargs.get("in_backward", False))
        bucket_size = kwargs.get("bucket_size")
        if in_backward and not flat:
            raise ValueError(
                f"{cls_name}(in_backward=True, flat=False): in-backward mode steps buckets of the flat buffers; "
                "drop flat=False"
            )
        if bucket_size is not None and not in_backward:
            raise ValueError(
                f"{cls_name}: bucket_size applies to in_backward=True only; drop it or pass in_backward=True"
            )
        for name in ("direct_grads", "model"):
            # in-backward mode takes a DistributedDataParallel model (param groups with model=ddp: engines.ddp_backward)
            # and an FSDP2 one (model=model beside param groups: flatopt finds the shards through it)
            wrapped = (
                name == "model"
                and in_backward
                and flat
                and (is_ddp(kwargs.get("model")) or is_fsdp(kwargs.get("model")))
            )
            if kwargs.get(name) is not None and (in_backward or not flat) and not wrapped:  # None: the default
                mode = "in_backward=True" if in_backward else "flat=False"
                raise ValueError(
                    f"{cls_name}: {name} applies to step mode with flat=True (gradients landing in the flat "
                    f"buffer), not to {mode}; drop {name}"
                )
        model = kwargs.get("model")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"{cls_name}: model must be an nn.Module (the model the parameters belong to), got "
                f"{type(model).__name__}"
            )
        if bucket_size is None:
            bucket_size = DEFAULT_BUCKET_SIZE
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"Invalid bucket_size: {bucket_size!r}; expected a positive number of elements")
        accumulation_steps, max_grad_norm, norm_type = _backward_options(cls_name, kwargs, in_backward)
        precision = precision_options.parse(cls_name, kwargs, flat)
        return cls(
            flat=flat,
            backend=kwargs.get("backend"),
            skip_unused=bool(kwargs.get("skip_unused", True)),
            in_backward=in_backward,
            bucket_size=bucket_size,
            allow_several_ranks=bool(kwargs.get("allow_several_ranks", False)),
            direct_grads=_direct_grads(cls_name, kwargs.get("direct_grads")),
            model=model,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            norm_type=norm_type,
            master_weights=precision.master_weights,
            stochastic_rounding=precision.stochastic_rounding,
            state_dtype=precision.state_dtype,
        )


def _direct_grads(cls_name, value):
    """``direct_grads``: None, True, False or ``"gather"``."""
    if value is None or value == GATHER:
        return value
    if isinstance(value, str):
        raise ValueError(
            f"{cls_name}: direct_grads={value!r} is not a landing; expected None (the default), True, False or "
            f"{GATHER!r}"
        )
    return bool(value)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _backward_options(cls_name, kwargs, in_backward):
    """``accumulation_steps``, ``max_grad_norm`` and ``norm_type``, checked: they serve in-backward mode, whose
    gradients are applied and freed during backward; step mode accumulates and clips as torch.optim does."""
    k = kwargs.get("accumulation_steps", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"Invalid accumulation_steps: {k!r}; expected an integer >= 1, the backward passes per optimizer step"
        )
    if k != 1 and not in_backward:
        raise ValueError(
            f"{cls_name}: accumulation_steps applies to in_backward=True only. In step mode gradients accumulate in "
            ".grad over backward passes until step(), as with torch.optim: call opt.step() and opt.zero_grad() "
            "every k micro-batches (or let the framework do it), and drop accumulation_steps"
        )
    c = kwargs.get("max_grad_norm")
    if c is not None and (not _is_number(c) or not math.isfinite(c) or c <= 0):
        raise ValueError(
            f"Invalid max_grad_norm: {c!r}; expected a finite number > 0 (None, the default, does not clip)"
        )
    if c is not None and not in_backward:
        raise ValueError(
            f"{cls_name}: max_grad_norm applies to in_backward=True only, whose gradients are applied and freed "
            "during backward. In step mode the gradients stay in .grad until step(): clip them as usual with "
            "opt.clip_grad_norm_(max_norm) or torch.nn.utils.clip_grad_norm_ before opt.step(), and drop max_grad_norm"
        )
    norm_type = kwargs.get("norm_type", 2.0)
    try:
        norm = float(norm_type) if _is_number(norm_type) or isinstance(norm_type, str) else None
    except ValueError:
        norm = None
    if norm not in NORM_TYPES:
        raise ValueError(
            f"Invalid norm_type: {norm_type!r}; in-backward clipping supports 2.0 (the default), 1.0 and inf "
            "(float('inf'))"
        )
    if "norm_type" in kwargs and c is None:
        raise ValueError(
            f"{cls_name}: norm_type applies with max_grad_norm only; pass max_grad_norm, or drop norm_type"
        )
    return k, None if c is None else float(c), norm
