"""``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (and the two halves of the first, ``get_total_norm``
and ``clip_grads_with_norm_``, where torch has them) made to see in-backward optimizers.

Frameworks clip after backward and before ``optimizer.step()``: transformers' Trainer (through
accelerate) calls ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)``, Lightning
``torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)`` (or ``clip_grad_value_``), each looking
the function up when it calls it. In in-backward mode the gradients were applied and freed during
backward, so torch's function would find none, return 0 and clip nothing, without a word.

When the first in-backward optimizer is created, :func:`register` replaces these functions (the first two in
``torch.nn.utils`` and ``torch.nn.utils.clip_grad``, the halves in ``torch.nn.utils``) by wrappers, once per
process. A wrapper
materialises ``parameters`` (which may be a generator) and, when none of them belongs to a live
in-backward optimizer, calls torch's function unchanged (same arguments, result and errors). When
some do, the optimizer decides (:meth:`flatopt.engines.backward_clip.ClipCalls.clip_call`): it
returns the norm it clipped by in backward when it was built with the same ``max_grad_norm`` and
``norm_type``, and otherwise raises before anything changes. The optimizers are held weakly: one
that is garbage collected no longer counts.

A call with ``max_norm=inf`` clips nothing: it only asks for the norm (transformers' Trainer makes it at
every step with ``max_grad_norm=0``, its setting for no clipping, to log ``grad_norm``). It is answered
by :func:`norm_query` and never refused: after a stepped pass, with the norm the optimizer measured
(built with ``max_grad_norm`` and the same ``norm_type``) or NaN, with a warning, when it measured none.
"""

import functools
import inspect
import math
import warnings
import weakref

import torch

_engines = weakref.WeakSet()  # the engines of the live in-backward optimizers
_originals = {}  # function name -> torch's function, as it was before the first in-backward optimizer


def register(engine):
    """An in-backward optimizer's engine: its parameters are looked for in every clipping call from now on."""
    _engines.add(engine)
    if not _originals:
        _install()


def original(name):
    """torch's own ``name`` (``"clip_grad_norm_"``, ``"clip_grad_value_"``, ``"clip_grads_with_norm_"`` or
    ``"get_total_norm"``), unwrapped."""
    found = _originals.get(name)
    if found is None:
        found = getattr(torch.nn.utils.clip_grad, name, None) if name.startswith("clip_grad_") else None
    return found or getattr(torch.nn.utils, name)


def _bind(signature, args, kwargs, key):
    """``args`` and ``kwargs`` bound to ``signature``, with the iterable under ``key`` read into a list once (it
    may be a generator); None where torch's own function must answer the call (its own error for them)."""
    try:
        bound = signature.bind(*args, **kwargs)
        value = bound.arguments[key]
        if not isinstance(value, torch.Tensor):
            bound.arguments[key] = list(value)
    except (TypeError, KeyError):
        return None
    return bound


def owner(params, call):
    """The in-backward engine whose parameters ``params`` (a list) holds, or None when it holds none.
    Raises when they belong to several in-backward optimizers, or mix one's parameters with other
    parameters that have a gradient, since neither can be clipped as one set."""
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    found = [e for e in list(_engines) if e.opt is not None and any(e.holds(p) for p in tensors)]
    if not found:
        return None
    if len(found) > 1:
        raise RuntimeError(
            f"{call}: the parameters belong to {len(found)} in-backward optimizers "
            f"({', '.join(e.cls for e in found)}), which clip their gradients in backward each on its own; "
            f"call {call} once per optimizer, with its parameters"
        )
    engine = found[0]
    others = [p for p in tensors if not engine.holds(p) and p.grad is not None]
    if others:
        raise RuntimeError(
            f"{call}: the parameters mix those of {engine.cls}(in_backward=True), whose gradients are applied during "
            f"backward, with {len(others)} other parameter(s) that hold a gradient; clip the two sets with separate "
            "calls"
        )
    return engine


def norm_query(engine, norm_type, error_if_nonfinite, run_torch):
    """``clip_grad_norm_(params, inf, norm_type)`` over ``engine``'s parameters, which clips nothing; returns the
    total norm, as torch does:

    * gradients still in ``.grad`` (no pass stepped since the last step() or zero_grad()): torch's call;
    * after a stepped pass, an optimizer built with ``max_grad_norm`` and this ``norm_type``: the pass's norm
      before clipping (what ``clip_grad_norm_(params, max_grad_norm)`` returns);
    * after a stepped pass, an optimizer that measured no norm of this type: NaN (the norm is unknown: the
      gradients are gone), with a warning that says how to have it measured; with ``error_if_nonfinite``, a
      RuntimeError instead."""
    clip = engine.clip
    if not engine.applied:
        return run_torch()
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        return run_torch()  # torch's own error for the argument
    if clip is not None and clip.norm_type == norm_type:
        return engine.clip_call(clip.max_norm, norm_type, error_if_nonfinite, run_torch)
    built = "without max_grad_norm" if clip is None else f"with norm_type={clip.norm_type!r}"
    unknown = (
        f"{engine.cls}(in_backward=True), built {built}, measured no gradient norm of order {norm_type!r} for the "
        "backward pass, which applied the gradients and freed them"
    )
    if error_if_nonfinite:
        raise RuntimeError(f"clip_grad_norm_(max_norm=inf, error_if_nonfinite=True): {unknown}; it cannot be checked")
    warnings.warn(
        f"clip_grad_norm_(max_norm=inf) asks for the norm only: {unknown}, so it returns NaN (transformers' Trainer "
        f"logs grad_norm nan). To have the norm measured and returned, build the optimizer with max_grad_norm=1e9 "
        "(and this norm_type), which then divides each gradient by 1 (changes nothing) unless its norm exceeds it",
        stacklevel=4,
    )
    device = engine.devices[0] if engine.devices else None
    return torch.full((), math.nan, device=device)


