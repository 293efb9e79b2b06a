"""Engines: the one that does an optimizer's work, chosen at construction.

* :class:`FlatStepEngine` (the default): flat buffers, ``step()`` launches once per buffer;
* :class:`InBackwardEngine` (``in_backward=True``): flat parameters and states, buckets stepped
  during backward;
* :class:`PerParamEngine` (``flat=False``): the caller's own tensors, one launch per parameter.
"""

from flatopt.engines.base import Engine, FlatEngine
from flatopt.engines.in_backward import InBackwardEngine
from flatopt.engines.per_param import PerParamEngine
from flatopt.engines.step import FlatStepEngine

__all__ = ["Engine", "FlatEngine", "FlatStepEngine", "InBackwardEngine", "PerParamEngine", "make_engine"]


def make_engine(opt):
    """The engine for ``opt.options``, laid out."""
    if opt.options.in_backward:
        engine = InBackwardEngine(opt)
    elif opt.options.flat:
        engine = FlatStepEngine(opt)
    else:
        return PerParamEngine(opt)
    engine.build()
    return engine
