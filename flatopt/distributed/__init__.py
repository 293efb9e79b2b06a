"""flatopt on torch.distributed: the number of ranks, DDP models and the refusals
(:mod:`flatopt.distributed.ranks`), and FSDP2's sharded parameters (:mod:`flatopt.distributed.fsdp`)."""

from flatopt.distributed.ranks import check_single_process, is_ddp, is_fsdp, world_size

__all__ = ["check_single_process", "is_ddp", "is_fsdp", "world_size"]