def _wrap(fn, name):
    signature = inspect.signature(fn)
    if name == "get_total_norm":
        return _wrap_total_norm(fn, signature)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _engines:
            return fn(*args, **kwargs)
        bound = _bind(signature, args, kwargs, "parameters")
        if bound is None:
            return fn(*args, **kwargs)
        params = bound.arguments["parameters"]
        engine = owner([params] if isinstance(params, torch.Tensor) else params, name)
        if engine is None:
            return fn(*bound.args, **bound.kwargs)
        given = bound.arguments
        if name == "clip_grad_value_":
            return engine.clip_value_call(lambda: fn(*bound.args, **bound.kwargs))
        if name == "clip_grads_with_norm_":
            return engine.clip_with_norm_call(given["max_norm"], lambda: fn(*bound.args, **bound.kwargs))
        return clip_request(
            engine,
            given["max_norm"],
            given.get("norm_type", 2.0),
            given.get("error_if_nonfinite", False),
            lambda: fn(*bound.args, **bound.kwargs),
        )

    return wrapper


def _wrap_total_norm(fn, signature):
    """torch's ``get_total_norm(tensors, ...)`` (the first half of clip_grad_norm_, torch 2.6 and later) takes the
    gradients, not the parameters, so it cannot tell whose they are. Given none while a live in-backward optimizer
    has stepped a pass (and freed its gradients) since its last step() or zero_grad(), it warns that its 0 is not
    the pass's norm; torch's result and errors either way."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _engines:
            return fn(*args, **kwargs)
        bound = _bind(signature, args, kwargs, "tensors")
        if bound is None:
            return fn(*args, **kwargs)
        applied = [e for e in list(_engines) if e.opt is not None and e.applied]
        given = bound.arguments["tensors"]
        if isinstance(given, list) and not given and applied:
            engine = applied[0]
            how = (
                "opt.last_grad_norm is the norm it clipped that pass by"
                if engine.clip is not None
                else "build the optimizer with max_grad_norm (1e9 clips nothing) and opt.last_grad_norm gives it"
            )
            warnings.warn(
                f"get_total_norm() was given no gradient: {engine.cls}(in_backward=True) applied the gradients of the "
                f"last backward pass to the parameters and freed them, so the 0 it returns is not their norm: {how} "
                "(docs/in-backward.md, Clipping)",
                stacklevel=2,
            )
        return fn(*bound.args, **bound.kwargs)

    return wrapper


def clip_request(engine, max_norm, norm_type, error_if_nonfinite, run_torch):
    """A clip_grad_norm_ call over in-backward ``engine``'s parameters, from torch's wrapped function or from
    ``opt.clip_grad_norm_()``: ``max_norm=inf`` clips nothing and only asks for the norm (transformers' Trainer
    makes that call with ``max_grad_norm=0``, to log it), so it is never refused (:func:`norm_query`); any
    other value is the engine's to clip or refuse (``clip_call``)."""
    if _is_inf(max_norm):
        return norm_query(engine, norm_type, error_if_nonfinite, run_torch)
    return engine.clip_call(max_norm, norm_type, error_if_nonfinite, run_torch)


def _is_inf(max_norm):
    try:
        return float(max_norm) == math.inf
    except (TypeError, ValueError, RuntimeError):
        return False


def _install():
    utils, module = torch.nn.utils, torch.nn.utils.clip_grad
    # the two halves of clip_grad_norm_ (torch 2.6 and later), public in torch.nn.utils only: torch's own
    # clip_grad_norm_ calls them under their private names in clip_grad, which stay torch's
    for name in ("clip_grads_with_norm_", "get_total_norm"):
        fn = getattr(utils, name, None)
        if fn is not None:
            _originals[name] = fn
            setattr(utils, name, _wrap(fn, name))
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        fn = getattr(module, name)
        _originals[name] = fn
        wrapped = _wrap(fn, name)
        setattr(module, name, wrapped)
        if getattr(utils, name, None) is fn:
            setattr(utils, name, wrapped)
        else:  # replaced by someone else already: wrap that one too, on its own
            setattr(utils, name, _wrap(getattr(utils, name), name))
