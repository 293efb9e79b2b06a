"""What flatopt needs of torch.distributed: the number of ranks, and the refusal of modes that would
let replicas diverge."""

import torch


def world_size():
    """The number of ranks in torch.distributed's default process group (1 when none is running)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_single_process(cls, allow_several_ranks=False):
    """In-backward mode steps each bucket from this rank's own gradient, as soon as it exists, before
    DistributedDataParallel averages gradients across ranks (DDP then writes its averages into
    ``.grad`` after the step), so the replicas would diverge without any error. Raises RuntimeError
    when the default process group has several ranks, unless ``allow_several_ranks`` says that the
    ranks share no parameters (pipeline stages, independent runs), so that nothing averages
    gradients between them."""
    ranks = world_size()
    if ranks > 1 and not allow_several_ranks:
        raise RuntimeError(
            f"{cls}(in_backward=True) cannot train with several distributed ranks ({ranks} here): it steps each "
            "parameter from this rank's gradient during backward, before DistributedDataParallel averages the "
            "gradients across ranks, so the replicas would diverge. Use in_backward=False with DDP or FSDP2. If the "
            f"ranks share no parameters (pipeline stages, independent runs), pass allow_several_ranks=True to {cls} to "
            "allow it"
        )
