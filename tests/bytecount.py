"""What writes into a storage: a TorchDispatchMode that records every aten op writing into watched tensors' memory.

An op writes into a tensor when its schema marks the argument as written (``Tensor(a!)``: the ``self`` of an
in-place op, an ``out=`` argument, each tensor of a ``Tensor(a!)[]`` list). Each such write whose tensor shares
its storage with a watched tensor is recorded as ``(op name, bytes)``, the bytes being the written tensor's
``numel() * element_size()``. Storages are told apart by their StorageImpl, so a storage that is released and
brought back (``untyped_storage().resize_()``) is still the same one.

The mode sees the ops dispatched while it is active, autograd's backward on the CPU included (it runs on the
calling thread); ops called inside another op's kernel are not dispatched again and are not seen.
"""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _written(func, args, kwargs):
    """The tensors ``func`` writes into, from its schema."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.name in kwargs:
            value = kwargs[arg.name]
        elif not arg.kwarg_only and i < len(args):
            value = args[i]
        else:
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                yield t


class StorageWrites(TorchDispatchMode):
    """Record the aten ops that write into the storage of any of ``watched`` while the mode is active.

    ``writes``: ``[(op name, bytes)]`` in order; :meth:`ops` counts them by name; :meth:`bytes` sums the bytes.
    """

    def __init__(self, *watched):
        super().__init__()
        self.storages = {t.untyped_storage()._cdata for t in watched}
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in _written(func, args, kwargs):
            if t.untyped_storage()._cdata in self.storages:
                self.writes.append((func.overloadpacket.__name__, t.numel() * t.element_size()))
        return out

    def ops(self):
        return Counter(name for name, _ in self.writes)

    def bytes(self, name=None):
        return sum(n for op, n in self.writes if name is None or op == name)
