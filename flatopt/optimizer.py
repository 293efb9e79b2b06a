"""The base class of flatopt's optimizers: torch.optim's interface in front of one engine.

:class:`FlatOptimizer` checks what torch.optim checks, parses flatopt's options once
(:class:`flatopt.options.FlatOptions`), and holds one engine chosen at construction
(:mod:`flatopt.engines`) that does the work: the flat step engine, the in-backward engine or the
per-parameter engine. Each optimizer's update rule (hyper-parameter columns, validation, states)
is its ``rule`` (:mod:`flatopt.rules`).
"""

import dataclasses
import functools
import os
import weakref

import torch
from torch import nn

from flatopt.checkpoint import CheckpointMixin
from flatopt.distributed import check_single_process, is_ddp
from flatopt.engines import make_engine
from flatopt.functional import BACKENDS
from flatopt.hparams import HParamTable
from flatopt.layout import SUPPORTED_DTYPES, is_dense
from flatopt.naming import Names
from flatopt.options import FlatOptions
from flatopt.precision import draw_seed
from flatopt.torch_compat import hooked_step, is_dtensor, normal_tensors, own_dispatch


def _in_inference_mode(closure):
    with torch.inference_mode():
        return closure()


class FlatOptimizer(CheckpointMixin, torch.optim.Optimizer):
    """torch.optim.Optimizer whose parameters, gradients and states live in flat buffers.

    Subclasses set ``rule`` (see :mod:`flatopt.rules`) and pass torch.optim's hyper-parameters as
    ``defaults``; flatopt's own options arrive as keyword arguments (:class:`FlatOptions`).
    """

    rule = None
    _step_supports_amp_scaling = True  # GradScaler passes grad_scale / found_inf; no host sync

    @normal_tensors
    def __init__(self, params, defaults, **options):
        cls = type(self).__name__
        self.engine = None
        self._given_entries = {}  # the groups given a parameter more than once (see CheckpointMixin)
        self.options = FlatOptions.parse(cls, options)
        self.use_step_graph = True  # replay step()'s launches from a CUDA graph (see flatopt.step_graph)
        self.module = None  # weak reference to the module, when given one (capture restores its buffers)
        model = self.options.model
        if model is not None:  # held weakly, as the module is: the options keep no model alive
            self._check_module(model)
            self.options = dataclasses.replace(self.options, model=None)
        by_name = {}
        ddp = is_ddp(model) or is_ddp(params)  # in-backward mode steps DDP's buckets (flatopt.engines.ddp_backward)
        if isinstance(params, nn.Module):
            self._check_module(params)
            by_name = {p: n for n, p in params.named_parameters()}
            self.module = weakref.ref(params)
            params = list(params.parameters())
        self.names = Names(by_name, [])
        self.rule.check(defaults)
        if self.rule.check_args is not None:
            self.rule.check_args(defaults)
        defaults = {**defaults, **dict(self.rule.torch_keys)}  # torch.optim's keys, at values that change nothing
        self.hparams = HParamTable(self.rule.row, self.rule.check, self.rule.lr_column, self.rule.switches)
        super().__init__(params, defaults)
        self.names.param_groups = self.param_groups
        # in-backward hooks step each rank's own gradient, except under FSDP2, whose hooks run after its reduce-scatter,
        # and under DDP given as the model, whose buckets are stepped from a communication hook once averaged
        sharded = any(is_dtensor(p) for g in self.param_groups for p in g["params"])
        if self.options.in_backward and not ddp and not sharded:
            check_single_process(cls, self.options.allow_several_ranks)
        self.precision = self.options.precision  # how parameters and states are stored (see flatopt.precision)
        self.precision.check_params(cls, self.rule, self.param_groups)
        if not self.precision.default and any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            raise ValueError(
                f"{cls}: master_weights, stochastic_rounding and state_dtype are not supported on FSDP2 (DTensor) "
                "parameters yet; leave them at their defaults with a fully_shard model"
            )
        # stochastic rounding's seed, from torch's default generator (state_dict() saves it)
        self.rounding_seed = draw_seed() if self.precision.stochastic_rounding else None
        # the model whose covered layers write their gradients into the flat buffer (see flatopt.landing)
        self.model = weakref.ref(model) if model is not None else self.module
        self.backend = self._choose_backend(self.options.backend)
        self.engine = make_engine(self)

    # flatopt's options, read-only (set them at construction)
    flat = property(lambda self: self.options.flat)
    skip_unused = property(lambda self: self.options.skip_unused)
    in_backward = property(lambda self: self.options.in_backward)
    bucket_size = property(lambda self: self.options.bucket_size)
    accumulation_steps = property(lambda self: self.options.accumulation_steps)
    max_grad_norm = property(lambda self: self.options.max_grad_norm)
    norm_type = property(lambda self: self.options.norm_type)

    @property
    def last_grad_norm(self):
        """With ``in_backward=True`` and ``max_grad_norm``: the total norm (before clipping, a tensor on the
        device) of the gradients of the last stepped backward pass, or of the last ``step()`` that stepped
        gradients left in ``.grad``; None before the first, and without ``max_grad_norm``."""
        clip = getattr(self.engine, "clip", None)
        return None if clip is None else clip.last

    # ------------------------------------------------------------------ copies
    def _cannot_copy(self):
        """The error for any attempt to copy or serialise the optimizer object, raised before anything is built."""
        cls = type(self)
        name = f"flatopt.{cls.__name__}" if cls.__module__.startswith("flatopt.") else cls.__name__
        options = self.__dict__.get("options") or FlatOptions()
        if options.flat:
            held = "parameters and states" if options.in_backward else "parameters, gradients and states"
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

    @normal_tensors
    def add_param_group(self, param_group):
        if isinstance(param_group, dict):
            params = param_group["params"]
            if not isinstance(params, set):  # torch.optim raises its own error for a set (unordered)
                # a list as torch.optim makes it, so that a generator's parameters are checked too
                param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                for p in param_group["params"]:
                    p = p[1] if isinstance(p, tuple) else p
                    if isinstance(p, torch.Tensor):
                        self.check_param(p)
            self.rule.check({**self.defaults, **param_group})
        if self.engine is not None:
            self.engine.sync_state()  # a pending edit of opt.state that cannot be honoured raises before the group
            if isinstance(param_group, dict):  # the storage options against the new parameters, before anything
                group = {**self.defaults, **param_group}  # as torch.optim fills it in
                self.precision.check_params(type(self).__name__, self.rule, [*self.param_groups, group])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if len(group["params"]) != len(set(group["params"])):  # tied parameters appear once
            self._keep_given_entries(group)  # state_dict() lists them as given, as torch.optim
            names = group.get("param_names")
            if names is not None:
                first = {}
                for p, name in zip(group["params"], names, strict=True):
                    first.setdefault(p, name)
                group["param_names"] = list(first.values())
            group["params"] = list(dict.fromkeys(group["params"]))
        if self.engine is not None:
            try:
                self.engine.build()  # refuses parameters it cannot lay out (shared memory, overlaps) before any change
            except BaseException:
                self.param_groups.pop()  # refused: the groups as they were
                self._given_entries.pop(id(group), None)
                if getattr(self.engine, "detached", False):  # failed past the checks (out of memory): lay the
                    try:  # groups out as they were, reconnecting their gradients and hooks
                        self.engine.build()
                    except BaseException:
                        pass  # still detached: the next step() or zero_grad() lays them out (members_changed)
                raise

    def check_param(self, p):
        """Raise, saying what to do, for a parameter this optimizer cannot hold."""
        cls, flat = type(self).__name__, self.options.flat
        if not p.requires_grad and p.grad is None:  # never stepped, as torch.optim; checked if it starts requiring grad
            return
        if p.is_complex():
            raise ValueError(
                f"{cls} does not support complex parameters (got {p.dtype}); "
                "optimize torch.view_as_real(p) as a real parameter instead"
            )
        if p.layout != torch.strided:
            raise ValueError(f"{cls} does not support {p.layout} parameters; use dense parameters")
        if p.dtype not in SUPPORTED_DTYPES:
            *most, last = (str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            supported = f"{', '.join(most)} and {last}"
            raise ValueError(
                f"{cls} supports {supported} parameters, got {p.dtype}; "
                "convert the model with model.to(torch.float32) before creating the optimizer"
            )
        if is_dtensor(p) and not flat:
            raise ValueError(
                f"{cls}(flat=False) cannot step {self.names(p)}, a DTensor (FSDP2's fully_shard): DTensor parameters "
                "are stepped with flat=True (the default), whose buffers hold each rank's local shards; drop "
                "flat=False. See docs/distributed.md"
            )
        if own_dispatch(p) and not is_dtensor(p) and flat:
            raise ValueError(  # flat buffers hold plain storage
                f"{cls} steps plain tensors, and {self.names(p)} is a {type(p.data).__name__}: "
                "tensor subclasses with their own dispatch keep their own layout and storage, which flat buffers "
                "cannot hold. Use torch.optim for them"
            )
        if flat and p.is_meta:
            raise ValueError(
                f"{cls}(flat=True) copies the parameters into its buffers, and a parameter on the "
                "meta device has no data; materialise the model first (model.to_empty(device=...), then initialise "
                "the parameters) and create the optimizer after"
            )
        if not is_dense(p):  # flat=False: its step launches over the parameter's own storage
            raise ValueError(
                f"{cls}(flat={flat}) needs dense parameters (no gaps or overlaps), got shape "
                f"{tuple(p.shape)} with strides {p.stride()}; make it contiguous before creating the optimizer"
            )
        precision = getattr(self, "precision", None)  # (set once the constructor's groups are in: it checks those)
        if precision is not None:  # a parameter trainable since construction, or added: as check_params checks
            precision.check_dtype(cls, p.dtype, self.names(p))

    def _choose_backend(self, backend):
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        on_cuda = bool(trainable) and all(p.is_cuda for p in trainable)
        on_cpu = all(p.device.type == "cpu" for p in trainable)
        if backend is None:
            return "triton" if on_cuda else "cpu" if on_cpu else "torch"
        if backend not in BACKENDS:
            raise ValueError(f"Invalid backend: {backend!r}; expected one of {BACKENDS}")
        if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' runs on CUDA tensors, and some parameters are not on a CUDA device; "
                "use backend='cpu' (the default on the CPU), or set TRITON_INTERPRET=1 before importing "
                "triton to run the kernels under the Triton interpreter"
            )
        if backend == "cpu" and not on_cpu:
            where = sorted({str(p.device) for p in trainable if p.device.type != "cpu"})
            raise ValueError(
                f"backend='cpu' runs on CPU tensors, and some parameters are on {', '.join(where)}; use "
                "backend='triton' for CUDA parameters (the default there), or backend='torch' (pure torch, any device)"
            )
        return backend

    # ------------------------------------------------------------------ torch.optim's interface
    @hooked_step
    def step(self, closure=None):
        """Performs a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model and returns the loss.
        """
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if not torch.is_inference_mode_enabled():
            return self.engine.step(closure, grad_scale, found_inf)
        # called under inference mode: what the step allocates (a re-layout) must be normal tensors (see
        # normal_tensors), while the closure runs in the caller's mode, as torch.optim runs it
        if closure is not None:
            closure = functools.partial(_in_inference_mode, closure)
        with torch.inference_mode(False):
            return self.engine.step(closure, grad_scale, found_inf)

    @normal_tensors
    def zero_grad(self, set_to_none=True):
        """Resets the gradients of all optimized parameters, as torch.optim does.

        Args:
            set_to_none (bool): instead of setting to zero, set the grads to None (default: True).

        With ``flat=True`` the gradients still land in the flat gradient buffer. ``set_to_none=True``
        sets every ``.grad`` to None and, on a GPU, releases the buffer's storage until the next
        gradient arrives; covered layers write their gradients into their views, the others are
        copied in (a read and a write of their bytes; on the CPU by ``step()``: docs/gradients.md),
        and ``step()`` leaves the parameters that received none untouched. With
        ``set_to_none=False`` the views are put back in ``.grad`` (a None ``.grad`` stays None, unless
        ``skip_unused=False``) and each buffer is zeroed (one operation each), and autograd adds each
        gradient into its view (a write, then two reads and a write). Parameters unfrozen or added to
        ``param_groups`` since the last step are laid out first. See :mod:`flatopt.grads`.
        """
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):  # torch.optim's profiler label
            self.engine.zero_grad(set_to_none)

    def no_step(self):
        """Context manager for gradient accumulation in in-backward mode.

        Backward passes inside it do not update the parameters: their gradients accumulate in
        ``p.grad`` as with torch.optim (holding a full set of gradients, so in-backward mode saves
        no memory during accumulation). The next backward pass outside it steps with the sum, or
        ``step()`` does. Passes inside it are not counted in ``accumulation_steps``' windows.
        In step mode (``in_backward=False``) gradients accumulate in the flat buffer anyway and
        this does nothing.
        """
        return self.engine.no_step()

    @normal_tensors
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients of every parameter of this optimizer by their global norm, as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` does, with one norm per flat
        gradient buffer (per parameter with a gradient for a ``norm_type`` of 0 or below, as torch) and no host
        synchronisation (unless ``error_if_nonfinite``).

        With ``in_backward=True`` the gradients of a backward pass are applied and freed during it: after such a
        pass (and before the next ``step()`` or ``zero_grad()``) this returns the norm the pass was clipped by in
        backward when the optimizer was built with the same ``max_grad_norm`` and ``norm_type``, and raises
        otherwise; gradients still in ``.grad`` (accumulated, not yet stepped) are clipped as torch clips them,
        or, with ``max_grad_norm``, left for the optimizer to clip when it steps them (their norm is returned).
        See docs/in-backward.md, "Clipping".

        Returns:
            Tensor: the total norm of the gradients before clipping (float32; float64 when a gradient is).
        """
        return self.engine.clip_grad_norm_(float(max_norm), float(norm_type), error_if_nonfinite)

    @normal_tensors
    def check_bindings(self, full=True):
        """Lay the parameters out again if ``param_groups`` or ``requires_grad`` changed (as ``step()``
        and ``zero_grad()`` do); raise if a parameter's data no longer lives in the flat buffers, or
        (with ``skip_unused=False``) one that was trainable is frozen now (it would still be stepped
        with a zero gradient); then settle the gradients.

        ``step()`` checks every parameter at the first step and at every ``FULL_CHECK_EVERY``-th
        (256th) step after it, and otherwise only the first and last parameter of each buffer
        (``full=False``, O(1) host work, which catches ``model.to(...)`` at once; on the CPU also every
        parameter's address, as ``share_memory()`` of one layer moves it alone). Call this
        (``full=True``) to check every parameter now.

        Settling, with ``flat=True`` in step mode (see :mod:`flatopt.grads`): a ``.grad`` that is
        None gets its view zeroed (and stays None; with ``skip_unused=False`` the view is put back),
        one that is a tensor of its own is copied into its view, which is put back; a sparse ``.grad``
        or one with autograd history raises. Every ``.grad`` is looked at (at every ``step()`` too, as
        torch.optim's step looks at every ``.grad``).
        """
        self.engine.check_bindings(full)

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
