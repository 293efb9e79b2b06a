"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as flatopt sees it: which parameters are FSDP2's, where their
local shards live, and how flatopt's flat buffer becomes their storage.

FSDP2 keeps each parameter's local shard in a padded 1-D tensor of its own (``FSDPParam._sharded_param_data``),
all-gathers from it before forward and backward, and shows its first ``length`` rows as the DTensor
parameter's local tensor (the shards of the last ranks of an unevenly sharded parameter are shorter than the
padded size, or empty)::

    flat data buffer of one (device, dtype) on one rank
    ┌──── shard of p0 ────┬ FSDP2 pad ┬ align ┬──── shard of p1 ────┬ align ┐
    │ p0._local_tensor    │           │       │ p1._local_tensor    │       │
    └─────────────────────┴───────────┴───────┴─────────────────────┴───────┘
    ^ FSDPParam._sharded_param_data of p0 ^    ^ ... of p1 ^

:func:`bind` points both at views of flatopt's flat buffer, which reserves the padded size for each shard: FSDP2
then all-gathers straight from the buffer that the step kernel updates in place, and its own
``reset_sharded_param`` (at lazy initialisation, after ``load_state_dict``, in ``module._apply``) keeps them,
because they share one storage. Those two attributes are FSDP2's private ones: :func:`shards_of` checks that they
are as this module expects (a plain padded 1-D tensor, and a local tensor at its start) and refuses the model
otherwise, before anything changes, as it refuses what flatopt cannot step: DTensor parameters that FSDP2 does not
manage (tensor parallelism), FSDP2 over a tensor-parallel mesh, CPU offloading, and shards on meshes whose
process groups differ (a global gradient norm takes one all-reduce over one group).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


def is_fsdp_module(module):
    from torch.distributed.fsdp import FSDPModule  # only where torch.distributed is available

    return isinstance(module, FSDPModule)


def param_groups_of(module):
    """The FSDPParamGroup of every ``fully_shard``-ed submodule of ``module`` (itself included), in module order."""
    groups = []
    for m in module.modules():
        if not is_fsdp_module(m):
            continue
        state = m._get_fsdp_state()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:
            one = getattr(state, "_fsdp_param_group", None)
            found = [] if one is None else [one]
        groups.extend(g for g in found if g is not None)
    return groups


@dataclass
class Shard:
    """What flatopt needs of one FSDP2 parameter on this rank."""

    fsdp_param: object  # FSDP2's FSDPParam
    group: int  # the index of its fully_shard group (FSDPParamGroup) in the model
    local: torch.Tensor  # the local shard (DTensor._local_tensor), at the start of...
    room: int  # ...FSDP2's padded shard, of this many elements
    process_group: object  # the process group its shards are spread over (the shard dimension of the mesh)


