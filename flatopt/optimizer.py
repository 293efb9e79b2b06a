"""The base class of flatopt's optimizers: flat buffers under torch.optim's interface."""

import functools
import importlib
import operator
import os
import sys
import warnings
import weakref
from contextlib import nullcontext

import torch
from torch import nn

from flatopt.checkpoint import CheckpointMixin
from flatopt.functional import BACKENDS
from flatopt.grads import GradLanding
from flatopt.in_backward import (
    DEFAULT_BUCKET_SIZE,
    FULL_CHECK_EVERY,
    InBackward,
    check_single_process,
    is_large,
    world_size,
)
from flatopt.layout import SUPPORTED_DTYPES, FlatBuffer, StepMeta, is_dense
from flatopt.staging import PinnedStaging
from flatopt.step_graph import StepGraph

# torch.optim's implementation options (and lion-pytorch's): name -> (whether a value changes nothing for flatopt,
# why another value is refused and what to do, the hint for a constructor that does not take the option). A
# constructor whose signature has the option takes it at the values that change nothing and raises ValueError at the
# others; one that does not raises TypeError, as torch.optim does for options it does not know.
_TORCH_ONLY_KWARGS = {
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
        "it steps with its own fused kernels, Triton or torch as backend= says (Triton is the default on CUDA); "
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


def _outside_stacklevel():
    """The ``stacklevel`` for a ``warnings.warn`` called by this helper's caller that points at the
    first frame outside flatopt and torch (the user's ``opt.step()`` or ``loss.backward()`` line,
    past torch's no_grad, LR-scheduler and GradScaler wrappers and the autograd engine)."""
    internal = tuple(os.path.join(os.path.dirname(os.path.abspath(f)), "") for f in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


_TORCH_OPTIM = importlib.import_module("torch.optim.optimizer")
_HOOK_TABLES = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def _own_dispatch(p):
    """A tensor subclass with its own __torch_dispatch__ (a wrapper such as DTensor), not a plain tensor."""
    return type(p.data).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _is_dtensor(p):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(p.data, DTensor)


def _hooked_step(step):
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
    uncompiled = torch._disable_dynamo(step)  # as torch.optim does: dynamo is imported at the first call only

    def run(*args, **kwargs):
        return (uncompiled if torch.compiler.is_compiling() else step)(*args, **kwargs)

    if not all(hasattr(_TORCH_OPTIM, name) for name in _HOOK_TABLES):
        return functools.wraps(step)(run)

    def hooked(*args, **kwargs):
        self = args[0]
        for pre_hook in (*_TORCH_OPTIM._global_optimizer_pre_hooks.values(), *self._optimizer_step_pre_hooks.values()):
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
            *_TORCH_OPTIM._global_optimizer_post_hooks.values(),
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


def reject_kwargs(cls_name, kwargs, **options):
    """Check a constructor's keyword arguments before anything is built.

    ``kwargs`` (what the signature does not name) raise TypeError, as for any function, with a
    hint for torch.optim's options that this optimizer does not take. ``options`` are the
    torch.optim (or lion-pytorch) options that its signature takes: ignored at a value that
    changes nothing for flatopt, ValueError saying why and what to do at any other.
    """
    cls = f"flatopt.{cls_name}"
    if kwargs:
        name = next(iter(kwargs))
        hint = _TORCH_ONLY_KWARGS[name][2] if name in _TORCH_ONLY_KWARGS else None
        hint = "" if hint is None else "; " + hint.format(cls=cls)
        raise TypeError(f"{cls_name}.__init__() got an unexpected keyword argument '{name}'{hint}")
    for name, value in options.items():
        accepted, why, _ = _TORCH_ONLY_KWARGS[name]
        if not accepted(value):
            raise ValueError(f"{cls} does not take {name}={value!r}: " + why.format(name=cls_name))


class FlatOptimizer(CheckpointMixin, torch.optim.Optimizer):
    """torch.optim.Optimizer whose parameters, gradients and states live in flat buffers.

    Subclasses set ``_state_names`` (flat state buffers), ``_functional`` (the functional entry
    point), ``_exported_step`` (whether torch's state has a ``step``), and implement
    ``_check_hparams(group)`` and ``_hparam_row(group)`` (a row of floats whose column 0 is lr).
    """

    _state_names = ()
    _exported_step = False
    _step_supports_amp_scaling = True  # GradScaler passes grad_scale / found_inf; no host sync

    def __init__(
        self, params, defaults, *, flat=True, backend=None, skip_unused=False, in_backward=False, bucket_size=None
    ):
        self._built = False
        self._names = {}
        cls = type(self).__name__
        if in_backward and not flat:
            raise ValueError(
                f"{cls}(in_backward=True, flat=False): in-backward mode steps buckets of the flat buffers; "
                "drop flat=False"
            )
        if in_backward:
            check_single_process(cls)
        if bucket_size is not None and not in_backward:
            raise ValueError(f"{cls}: bucket_size applies to in_backward=True only; drop it or pass in_backward=True")
        if bucket_size is None:
            bucket_size = DEFAULT_BUCKET_SIZE
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"Invalid bucket_size: {bucket_size!r}; expected a positive number of elements")
        self._module = None  # weak reference to the module, when given one (capture restores its buffers)
        self._graph_mode = False  # True while capture() warms up or records: step() skips host work
        self._graph_steps = 0  # step() calls since capture() last reset it
        self._sources = None  # capture(): {FlatBuffer: GradSources} the next step() gathers its gradients from
        self._landing = None  # GradLanding: gradients copied into the flat buffers (flat=True, step mode)
        self._step_graph = StepGraph()
        self.use_step_graph = True  # replay step()'s launches from a CUDA graph (see flatopt.step_graph)
        if isinstance(params, nn.Module):
            self._check_module(params)
            self._names = {p: n for n, p in params.named_parameters()}
            self._module = weakref.ref(params)
            params = list(params.parameters())
        self._check_hparams(defaults)
        self.flat = bool(flat)
        self.skip_unused = bool(skip_unused)
        self.in_backward = bool(in_backward)
        self.bucket_size = bucket_size
        self._in_backward = None
        self._buffers = []
        self._hp = {}
        self._hp_rows = None
        self._staging = {}  # device -> PinnedStaging of its hyper-parameter table
        self._hp_lrs = None  # the tensor lrs (or None) the table was last validated with, by identity
        self._group_states = []  # per param group: the state names it has used so far
        self._frozen = []  # parameters with requires_grad=False at the last layout
        self._checked_steps = 0  # step()s whose binding check passed (a full one every FULL_CHECK_EVERY)
        self._hooks = []
        self._seen = set()
        self._unused_reported = False
        self._unflat_meta = {}
        super().__init__(params, defaults)
        self.backend = self._choose_backend(backend)
        self._devices = list(dict.fromkeys(p.device for p in self._trainable()))
        if self.flat:
            self._build()
        self._built = True

    # ------------------------------------------------------------------ copies
    def _cannot_copy(self):
        """The error for any attempt to copy or serialise the optimizer object, raised before anything is built."""
        cls = type(self)
        name = f"flatopt.{cls.__name__}" if cls.__module__.startswith("flatopt.") else cls.__name__
        if getattr(self, "flat", True):
            in_backward = getattr(self, "in_backward", False)  # which has no gradient buffer
            held = "parameters and states" if in_backward else "parameters, gradients and states"
            why = f"its {held} are views into flat buffers shared with the model, which a copy would not share"
        else:
            why = "it holds tables on the devices, step counters, hooks and CUDA graphs that a copy cannot carry"
        return TypeError(
            f"{name} cannot be pickled or copied (copy.deepcopy, copy.copy, pickle, torch.save): {why}. Save "
            "opt.state_dict() (torch.optim's format) and load it into an optimizer created for the copied model"
        )

    def __getstate__(self):
        # torch.optim.Optimizer keeps defaults, state and param_groups only, which would make a broken optimizer
        # (pickle, torch.save and copy.copy come here; copy.deepcopy comes to __deepcopy__)
        raise self._cannot_copy()

    def __deepcopy__(self, memo):
        raise self._cannot_copy()

    # ------------------------------------------------------------------ construction
    def _check_module(self, module):
        for name, m in module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients: {type(m).__name__} "
                    f"'{name}' has sparse=True; construct it with sparse=False"
                )

    def _name(self, p):
        """How messages name ``p``: its module name, its name in ``param_names`` (parameters given as
        ``named_parameters()``), else its position."""
        if p in self._names:
            return f"'{self._names[p]}'"
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    if names is not None and i < len(names):
                        return f"'{names[i]}'"
                    return f"params[{i}] of param group {gi} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def add_param_group(self, param_group):
        if isinstance(param_group, dict):
            params = param_group["params"]
            if not isinstance(params, set):  # torch.optim raises its own error for a set (unordered)
                # a list as torch.optim makes it, so that a generator's parameters are checked too
                param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                for p in param_group["params"]:
                    p = p[1] if isinstance(p, tuple) else p
                    if isinstance(p, torch.Tensor):
                        self._check_param(p)
            self._check_hparams({**self.defaults, **param_group})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if len(group["params"]) != len(set(group["params"])):  # tied parameters appear once
            names = group.get("param_names")
            if names is not None:
                first = {}
                for p, name in zip(group["params"], names, strict=True):
                    first.setdefault(p, name)
                group["param_names"] = list(first.values())
            group["params"] = list(dict.fromkeys(group["params"]))
        if self._built:
            self._devices = list(dict.fromkeys(p.device for p in self._trainable()))
            if self.flat:
                self._build()

    def _check_param(self, p):
        if p.is_complex():
            raise ValueError(
                f"{type(self).__name__} does not support complex parameters (got {p.dtype}); "
                "optimize torch.view_as_real(p) as a real parameter instead"
            )
        if p.layout != torch.strided:
            raise ValueError(f"{type(self).__name__} does not support {p.layout} parameters; use dense parameters")
        if p.requires_grad and p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{type(self).__name__} supports float32, bfloat16 and float16 parameters, got {p.dtype}; "
                "convert the model with model.to(torch.float32) before creating the optimizer"
            )
        if p.requires_grad and _own_dispatch(p) and (self.flat or _is_dtensor(p)):
            raise ValueError(  # flat buffers hold plain storage; flat=False views each tensor with as_strided
                f"{type(self).__name__} steps plain tensors, and {self._name(p)} is a {type(p.data).__name__}: "
                "tensor subclasses with their own dispatch, such as DTensor (FSDP2's fully_shard, tensor "
                "parallelism), keep their own layout and storage, which flat buffers cannot hold (and DTensor "
                "has no as_strided, which flat=False uses). Use torch.optim for them"
            )
        if p.requires_grad and self.flat and p.is_meta:
            raise ValueError(
                f"{type(self).__name__}(flat=True) copies the parameters into its buffers, and a parameter on the "
                "meta device has no data; materialise the model first (model.to_empty(device=...), then initialise "
                "the parameters) and create the optimizer after"
            )
        if p.requires_grad and self.flat and not is_dense(p):
            raise ValueError(
                f"{type(self).__name__}(flat=True) needs dense parameters (no gaps or overlaps), got shape "
                f"{tuple(p.shape)} with strides {p.stride()}; make it contiguous before creating the optimizer"
            )

    def _choose_backend(self, backend):
        trainable = [p for p in self._trainable()]
        on_cuda = bool(trainable) and all(p.is_cuda for p in trainable)
        if backend is None:
            return "triton" if on_cuda else "torch"
        if backend not in BACKENDS:
            raise ValueError(f"Invalid backend: {backend!r}; expected one of {BACKENDS}")
        if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' runs on CUDA tensors, and some parameters are not on a CUDA device; "
                "use backend='torch' (the default on the CPU), or set TRITON_INTERPRET=1 before importing "
                "triton to run the kernels under the Triton interpreter"
            )
        return backend

    def _trainable(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield p

    def _build(self):
        """(Re)lay out every trainable parameter into flat buffers, keeping values, grads and state."""
        keys, members = [], {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    key = (p.device, p.dtype)
                    if key not in members:
                        keys.append(key)
                        members[key] = ([], [])
                    members[key][0].append(p)
                    members[key][1].append(gi)
        old_steps = {p: float(s) for p, s in self._steps_by_param().items()}
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._in_backward is not None:
            self._in_backward.remove()
        if self._landing is not None:
            self._landing.detach()
        no_grad = [p for ps, _ in members.values() for p in ps if p.grad is None] if self.skip_unused else []
        buffers = []
        for key in keys:
            params, groups = members[key]
            if self.in_backward:  # large parameters first: each is a bucket, the small ones share a few
                order = sorted(range(len(params)), key=lambda i: not is_large(params[i], self.bucket_size))
                params, groups = [params[i] for i in order], [groups[i] for i in order]
            used = [n for n in self._state_names if any(self._uses_state(n, self.param_groups[g]) for g in groups)]
            buf = FlatBuffer(params, groups, used, grad=not self.in_backward)
            with torch.no_grad():
                for i, p in enumerate(params):
                    for name, views in buf.state_views.items():
                        old = self.state.get(p, {}).get(name)
                        if isinstance(old, torch.Tensor):
                            views[i].copy_(old)
                    buf.meta.steps[i] = old_steps.get(p, 0.0)
            buf.adopt()
            buffers.append(buf)
        self._buffers = buffers
        self._devices = list(dict.fromkeys(b.device for b in buffers))
        self._frozen = [p for group in self.param_groups for p in group["params"] if not p.requires_grad]
        for buf in buffers:
            for i, p in enumerate(buf.params):
                self.state[p] = self._state_of(buf, i)
            self._refresh_uniform(buf)
        self._hp_rows = None
        self._step_graph = StepGraph()  # graphs of the old layout read its freed tables: never replay them
        if self.in_backward:
            self._in_backward = InBackward(self, self.bucket_size)
        elif not self._unused_reported:
            params = [p for b in buffers for p in b.params]
            self._hooks = [p.register_post_accumulate_grad_hook(self._seen.add) for p in params]
            self._hooks += [p.register_hook(self._sparse_grad_hook(p)) for p in params]
        if not self.in_backward:
            self._landing = GradLanding(self)
            self._landing.attach()  # for good: also after model.zero_grad() or zero_grad(set_to_none=False)
            for p in no_grad:  # skip_unused: a parameter steps only once it has a .grad, as in torch.optim
                p.grad = None

    def _sparse_grad_hook(self, p):
        """A hook on ``p``'s incoming gradient, registered until the first step with the hooks that
        record which parameters received one: autograd would add a sparse gradient into the dense
        ``.grad`` view in place (a silent dense update), so refuse it before it lands."""
        opt, param = weakref.ref(self), weakref.ref(p)  # no reference cycle through the parameter's hooks

        def hook(grad):
            self_, p_ = opt(), param()
            if grad.layout != torch.strided and self_ is not None and p_ is not None:  # not once opt is gone
                raise RuntimeError(
                    f"{type(self_).__name__} does not support sparse gradients: parameter {self_._name(p_)} received a "
                    f"{grad.layout} gradient, which would be added into its dense flat .grad view; use "
                    "sparse=False on the embedding (nn.Embedding(..., sparse=False)) that produces it"
                )

        return hook

    def _ensure_states(self):
        """Allocate a state buffer that a group needs now but did not at construction (SGD's
        momentum buffer once a scheduler turns momentum on), and start a group that uses a state
        for the first time as at a first step: its parameters' step counts go to 0 (SGD reads them
        only as "is the momentum buffer set"; AdamW and Lion always use their states, so this
        never happens to them). A group that used the state before keeps it, as torch.optim keeps
        a momentum buffer through a stretch of momentum=0."""
        starting = set()
        used_by_group = []
        for gi, group in enumerate(self.param_groups):
            used = {n for n in self._state_names if self._uses_state(n, group)}
            used_by_group.append(used)
            if gi == len(self._group_states):  # a new group: nothing of it was stepped yet
                self._group_states.append(used)
            elif used - self._group_states[gi]:
                starting.add(gi)
                self._group_states[gi] |= used
        for buf in self._buffers:  # O(groups) per buffer unless something changes: called at every lr change
            missing = [
                n
                for n in self._state_names
                if n not in buf.states and any(n in used_by_group[g] for g in buf.group_set)
            ]
            for name in missing:
                buf.add_state(name)
            first = [i for i, g in enumerate(buf.group_ids) if g in starting] if starting & buf.group_set else []
            if first:
                buf.meta.steps[first] = 0.0
            if missing:
                for i, p in enumerate(buf.params):
                    self.state[p] = self._state_of(buf, i)
            if missing or first:
                self._refresh_uniform(buf)

    def _state_of(self, buf, i):
        """torch.optim's per-parameter state, as views into the flat buffers."""
        state = {name: views[i] for name, views in buf.state_views.items()}
        if self._exported_step:
            state = {"step": buf.meta.steps[i], **state}
        return state

    def _steps_by_param(self):
        return {p: buf.meta.steps[i] for buf in self._buffers for i, p in enumerate(buf.params)}

    def _refresh_uniform(self, buf):
        steps = buf.meta.steps
        buf.meta.uniform = not self.skip_unused and len(set(buf.group_ids)) == 1 and bool((steps == steps[0]).all())
        if self._in_backward is not None:
            self._in_backward.dirty = True

    # ------------------------------------------------------------------ step
    def _refresh_hparams(self, devices):
        """Copy every group's hyper-parameters into the tables on ``devices``, only when they changed.

        A tensor lr is a placeholder in its row and is copied on the device at every call; the
        rows are validated again when they change or when a group's lr is replaced by another
        tensor (compared by identity: an in-place change of the same tensor is not validated,
        as in torch.optim).
        """
        rows, tensor_lrs, lrs = [], [], []
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                tensor_lrs.append((gi, lr))
            lrs.append(lr if isinstance(lr, torch.Tensor) else None)
            rows.append(self._hparam_row(group))
        old = self._hp_lrs or ()
        if rows != self._hp_rows or len(lrs) != len(old) or not all(map(operator.is_, lrs, old)):
            for group in self.param_groups:
                self._check_hparams(group)
            self._ensure_states()
            shape = (len(rows), len(rows[0]))
            for device in devices:
                table = self._hp.get(device)
                if table is None or table.shape != shape:
                    table = self._hp[device] = torch.empty(shape, dtype=torch.float32, device=device)
                if device.type == "cuda":
                    self._staging.setdefault(device, PinnedStaging()).upload(table, rows)
                else:
                    table.copy_(torch.tensor(rows, dtype=torch.float32))
            self._hp_rows, self._hp_lrs = rows, lrs
        for gi, lr in tensor_lrs:
            for table in self._hp.values():
                table[gi, 0].copy_(lr.detach().reshape(()), non_blocking=True)  # no autograd history

    def _names_of(self, params, most=8):
        """The names of ``params`` for a message, the first ``most`` of them."""
        return ", ".join(self._name(p) for p in params[:most]) + (", ..." if len(params) > most else "")

    def check_bindings(self, full=True):
        """Raise if a parameter's data no longer lives in the flat buffers, or (with ``full=True``) if
        a parameter that was frozen when the optimizer laid out its buffers requires grad now (it has
        no place in them and would never be stepped), or one that was trainable is frozen now (it
        would still be stepped, unless ``skip_unused=True``); then settle the gradients.

        ``step()`` checks every parameter at the first step and at every ``FULL_CHECK_EVERY``-th
        (256th) step after it, and otherwise only the first and last parameter of each buffer
        (``full=False``, O(1) host work), which catches ``model.to(...)`` at once. Call this
        (``full=True``) to check every parameter now.

        Settling, with ``flat=True`` in step mode (see :mod:`flatopt.grads`): a ``.grad`` that is
        None gets its view zeroed and put back (with ``skip_unused=True`` it stays None), one that is
        a tensor of its own is copied into its view, which is put back; a sparse ``.grad`` or one
        with autograd history raises. Every ``.grad`` is looked at after a ``zero_grad()`` of either
        kind or a hook's copy since the last step, with ``skip_unused=True``, and at a full check;
        otherwise the first and last of each buffer.
        """
        self._check_bindings(full)

    def _check_bindings(self, full, settle=True):
        """check_bindings(), then (``settle``) the gradients settled into the flat buffers."""
        if full or not self._ends_bound():
            self._check_data_bindings(full)
        if settle and self._landing is not None and self._landing.needs_settling(full):
            self._landing.settle(keep_dirty=True)  # step() clears it, after its own look

    def _check_data_bindings(self, full):
        cls = type(self).__name__
        checked = []  # the parameters looked at: every one (full) or the first and last of each buffer
        for buf in self._buffers:
            idx = range(len(buf.params)) if full else sorted({0, len(buf.params) - 1})
            for i in idx:
                p = buf.params[i]
                checked.append(p)
                data_ptr = buf.expected[i][0]  # the gradients are settled afterwards
                if p.data_ptr() != data_ptr or p.dtype != buf.dtype or p.device != buf.device:
                    raise RuntimeError(
                        f"{cls}: parameter {self._name(p)} no longer lives in the optimizer's flat buffer: its data "
                        "was replaced after the optimizer was created (model.to(), model.cuda(), model.half() or "
                        "`p.data = ...` do that). Create the optimizer after moving or casting the model; to keep "
                        "the optimizer state, save opt.state_dict() first and load it into the new optimizer"
                    )
        frozen = [p for p in checked if not p.requires_grad]
        if frozen and not self.skip_unused:
            names = self._names_of(frozen)
            raise RuntimeError(
                f"{cls}: {len(frozen)} parameter(s) were trainable when the optimizer was created and have "
                f"requires_grad=False now: {names}. Their .grad views stay in the flat gradient buffer, so flatopt "
                "would keep stepping them with a zero gradient (weight decay and momentum would still change "
                "them), where torch.optim skips a parameter whose .grad is None. Create the optimizer after "
                "freezing (save opt.state_dict() and load it into the new optimizer to keep the state), or pass "
                "skip_unused=True, which steps only parameters that received a gradient"
            )
        unfrozen = [p for p in self._frozen if p.requires_grad] if full else []
        if unfrozen:
            names = self._names_of(unfrozen)
            raise RuntimeError(
                f"{cls}: {len(unfrozen)} parameter(s) had requires_grad=False when the optimizer was created and "
                f"require grad now: {names}. The optimizer left them out of its flat buffers, so it would never "
                "step them. Set requires_grad before creating the optimizer; to keep the optimizer state, save "
                "opt.state_dict() first and load it into the new optimizer"
            )
        module = self._module() if full and self._module is not None else None
        if module is not None:  # built from a module: a trainable parameter of it that this optimizer lacks
            held = {id(p) for group in self.param_groups for p in group["params"]}
            missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]
            if missing:
                shown = ", ".join(f"'{n}'" for n in missing[:8]) + (", ..." if len(missing) > 8 else "")
                raise RuntimeError(
                    f"{cls}: the module's trainable parameter(s) {shown} are not among the parameters the optimizer "
                    "was created with, so they would never be stepped: they were replaced (load_state_dict(..., "
                    "assign=True), `module.weight = nn.Parameter(...)`) or added since. Load weights with "
                    "load_state_dict() without assign=True (it copies into the parameters), give new parameters "
                    "to opt.add_param_group(), or create the optimizer afterwards"
                )

    def _ends_bound(self):
        """Whether the first and last parameter of every buffer still hold their data views and require
        grad: step()'s usual check, without building anything (check_bindings says what is wrong
        otherwise; a parameter moved to another device has another address). Gradients are settled
        separately, every parameter at every step (see flatopt.grads)."""
        for buf in self._buffers:
            params, expected = buf.params, buf.expected
            for i in (0, len(params) - 1):
                p = params[i]
                if p.data_ptr() != expected[i][0] or p.dtype != buf.dtype or not p.requires_grad:
                    return False
        return True

    def _check_bindings_at_step(self):
        """step()'s binding check, amortised: full at the first step and at every FULL_CHECK_EVERY-th step
        after it, the first and last parameter of each buffer otherwise. The count advances only when
        the step's checks pass (step() advances it), so a full check that raised runs again at the next
        step. Returns the gradients' settling plan (checked, not done: step() applies it last, once the
        hyper-parameters are validated too), or None."""
        full = not self._unused_reported or self._checked_steps % FULL_CHECK_EVERY == 0
        self._check_bindings(full, settle=False)
        return self._landing.plan() if self._landing.needs_settling(full) else ([], [])

    def _report_unused(self, grads):
        """The first step's warning: parameters whose .grad was None at the step, and those whose view
        no backward pass wrote into (zero_grad(set_to_none=False), or no zero_grad() yet)."""
        without = {p for p, _ in grads[0]}
        given = {p for p, _, g in grads[1] if g is not None}  # a tensor of its own: set by hand, or by DDP
        params = [p for b in self._buffers for p in b.params]
        unused = [p for p in params if p in without or (p not in self._seen and p not in given)]
        self._unused_reported = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._seen.clear()
        if unused:
            self._warn_unused(unused)

    def _warn_unused(self, unused):
        """Name the parameters that received no gradient before the first step (called once), at the
        caller's line (``opt.step()``, or ``loss.backward()`` in in-backward mode)."""
        names = self._names_of(unused)
        action = (
            "skips them as torch.optim does (skip_unused=True)"
            if self.skip_unused
            else "steps them with a zero gradient (weight decay and state decay apply, as in torch.optim "
            "after zero_grad(set_to_none=False)); pass skip_unused=True to skip them as torch.optim does, or "
            "set requires_grad=False on parameters you do not train"
        )
        ranks = world_size()
        where = "" if ranks == 1 else f" from this rank's backward pass (one of {ranks} ranks)"
        ddp = (
            ""
            if ranks == 1
            else ". Under DistributedDataParallel a parameter another rank used gets the averaged gradient from DDP "
            "and is stepped with it; this concerns those no rank used"
        )
        warnings.warn(
            f"{type(self).__name__}: {len(unused)} parameter(s) received no gradient{where} before the first "
            f"step: {names}. flatopt {action}{ddp}",
            stacklevel=_outside_stacklevel(),
        )

    def _has_step_pre_hooks(self):
        """Whether step() runs a pre-hook (global or this optimizer's) before it launches anything."""
        return bool(self._optimizer_step_pre_hooks) or bool(_TORCH_OPTIM._global_optimizer_pre_hooks)

    @_hooked_step
    def step(self, closure=None):
        """Performs a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model and returns the loss.
        """
        loss = None
        self._graph_steps += 1
        if self.in_backward:
            return self._step_in_backward(closure)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.flat:
            with torch.no_grad():
                self._step_unflat()
            return loss
        grads = self._check_bindings_at_step()
        if not self._graph_mode:  # a captured step refreshes hyper-parameters before each replay
            self._refresh_hparams(self._devices)
        self._checked_steps += 1
        if self.skip_unused:  # torch.optim's rule: a parameter whose .grad is None is not stepped
            without = {p for p, _ in grads[0]}
            for buf in self._buffers:
                mask = torch.tensor([p not in without for p in buf.params], dtype=torch.uint8)
                buf.meta.active = mask.to(buf.device, non_blocking=True)
        self._landing.apply(grads)  # see flatopt.grads
        if not self._unused_reported:
            self._report_unused(grads)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        sources, self._sources = self._sources or {}, None  # for this step only

        def launch():
            with torch.no_grad():  # for the torch backend's in-place updates (a replayed graph needs none)
                for buf in self._buffers:
                    self._functional(
                        buf.data, buf.grad, *(buf.states.get(n) for n in self._state_names),
                        hparams=self._hp[buf.device], meta=buf.meta, backend=self.backend,
                        grad_scale=None if grad_scale is None else grad_scale.to(buf.device),
                        found_inf=None if found_inf is None else found_inf.to(buf.device),
                        sources=sources.get(buf),
                    )  # fmt: skip

        if StepGraph.usable(self) and not sources:  # the step graph's key does not cover sources
            self._step_graph.run(self, launch, grad_scale, found_inf)
        else:
            launch()
        return loss

    def _step_in_backward(self, closure):
        """in_backward=True: the parameters were stepped during backward; check what step() is told."""
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__}(in_backward=True) cannot be used with torch.amp.GradScaler: the parameters "
                "were already updated during backward, with gradients still multiplied by the loss scale and before "
                "infs could be checked. Train in bfloat16 without a GradScaler, or use in_backward=False (the "
                "parameters of this step have been updated with scaled gradients: restart from a checkpoint)"
            )
        loss = None
        ib = self._in_backward
        ib.abandon()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if ib.pending:  # every micro-batch ran under no_step(): step their accumulated gradients now
            ib.step_pending()
        ib.step_called = True
        ib.backwards_since_step = 0
        return loss

    def no_step(self):
        """Context manager for gradient accumulation in in-backward mode.

        Backward passes inside it do not update the parameters: their gradients accumulate in
        ``p.grad`` as with torch.optim (holding a full set of gradients, so in-backward mode saves
        no memory during accumulation). The next backward pass outside it steps with the sum.
        In step mode (``in_backward=False``) gradients accumulate in the flat buffer anyway and
        this does nothing.
        """
        return self._in_backward.no_step() if self._in_backward is not None else nullcontext()

    def _step_unflat(self):
        """flat=False: the same kernels, one launch per parameter, over the caller's own tensors.
        Every parameter is checked before any is stepped."""
        todo = [(gi, g, p) for gi, g in enumerate(self.param_groups) for p in g["params"] if p.grad is not None]
        for _, group, p in todo:
            self._check_unflat(p, group)
        self._refresh_hparams(self._devices)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for gi, group, p in todo:
            meta, tensors = self._unflat_state(p, gi, group)
            self._functional(
                *tensors, hparams=self._hp[p.device][gi : gi + 1], meta=meta, backend=self.backend,
                grad_scale=None if grad_scale is None else grad_scale.to(p.device),
                found_inf=None if found_inf is None else found_inf.to(p.device),
            )  # fmt: skip

    def _check_unflat(self, p, group):
        """flat=False: what one launch over ``p``'s own tensors needs, checked before anything is stepped."""
        cls, g = type(self).__name__, p.grad
        if g.layout != torch.strided:
            raise RuntimeError(
                f"{cls} does not support sparse gradients: parameter {self._name(p)} has a {g.layout} .grad; use "
                "sparse=False on the embedding (nn.Embedding(..., sparse=False)) that produces it"
            )
        if not is_dense(p):
            raise RuntimeError(
                f"{cls}(flat=False) needs dense parameters (no gaps or overlaps); {self._name(p)} has shape "
                f"{tuple(p.shape)} and strides {p.stride()}: make it contiguous (p.data = p.data.contiguous())"
            )
        if g.stride() != p.stride() or g.dtype != p.dtype:
            raise RuntimeError(
                f"{cls}(flat=False): the .grad of {self._name(p)} has strides {g.stride()} and dtype {g.dtype}, the "
                f"parameter {p.stride()} and {p.dtype}; they must match: give the gradient the parameter's layout "
                "(p.grad = torch.empty_like(p).copy_(p.grad))"
            )
        state = self.state.get(p, {})
        for name in self._state_names:
            t = state.get(name)
            if self._uses_state(name, group) and t is not None and (t.stride() != p.stride() or t.dtype != p.dtype):
                raise RuntimeError(
                    f"{cls}(flat=False): the state '{name}' of {self._name(p)} has strides {t.stride()} and dtype "
                    f"{t.dtype}, the parameter {p.stride()} and {p.dtype}; they must match: load a state_dict whose "
                    "tensors have the parameters' layouts and dtypes"
                )

    def _unflat_state(self, p, gi, group):
        state = self.state[p]
        meta = self._unflat_meta.get(p)
        if meta is None:
            dev = p.device
            meta = StepMeta(
                param_of_granule=torch.zeros(1, dtype=torch.int32, device=dev),
                param_group=torch.zeros(1, dtype=torch.int32, device=dev),
                steps=torch.zeros(1, dtype=torch.float32, device=dev),
                counter=torch.zeros(1, dtype=torch.int32, device=dev),
                uniform=True,
            )
            if "step" in state:
                meta.steps.fill_(float(state["step"]))
            elif any(n in state for n in self._state_names):
                meta.steps.fill_(1.0)
            self._unflat_meta[p] = meta
        for name in self._state_names:
            if name not in state and self._uses_state(name, group):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                meta.steps.zero_()
        if self._exported_step:
            state["step"] = meta.steps[0]
        tensors = [p, p.grad] + [state.get(n) for n in self._state_names]
        flat = [None if t is None else t.as_strided((t.numel(),), (1,), t.storage_offset()) for t in tensors]
        return meta, flat

    def _uses_state(self, name, group):
        return True

    def capture(self, train_step, *example_inputs, warmup=3, max_grad_norm=None, scaler=None):
        """Record zero_grad, ``train_step(*example_inputs)`` and the optimizer step as one CUDA graph.

        Args:
            train_step (Callable): runs forward and backward (and may step the optimizer itself,
                for example with ``scaler.step(opt); scaler.update()``); returns what each replay
                returns (tensors are overwritten by the next replay).
            example_inputs: tensors (copied into static inputs) and constants.
            warmup (int, optional): eager iterations on a side stream before recording; the last
                one checks that ``train_step`` does not synchronise with the host (default: 3)
            max_grad_norm (float, optional): clip the gradients by their global norm before the
                step, inside the graph (default: None)
            scaler (torch.amp.GradScaler, optional): the GradScaler ``train_step`` uses, so that
                warm-up leaves its scale as it was (default: None)

        Returns:
            CapturedStep: call it with new inputs (same shapes, dtypes and devices) to replay;
            ``release()`` frees the graph and its memory pool.
        """
        from flatopt.capture import CapturedStep

        return CapturedStep(self, train_step, example_inputs, warmup=warmup, max_grad_norm=max_grad_norm, scaler=scaler)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients of every parameter of this optimizer by their global norm, as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` does, with one norm per flat
        gradient buffer and no host synchronisation (unless ``error_if_nonfinite``).

        Returns:
            Tensor: the total norm of the gradients before clipping (float32).
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        if self.in_backward:
            raise RuntimeError(
                f"{type(self).__name__}(in_backward=True) cannot clip by the global gradient norm: each bucket "
                "of parameters is updated during backward, before the gradients of the others exist. Use "
                "in_backward=False to clip, or clip each gradient separately"
            )
        if not self.flat:
            params = [p for p in self._trainable() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        self.check_bindings(full=False)
        if not self._buffers:
            return torch.tensor(0.0)
        first = self._buffers[0].device
        norms = [torch.linalg.vector_norm(b.grad, norm_type, dtype=torch.float32).to(first) for b in self._buffers]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for b in self._buffers:  # the views, not the padding: a nan norm must not leave nan there for good
            torch._foreach_mul_(b.grad_views, coef.to(b.device, b.grad.dtype))
        return total

    def zero_grad(self, set_to_none=True):
        """Resets the gradients of all optimized parameters, as torch.optim does.

        Args:
            set_to_none (bool): instead of setting to zero, set the grads to None (default: True).

        With ``flat=True`` the gradients still land in the flat gradient buffer. ``set_to_none=True``
        sets every ``.grad`` to None; the next backward pass copies each new gradient into the
        parameter's view of the buffer and puts the view back in ``.grad`` (a read and a write of
        its bytes), and ``step()`` zeroes the views of parameters that received none. With
        ``set_to_none=False`` the views are put back in ``.grad`` (a None ``.grad`` stays None with
        ``skip_unused=True``) and each buffer is zeroed (one operation each), and autograd adds each
        gradient into its view (a write, then two reads and a write). See :mod:`flatopt.grads`.
        """
        if self.in_backward:
            self._in_backward.abandon()
            self._in_backward.pending = False  # the accumulated gradients are dropped, as torch.optim does
            return super().zero_grad(set_to_none=set_to_none)
        if not self.flat:
            return super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            self._landing.release()
            return None
        self._landing.restore()
        for buf in self._buffers:
            buf.grad.zero_()
        return None
