"""What flatopt mirrors of torch.optim's internals, in one place: the step-hook wrapper, and how
tensors and call sites are recognised.

``hooked_step`` mirrors ``torch.optim.Optimizer.profile_hook_step`` and the global hook tables of
``torch/optim/optimizer.py`` as they are in torch 2.4 through 2.13 (the versions flatopt supports):
the order of pre- and post-hooks, the ``_optimizer_step_code`` profiler entry point, the
``hooked`` mark that keeps torch.optim from wrapping ``step`` again, and the profiler label.
"""

import functools
import importlib
import os
import sys

import torch


def outside_stacklevel():
    """The ``stacklevel`` for a ``warnings.warn`` called by this helper's caller that points at the
    first frame outside flatopt and torch (the user's ``opt.step()`` or ``loss.backward()`` line,
    past torch's no_grad, LR-scheduler and GradScaler wrappers and the autograd engine)."""
    internal = tuple(os.path.join(os.path.dirname(os.path.abspath(f)), "") for f in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


TORCH_OPTIM = importlib.import_module("torch.optim.optimizer")
HOOK_TABLES = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


_AUTOGRAD_GRAPH = torch.autograd.graph


def bump_versions(tensors):
    """Count an in-place update of each of ``tensors`` in its autograd version counter, as torch's in-place ops do,
    so that a backward through a graph that saved one of them before raises torch's "modified by an inplace
    operation" error. (The kernels write the flat buffers, whose counters the parameters do not share.) Called
    before the update: under ``torch.autograd.graph.allow_mutation_on_saved_tensors()``, whose dispatch mode
    clones a saved tensor before an in-place operation changes it (and skips the version check), the count is an
    in-place operation through dispatch (a multiplication by one), so that the mode keeps the values that
    backward saved, as under torch.optim's step."""
    if getattr(_AUTOGRAD_GRAPH, "_allow_mutation_on_saved_tensors_enabled", False):
        with torch.no_grad():
            torch._foreach_mul_(list(tensors), 1.0)
        return
    try:
        torch._C._increment_version(tensors)
    except TypeError:  # a torch that takes one tensor at a time
        for t in tensors:
            torch._C._increment_version(t)


def own_dispatch(p):
    """A tensor subclass with its own __torch_dispatch__ (a wrapper such as DTensor), not a plain tensor."""
    return type(p.data).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def remove_hooks(handles, tensors):
    """Remove hook ``handles`` (of ``Tensor.register_hook`` and ``register_post_accumulate_grad_hook``) and
    unregister the tensor-hook tables they leave empty on ``tensors``. Removing a handle only empties its entry in
    the tensor's table; autograd still calls into Python for that table at every backward (about a microsecond
    per parameter). Setting ``_backward_hooks`` to None clears autograd's tensor hooks, which for a plain tensor
    are that table alone, so it is done only when the table is empty. torch has no such reset for the
    post-accumulate-grad table: callers that can use a tensor hook instead should."""
    for h in handles:
        h.remove()
    for t in tensors:
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t._backward_hooks is not None and not t._backward_hooks:
            t._backward_hooks = None


def is_dtensor(p):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(p.data, DTensor)


def own_storage(t):
    """A tensor sharing ``t``'s memory, shape and strides, over a storage of exactly its bytes (a slice of ``t``'s
    storage, which holds the whole storage alive). A view of a flat buffer shares the buffer's storage, and tools
    that go by storages see it as the whole buffer: ``torch.save`` of one parameter writes every byte of the
    buffer, safetensors' ``save_model`` refuses (or drops as "shared") tensors that do not cover their storage,
    and torch 2.13 cannot pickle or deep-copy a DTensor whose local tensor lies at an offset in its storage
    ("invalid python storage"). A tensor of no element gets an empty storage of its own (it shares no memory); ``t``
    itself where it already covers its storage or its storage cannot be sliced. The slice is never resizable: only
    for tensors over memory that stays where it is."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    nbytes = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    start = t.storage_offset() * t.element_size()
    if start == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    try:
        storage = t.untyped_storage()[start : start + nbytes]
        return t.new_empty(0).set_(storage, 0, t.shape, t.stride())
    except (RuntimeError, TypeError):  # a storage that cannot be sliced: the view as it is
        return t


def normal_tensors(method):
    """``method`` run outside inference mode when called inside it: the flat buffers, states and tables it may
    allocate (a layout, a re-layout after unfreezing) must be normal tensors, which the parameters' data and
    autograd can use afterwards; torch.optim allocates nothing there that outlives the call. Costs one check
    (about 0.05 us) outside inference mode."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return run


def outside_compile(fn):
    """``fn``, run outside the graph that torch.compile traces when it is called while compiling: a step, and the
    in-backward gradient hooks, which dynamo meets when it traces a compiled function's ``loss.backward()``
    (their launches cannot be traced, and tracing their bookkeeping trips functionalization's asserts). The
    disabled wrapper costs about 0.5 us of host time per call, so it is called only while compiling; checking
    costs 0.07 us. Dynamo is imported at the wrapper's first call only, as torch.optim does."""
    uncompiled = torch._disable_dynamo(fn)

    def run(*args, **kwargs):
        return (uncompiled if torch.compiler.is_compiling() else fn)(*args, **kwargs)

    return run


def hooked_step(step):
    """torch.optim's wrapper of ``step()``: the step pre-hooks (global, then the optimizer's), ``step``,
    the profiler's entry point, the post-hooks (the optimizer's, then global), all inside the profiler
    label "Optimizer.step#<class>.step". The label is entered only while a profiler runs: entering a
    record_function costs several microseconds of host time at every step, a fifth of a step()
    replayed from its graph. Where torch lacks the global hook tables this relies on, returns
    ``step`` without the hooks, for torch.optim to wrap as usual. Either way, under torch.compile
    ``step`` runs outside the compiled graph."""
    # Under torch.compile, ``step`` is left out of the graph: one fused launch (or graph replay) already, and
    # dynamo cannot trace Triton's launcher under the interpreter. Called only while compiling: the disabled
    # wrapper costs about 0.5 us of host time per call, checking costs 0.07 us. (Every supported torch has the
    # hook tables; tests/test_torch_compat_extras.py takes the early return below by pretending otherwise.)
    run = outside_compile(step)

    if not all(hasattr(TORCH_OPTIM, name) for name in HOOK_TABLES):
        return functools.wraps(step)(run)

    def hooked(*args, **kwargs):
        self = args[0]
        for pre_hook in (*TORCH_OPTIM._global_optimizer_pre_hooks.values(), *self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{step} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                args, kwargs = result
        out = run(*args, **kwargs)
        self._optimizer_step_code()
        for post_hook in (
            *self._optimizer_step_post_hooks.values(),
            *TORCH_OPTIM._global_optimizer_post_hooks.values(),
        ):
            post_hook(self, args, kwargs)
        return out

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        if type(args[0]).step is not wrapper:  # an override of step(), which torch.optim wrapped: hooks ran
            return run(*args, **kwargs)
        if not torch.autograd._profiler_enabled():
            return hooked(*args, **kwargs)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(args[0]).__name__}.step"):
            return hooked(*args, **kwargs)

    wrapper.hooked = True  # torch.optim.Optimizer wraps a step() only if it is not marked so
    return wrapper


def has_step_pre_hooks(opt):
    """Whether ``opt.step()`` runs a pre-hook (global or the optimizer's) before it launches anything."""
    return bool(opt._optimizer_step_pre_hooks) or bool(TORCH_OPTIM._global_optimizer_pre_hooks)


def scalar_betas(betas):
    """AdamW's ``betas`` as the installed torch.optim keeps them in its param groups: torch 2.13 turns one-element
    tensors into 0-dim ones (``torch.optim.optimizer._to_scalar``); earlier versions keep them as given."""
    to_scalar = getattr(importlib.import_module("torch.optim.optimizer"), "_to_scalar", None)
    if to_scalar is None or not isinstance(betas, (tuple, list)):
        return betas
    return tuple(to_scalar(b) if isinstance(b, torch.Tensor) and b.numel() == 1 else b for b in betas)