def local_of(t):
    """A DTensor's local tensor, or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def is_dtensor(t):
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shards_of(cls, names, params, module):
    """{parameter: :class:`Shard`} of the trainable DTensor ``params`` (all FSDP2's), checked: raises ValueError,
    saying what to do, for what flatopt cannot step. ``module``: the model given to the optimizer (or None)."""
    dtensors = [p for p in params if is_dtensor(p)]
    if not dtensors:
        return {}
    plain = [p for p in params if not is_dtensor(p) and p.requires_grad]
    if plain:
        raise ValueError(
            f"{cls}: {names.of(plain)} are plain tensors and {names.of(dtensors[:3])} are DTensors (FSDP2); flatopt "
            "steps a model whose trainable parameters are all sharded by fully_shard: apply fully_shard to the root "
            "module too (fully_shard(model) after its submodules)"
        )
    if module is None:
        raise ValueError(
            f"{cls}: the parameters are DTensors (FSDP2's fully_shard), and flatopt finds FSDP2's shards through the "
            f"model: pass the model itself ({cls}(model, ...)), or model=model beside param groups"
        )
    owners = {}
    for gi, group in enumerate(param_groups_of(module)):
        for fp in group.fsdp_params:
            owners[fp.sharded_param] = (gi, fp)
    shards, process_groups = {}, {}
    for p in dtensors:
        found = owners.get(p)
        if found is None:
            raise ValueError(
                f"{cls}: parameter {names(p)} is a DTensor that fully_shard (FSDP2) does not manage: DTensors of "
                "tensor parallelism (parallelize_module, distribute_tensor) or of a pipeline stage's own sharding "
                "are not supported; flatopt steps FSDP2's sharded parameters (fully_shard on a 1-D mesh, or HSDP on a "
                "2-D (replicate, shard) mesh). Use torch.optim for this model"
            )
        gi, fp = found
        why = _unsupported(fp, p)
        if why:
            raise ValueError(f"{cls}: parameter {names(p)}: {why}. Use torch.optim for this model")
        pg = fp.shard_mesh.get_group()
        process_groups.setdefault(tuple(dist.get_process_group_ranks(pg)), (pg, p))
        shards[p] = Shard(fp, gi, p._local_tensor, fp._sharded_param_data.numel(), pg)
    if len(process_groups) > 1:
        seen = ", ".join(f"{names(p)} over ranks {list(r)}" for r, (_, p) in process_groups.items())
        raise ValueError(
            f"{cls}: the FSDP2 shards are spread over different process groups ({seen}); flatopt takes the global "
            "gradient norm with one all-reduce over one group: shard every fully_shard group over the same mesh"
        )
    return shards


def _unsupported(fp, p):
    """Why flatopt cannot step FSDP2 parameter ``p`` (its FSDPParam ``fp``), or None."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    if getattr(fp, "offload_to_cpu", False):
        return "FSDP2 offloads it to the CPU (CPUOffloadPolicy), whose pinned shards flatopt's buffers do not replace"
    mesh = p.device_mesh
    placements = tuple(p.placements)
    fsdp_like = (len(placements) == 1 and isinstance(placements[0], ShardPlacement)) or (
        len(placements) == 2 and isinstance(placements[0], Replicate) and isinstance(placements[1], ShardPlacement)
    )
    if not fsdp_like or mesh.ndim != len(placements) or getattr(fp, "_tp_spec", None) is not None:
        return (
            f"it is placed {placements} on a {mesh.ndim}-D mesh; flatopt steps FSDP2 shards (Shard on a 1-D mesh, or "
            "(Replicate, Shard) for HSDP), not tensor-parallel ones"
        )
    data, local = getattr(fp, "_sharded_param_data", None), p._local_tensor
    if type(data) is not torch.Tensor or type(local) is not torch.Tensor or data.dim() != 1:
        return (
            "its local shard is not a plain tensor at the start of FSDP2's padded 1-D shard (a tensor subclass, such "
            "as float8 training's, or a torch version whose FSDP2 keeps its shards otherwise)"
        )
    if local.numel() and (local.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
                          or local.data_ptr() != data.data_ptr() or not local.is_contiguous()):  # fmt: skip
        return "its local shard does not lie at the start of FSDP2's padded shard, as flatopt expects"
    if getattr(fp, "sharded_state", ShardedState.SHARDED) != ShardedState.SHARDED:
        return (
            "FSDP2 holds it unsharded now (between forward and backward); create the optimizer outside forward and "
            "backward"
        )
    return None


def bind(shard, padded, local):
    """Make FSDP2 keep the shard in ``padded`` (a 1-D view of flatopt's buffer, FSDP2's padded size) and show
    ``local`` (its first elements, with the local shard's shape) as the parameter's local tensor."""
    fp = shard.fsdp_param
    fp._sharded_param_data = padded
    fp.sharded_param._local_tensor = local
    shard.local = local


def unbind(shard):
    """Give the shard storage of its own again (a parameter removed from the optimizer's groups)."""
    fp = shard.fsdp_param
    padded = fp._sharded_param_data.clone()
    local = shard.local
    bind(shard, padded, padded[: local.numel()].view(local.shape))


def bound(shard, padded_ptr, local_ptr):
    """Whether FSDP2 still keeps the shard where :func:`bind` put it (a model moved or cast replaces it)."""
    fp = shard.fsdp_param
    p = fp.sharded_param
    return (
        fp._sharded_param_data.data_ptr() == padded_ptr
        and is_dtensor(p)
        and p._local_tensor.data_ptr() == local_ptr
        and p._local_tensor is shard.local
    )
