"""Checks that the parameters still live where the optimizer laid them out.

A parameter's data lies in its flat buffer (over a storage of its own bytes: see :mod:`flatopt.layout`).
``model.to()``, ``model.half()`` or ``p.data = ...`` replace it; with ``skip_unused=False``, freezing a parameter
after construction would keep it stepped; a parameter added to the module (not to the optimizer) after construction
would never be stepped. The usual check looks at the first and last parameter of each buffer (O(1) host work, which
catches ``model.to()`` at once), and on the CPU also at every parameter's address (:func:`addresses_kept`); a full
check looks at every parameter. (Parameters unfrozen or added to ``param_groups`` are laid out again:
``FlatEngine.follow_members``.)
"""

import torch

from flatopt.torch_compat import is_dtensor

FULL_CHECK_EVERY = 256  # step() (or, in-backward, a backward pass) checks every parameter's bindings this often


def ends_bound(buffers):
    """Whether the first and last parameter of every buffer still hold their data views and require
    grad (a parameter moved to another device has another address), and on the CPU whether every parameter
    keeps its address (:func:`addresses_kept`)."""
    for buf in buffers:
        if buf.taken:  # another flatopt optimizer laid out one of its parameters since: look at them all
            return False
        params, expected = buf.params, buf.expected
        for i in (0, len(params) - 1):
            p = params[i]
            if p.data_ptr() != expected[i][0] or p.dtype != buf.dtype or not p.requires_grad:
                return False
        if watch_every_address(buf) and not addresses_kept(buf):
            return False
    return True


def watch_every_address(buf):
    """Whether a binding check looks at the address of every parameter of ``buf``, not its ends only: a CPU buffer
    whose parameters lie over storages of their own (``FlatBuffer.adopt``), where ``share_memory_()`` of a part of the
    model (``layer.share_memory()``, or torch.multiprocessing sending a layer or its state_dict to another process)
    moves those parameters' storages alone, in place, out of the buffer. (On a GPU ``share_memory_()`` moves
    nothing.)"""
    return buf.own_storages and buf.device.type == "cpu"


_DATA_PTR = torch.Tensor.data_ptr


def addresses_kept(buf):
    """Whether every parameter of ``buf`` still has the address it was laid out at (about 50 ns per parameter)."""
    homes = buf.__dict__.get("_homes")
    if homes is None or homes[0] is not buf.expected:
        homes = buf._homes = (buf.expected, [e[0] for e in buf.expected])
    return list(map(_DATA_PTR, buf.params)) == homes[1]


def check_data_bindings(cls, buffers, names, *, full, frozen, skip_unused, module, removed=()):
    """Raise RuntimeError, saying what to do, if a parameter of ``buffers`` no longer lives in its buffer,
    or was frozen since the layout (with ``skip_unused=False`` only); with ``full``, every parameter is
    looked at, and also trainable parameters of ``module`` (or None) that the optimizer lacks (neither
    laid out nor among the ``frozen`` parameters of its groups, nor ``removed`` from its groups). Otherwise
    only the first and last of each buffer, and every parameter of a buffer :func:`watch_every_address` names.

    Args:
        cls (str): the optimizer's class name, for messages.
        names (flatopt.naming.Names): how messages name parameters.
    """
    checked = []  # the parameters looked at: every one (full) or the first and last of each buffer
    for buf in buffers:
        every = full or buf.taken or watch_every_address(buf)
        idx = range(len(buf.params)) if every else sorted({0, len(buf.params) - 1})
        for i in idx:
            p = buf.params[i]
            checked.append(p)
            data_ptr = buf.expected[i][0]
            if p.data_ptr() != data_ptr or p.dtype != buf.dtype or p.device != buf.device:
                if _moved_in_place(p, buf, i):
                    raise RuntimeError(
                        f"{cls}: the memory of parameter {names(p)} was moved out of the optimizer's flat buffer "
                        "after the optimizer was created (share_memory() of the model or of a part of it, or "
                        "torch.multiprocessing sending it to another process, moves storages in place into shared "
                        "memory), so the optimizer would no longer update it. For parameters in shared "
                        "memory create the optimizer with flat=False after model.share_memory(); to keep the "
                        "optimizer state, save opt.state_dict() first and load it into the new optimizer"
                    )
                if id(p) in buf.taken:
                    raise RuntimeError(taken_message(cls, names(p)))
                raise RuntimeError(
                    f"{cls}: parameter {names(p)} no longer lives in the optimizer's flat buffer: its data "
                    "was replaced after the optimizer was created (model.to(), model.cuda(), model.half(), "
                    "`p.data = ...` and torch.nn.utils.prune.remove() do that). Create the optimizer after moving, "
                    "casting or pruning the model; to keep the optimizer state, save opt.state_dict() first and load "
                    "it into the new optimizer. Tools that bind parameters to memory of their own do it too, and "
                    "cannot share them with flat buffers: torch.nn.utils.vector_to_parameters, "
                    "ZeroRedundancyOptimizer(parameters_as_bucket_view=True) (use False), PostLocalSGDOptimizer's "
                    "model averaging (give it flatopt with flat=False)"
                )
    # every parameter, whatever ``full`` says: the caller looks for this case at every step (FlatEngine.frozen_since)
    now_frozen = [] if skip_unused else [p for buf in buffers for p in buf.params if not p.requires_grad]
    if now_frozen:
        raise RuntimeError(
            f"{cls}: {len(now_frozen)} parameter(s) were trainable when the optimizer was created and have "
            f"requires_grad=False now: {names.of(now_frozen)}. With skip_unused=False flatopt steps every parameter "
            "it holds, one without a gradient as if its gradient were zero, so it would keep stepping them (weight "
            "decay and momentum would still change them), where torch.optim skips a parameter whose .grad is None. "
            "Drop skip_unused=False (the default steps only parameters whose .grad is not None, as torch.optim)"
        )
    if full and module is not None:  # built from a module: a trainable parameter of it that this optimizer lacks
        held = {id(p) for buf in buffers for p in buf.params} | {id(p) for p in frozen} | {id(p) for p in removed}
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]
        if missing:
            shown = ", ".join(f"'{n}'" for n in missing[:8]) + (", ..." if len(missing) > 8 else "")
            if any(is_dtensor(p) for p in module.parameters()) and not any(
                is_dtensor(p) for b in buffers for p in b.params
            ):
                raise RuntimeError(
                    f"{cls}: the module's parameters ({shown}) are DTensors now: FSDP2's fully_shard was applied "
                    "after the optimizer was created, which holds the plain tensors they replaced and would train "
                    "nothing. Create the optimizer after fully_shard"
                )
            raise RuntimeError(
                f"{cls}: the module's trainable parameter(s) {shown} are not among the parameters the optimizer "
                "was created with, so they would never be stepped: they were replaced (load_state_dict(..., "
                "assign=True), `module.weight = nn.Parameter(...)`) or added since. Load weights with "
                "load_state_dict() without assign=True (it copies into the parameters), give new parameters "
                "to opt.add_param_group(), or create the optimizer afterwards"
            )


