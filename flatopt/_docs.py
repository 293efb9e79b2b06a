"""Docstring fragments shared by the optimizers, written once (as torch/optim/optimizer.py does)."""

PARAMS = """params (nn.Module or iterable): a module (its parameters, with their names for messages),
            an iterable of parameters, or an iterable of dicts defining parameter groups as in
            torch.optim. Parameters with ``requires_grad=False`` are kept in the groups but never
            stepped; tied parameters appear once."""

FLAT = """flat (bool, optional): keep parameters, gradients and states in flat buffers, one per
            (device, dtype), stepped by one kernel launch each; ``p.data`` and ``p.grad`` become
            views. ``False`` leaves the caller's tensors where they are and launches once per
            parameter (default: True)
        backend (str, optional): ``"triton"`` (the default when every parameter is on CUDA),
            ``"cpu"`` (the default when every parameter is on the CPU: torch's fused CPU kernels and
            chunked in-place code over the same buffers, one call per run of parameters sharing a
            param group and step count; see :mod:`flatopt.cpu`) or ``"torch"`` (pure torch over the
            same buffers, on any device: the reference the tests compare with)
        skip_unused (bool, optional): leave parameters whose ``.grad`` is None at ``step()``
            untouched (no weight decay, no state update, step count unchanged), exactly as
            torch.optim does. When every parameter has a gradient the step is the same single
            launch per buffer; otherwise a small mask per pattern of missing gradients is
            uploaded once and reused. ``False`` steps such parameters with a zero gradient
            (weight decay and state decay apply) (default: True)
        in_backward (bool, optional): step each bucket of parameters during backward, from
            post-accumulate-grad hooks, as soon as its gradients exist, and free those gradients:
            there is no flat gradient buffer and ``p.grad`` is None after backward. ``step()`` and
            ``zero_grad()`` remain callable and do nothing harmful; one of them must come between
            two stepping backward passes (a second one is refused before it updates anything).
            Not compatible with GradScaler, reentrant activation checkpointing or ``flat=False``;
            accumulate gradients with ``accumulation_steps`` or ``with opt.no_step():``, clip with
            ``max_grad_norm``. Under DistributedDataParallel give the optimizer the DDP wrapper
            (``params=ddp``, or param groups with ``model=ddp``): each DDP bucket is then stepped
            from a communication hook once averaged (no ``accumulation_steps`` nor
            ``max_grad_norm`` there; see docs/distributed.md) (default: False)
        bucket_size (int, optional): with ``in_backward=True``, the most elements of consecutive
            parameters stepped by one kernel launch; gradient memory held by the optimizer is
            about one bucket (default: 2**25)
        allow_several_ranks (bool, optional): with ``in_backward=True`` on a model not given
            as DistributedDataParallel (nor FSDP2), allow several torch.distributed ranks whose
            models share no parameters (pipeline stages, independent runs); refused by default,
            since the per-parameter hooks step each rank's own gradient. Not needed, and not
            looked at, with the DDP wrapper given, whose buckets are stepped once averaged; a model
            wrapped in DDP after such an optimizer was created is not detected (default: False)
        accumulation_steps (int, optional): with ``in_backward=True`` only, the backward passes
            per optimizer step, for loops a framework drives (transformers' Trainer
            ``gradient_accumulation_steps``, Lightning's ``accumulate_grad_batches``). Passes are
            counted from the last ``step()`` or ``zero_grad()``: the first ``k - 1`` accumulate
            in ``.grad`` (as under ``no_step()``), the ``k``-th steps with the sum during
            backward; ``step()`` before it steps what was accumulated. The loss is not scaled
            (default: 1)
        max_grad_norm (float, optional): with ``in_backward=True`` only, clip by the global
            gradient norm in backward: each bucket's gradient is multiplied, in its launch, by
            ``min(1, max_grad_norm / (n + 1e-6))``, ``n`` the larger of the previous stepped
            pass's total norm and the norm of this pass's gradients stepped so far (this
            bucket's included); a ``step()`` that steps gradients left in ``.grad`` clips by
            their total norm, as torch does. ``torch.nn.utils.clip_grad_norm_`` called with the
            same value after backward returns the norm (``opt.last_grad_norm``); without this
            option such a call raises. Over an FSDP2 model a ``fully_shard`` group plays the
            bucket's part and every norm is global (one scalar all-reduce per group), so every
            rank clips by the same coefficient (docs/distributed.md) (default: None, no clipping)
        norm_type (float, optional): the norm of ``max_grad_norm``: 2.0, 1.0 or inf (default: 2.0)

        direct_grads (bool, None or str, optional): in step mode, whether the covered layers (``nn.Linear``,
            ``nn.Embedding``) of the model write their gradients straight into the flat gradient
            buffer: ``None`` on a GPU but not on the CPU (where the step reads autograd's
            gradients in place), ``True`` on every device, ``False`` nowhere; every other gradient
            is copied in (docs/gradients.md). ``"gather"``: no layer covered and no copying hook
            on any device; ``step()`` reads the gradients where autograd left them, as on the CPU
            (the Triton kernels every one they can, storing none into the flat gradient buffer;
            the CPU backend the large ones; docs/gradients.md) (default: None)
        model (nn.Module, optional): the model whose covered layers write their gradients into
            the buffer when ``params`` are parameters or param groups; with ``in_backward=True``,
            only a DistributedDataParallel model, whose buckets are then stepped (default:
            ``params`` when it is a module)
        master_weights (str, optional): for bfloat16 parameters (``"fp32"``: also float16), keep
            a float32 master copy (``"fp32"``) or the 16 bits bfloat16 drops from it
            (``"remainder"``: parameter and remainder are the float32 master bit for bit); the
            parameters are the master rounded to nearest. See docs/precision.md (default: None)
        stochastic_rounding (bool, optional): round bfloat16 parameters stochastically from the
            float32 update (no master copy), from a seeded stream saved in the state dict
            (default: False)
        state_dtype (torch.dtype or str, optional): the states' storage: None (the parameter's
            dtype), ``torch.float32``, ``torch.bfloat16`` or ``"int8"`` (block-wise 8-bit, a
            float32 scale per 64 elements; parameters under 4096 elements keep float32 states)
            (default: None)

        flatopt's own options (``flat`` to ``state_dtype``) are keyword-only; any other keyword raises
        TypeError."""

