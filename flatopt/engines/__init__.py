"""Engines: the one that does an optimizer's work, chosen at construction.

* :class:`FlatStepEngine` (the default): flat buffers, ``step()`` launches once per buffer;
* :class:`InBackwardEngine` (``in_backward=True``): flat parameters and states, buckets stepped
  during backward;
* :class:`PerParamEngine` (``flat=False``): the caller's own tensors, one launch per parameter;
* :class:`FSDPStepEngine` (step mode, parameters sharded by FSDP2's ``fully_shard``): flat buffers of each
  rank's local shards, ``step()`` launches once per buffer;
* :class:`FSDPInBackwardEngine` (``in_backward=True`` over FSDP2): the same layout, each fully_shard group
  stepped by one launch once FSDP2 has reduce-scattered its gradients;
* :class:`DDPInBackwardEngine` (``in_backward=True`` given a DistributedDataParallel model): the in-backward
  layout, each DDP bucket stepped from a communication hook once DDP has averaged it.
"""

from flatopt.distributed import is_ddp
from flatopt.engines.base import Engine, FlatEngine
from flatopt.engines.ddp_backward import DDPInBackwardEngine
from flatopt.engines.fsdp import FSDPStepEngine
from flatopt.engines.fsdp_backward import FSDPInBackwardEngine
from flatopt.engines.in_backward import InBackwardEngine
from flatopt.engines.per_param import PerParamEngine
from flatopt.engines.step import FlatStepEngine
from flatopt.torch_compat import is_dtensor

__all__ = [
    "DDPInBackwardEngine",
    "Engine",
    "FSDPInBackwardEngine",
    "FSDPStepEngine",
    "FlatEngine",
    "FlatStepEngine",
    "InBackwardEngine",
    "PerParamEngine",
    "make_engine",
]


def make_engine(opt):
    """The engine for ``opt.options``, laid out."""
    sharded = any(is_dtensor(p) for group in opt.param_groups for p in group["params"])
    model = opt.model() if opt.model is not None else None
    if opt.options.in_backward and sharded:
        engine = FSDPInBackwardEngine(opt)
    elif opt.options.in_backward and is_ddp(model):
        engine = DDPInBackwardEngine(opt, model)
    elif opt.options.in_backward:
        engine = InBackwardEngine(opt)
    elif opt.options.flat and sharded:
        engine = FSDPStepEngine(opt)
    elif opt.options.flat:
        engine = FlatStepEngine(opt)
    else:
        return PerParamEngine(opt)
    engine.build()
    return engine