def taken_message(cls, name):
    """The refusal of a parameter that another flatopt optimizer laid out after this one (``FlatBuffer.taken``)."""
    return (
        f"{cls}: parameter {name} was laid out by another flatopt optimizer, created over it after this one (deleted "
        "since or not): a parameter lives in the flat buffers of one flatopt optimizer at a time, so this one would "
        "no longer update it. Keep one flatopt optimizer per parameter: delete this one, and what holds it (its LR "
        "scheduler, a trainer), before creating the other, or create the other with flat=False or as a torch.optim "
        "optimizer"
    )


def _moved_in_place(p, buf, i):
    """Whether ``p`` still holds the data tensor ``buf`` bound it to (same storage, same offset, dtype and device) and
    only the storage's memory moved: ``share_memory_()`` does that to a CPU storage."""
    view = buf.data_views[i]
    return (
        p.untyped_storage()._cdata == view.untyped_storage()._cdata
        and p.storage_offset() == view.storage_offset()
        and p.dtype == view.dtype
        and p.device == view.device
    )


def check_own_memory(cls, names, params, placed):
    """Raise, before anything is laid out, for parameters that ``flat=True`` cannot copy into its buffers without
    changing what torch.optim would do: a CPU parameter in shared memory (its updates would no longer reach the
    other processes that map it) and parameters whose memory overlaps (torch.optim updates the common elements
    once per parameter, and each sees the other's updates). ``placed``: the parameters already laid out (views of
    the optimizer's own buffers)."""
    spans = {}
    for p in params:
        if p in placed or is_dtensor(p) or p.numel() == 0:
            continue
        storage = p.untyped_storage()
        if p.device.type == "cpu" and storage.is_shared():
            raise ValueError(
                f"{cls}(flat=True) would copy parameter {names(p)} out of shared memory (model.share_memory(), or "
                "a model received from another process through torch.multiprocessing) into the optimizer's own "
                "buffer, so other processes would no longer see its updates, as they do with torch.optim. Use "
                "flat=False, which steps the parameters where they are"
            )
        start = p.storage_offset() * p.element_size()
        spans.setdefault((p.device, storage.data_ptr()), []).append((start, start + p.numel() * p.element_size(), p))
    for ranges in spans.values():
        ranges.sort(key=lambda r: r[:2])
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
            if start < end:
                raise ValueError(
                    f"{cls}(flat=True): parameters {names(a)} and {names(b)} share memory (views of one tensor that "
                    "overlap); the optimizer copies each parameter into its own place in its buffers, so they would "
                    "no longer share it, where torch.optim updates the common elements in place. Make them separate "
                    "tensors (nn.Parameter(t.clone())), or use flat=False"
                )
