"""What flatopt needs of torch.distributed: the number of ranks, and the refusal of modes that would
let replicas diverge."""

import torch


def world_size():
    """The number of ranks in torch.distributed's default process group (1 when none is running)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_ddp(module):
    """Whether ``module`` is a DistributedDataParallel wrapper (False where torch.distributed is not available)."""
    if not torch.distributed.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def is_fsdp(module):
    """Whether ``module`` has had FSDP2's ``fully_shard`` applied (False where torch.distributed is not available)."""
    if not torch.distributed.is_available() or not isinstance(module, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def check_single_process(cls, allow_several_ranks=False):
    """In-backward mode steps each bucket from this rank's own gradient, as soon as it exists, before
    DistributedDataParallel averages gradients across ranks (DDP then writes its averages into
    ``.grad`` after the step), so the replicas would diverge without any error. Raises RuntimeError
    when the default process group has several ranks, unless ``allow_several_ranks`` says that the
    ranks share no parameters (pipeline stages, independent runs), so that nothing averages
    gradients between them. Not called for a DistributedDataParallel model given to the optimizer
    (its buckets are stepped once averaged: :mod:`flatopt.engines.ddp_backward`) nor for FSDP2."""
    ranks = world_size()
    if ranks > 1 and not allow_several_ranks:
        raise RuntimeError(
            f"{cls}(in_backward=True) cannot train with several distributed ranks ({ranks} here) on a model that is "
            "not given to it as DistributedDataParallel (or FSDP2): its hooks would step each parameter from this "
            "rank's gradient during backward, before DDP averages the gradients across ranks, and the replicas "
            "would diverge. Use in_backward=False with DDP or FSDP2, or, under DDP, wrap first and give the wrapper to "
            f"the optimizer: ddp = DistributedDataParallel(model); {cls}(ddp, in_backward=True) steps each DDP bucket "
            "once averaged (ZeroRedundancyOptimizer over a DDP model cannot train in backward: use step mode). If "
            "the ranks share no parameters (pipeline stages, independent runs; not replicas of one model, even "
            f"where each rank's optimizer holds other parameters), pass allow_several_ranks=True to {cls} to allow it"
        )