# torch.optim's implementation options, taken at the values that change nothing for flatopt (see
# flatopt.options.check_torch_options); any other value raises ValueError saying why.
FOREACH = """foreach (None, optional): only None: flatopt always steps each flat buffer with one
            fused kernel, neither torch.optim's foreach nor its for-loop implementation (whose
            rounding differs), so ``True`` and ``False`` are refused (default: None)"""

CAPTURABLE = """capturable (bool, optional): taken at either value and ignored: flatopt keeps step
            counts and hyper-parameters on the device whatever it says, and ``capture()``
            records the training step in a CUDA graph (default: False)"""

DIFFERENTIABLE = """differentiable (bool, optional): only False: the step updates the parameters in place
            outside autograd (default: False)"""

FUSED = """fused (bool, optional): None or True: flatopt always steps each flat buffer with one fused
            kernel, so ``False`` is refused (default: None)"""

NOTES = """
    Gradients: with ``flat=True`` gradients live in one flat buffer per (device, dtype).
    ``zero_grad()`` sets every ``.grad`` to None and, on a GPU, frees the buffer's storage, as
    torch.optim frees its gradients; there covered layers (``nn.Linear``, ``nn.Embedding``) write
    each new gradient into the parameter's view, and a hook copies the others in and puts the view
    back in ``.grad`` (on the CPU ``step()`` reads or gathers autograd's gradients: docs/gradients.md);
    ``zero_grad(set_to_none=False)`` zeroes the buffer and keeps the views. ``step()`` leaves
    parameters whose ``.grad`` is None untouched, as torch.optim does (``skip_unused=False`` steps
    them with a zero gradient), and copies in a ``.grad`` set behind the optimizer's back. ``step()`` accepts
    GradScaler's ``grad_scale`` and ``found_inf`` inside the kernel, with no host synchronisation.

    The implementation options of torch.optim (or lion-pytorch) named above are taken for
    drop-in use at the values that change nothing and refused, with the reason, at any other.
    The parameter groups carry torch.optim's keys (``foreach``, ``fused``, ``differentiable``, and
    for AdamW ``capturable``, ``amsgrad``, ``decoupled_weight_decay``) at torch's defaults, whatever
    was passed, so that code reading them works and a torch.optim optimizer loading flatopt's state
    dict keeps its own defaults; those a torch.optim state dict records are kept in the groups,
    saved again, and change nothing (but AdamW refuses ``amsgrad=True``).

    Checkpoints: the optimizer object cannot be pickled or copied (``copy.deepcopy``,
    ``torch.save(opt)``): with ``flat=True`` its tensors are views into buffers shared with the
    model. Save ``opt.state_dict()`` and load it into an optimizer created for the model it is
    restored to.
    ``state_dict()`` and ``load_state_dict()`` run the hooks registered on them as torch.optim's do.
"""
