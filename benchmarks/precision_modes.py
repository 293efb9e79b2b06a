"""The storage modes the benchmarks measure (flatopt.precision), and what each must move and hold per element.

One home for the modes' definitions: ``bench_step.py`` times each mode's step against its own floor (the bytes
that mode must read and write), ``bench_memory.py`` reports each mode's peak memory and bytes per parameter.

Bytes per element, AdamW (SGD with momentum and Lion have one state instead of two):

    mode                 parameters   kwargs                                              held   moved by a step
    fp32                 fp32         (none)                                              12     28
    bf16                 bf16         (none: bf16 states, torch.optim's rule)              6     14
    bf16-master-fp32     bf16         master_weights="fp32", state_dtype=torch.float32    14     30
    bf16-remainder       bf16         master_weights="remainder", state_dtype=float32     12     26
    bf16-sr              bf16         stochastic_rounding=True, state_dtype=bfloat16       6     14
    bf16-sr-int8         bf16         stochastic_rounding=True, state_dtype="int8"     4.125  10.25

"held" counts the parameter, its master copy or remainder and the states (the gradient is not the
optimizer's); "moved" reads the parameter (the float32 master mode reads it too, to see whether it was written
since the last step), the master or remainder, the gradient and the states, and writes all but the gradient.
An 8-bit state is a byte and a float32 scale per 64 elements, read and written. Parameters of fewer than 4096
elements keep float32 states under "int8": the measured bytes per parameter (:func:`held_bytes`) include them.
"""

import torch

from benchmarks import harness
from flatopt.quantize import QBLOCK

STATES = {"adamw": 2, "sgd": 1, "lion": 1}  # state tensors per parameter element (SGD: with momentum)

MODES = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "bf16-master-fp32": ("bf16", dict(master_weights="fp32", state_dtype=torch.float32)),
    "bf16-remainder": ("bf16", dict(master_weights="remainder", state_dtype=torch.float32)),
    "bf16-sr": ("bf16", dict(stochastic_rounding=True, state_dtype=torch.bfloat16)),
    "bf16-sr-int8": ("bf16", dict(stochastic_rounding=True, state_dtype="int8")),
}
# flatopt's targets, bytes held per parameter (AdamW): fp32 12, remainder 12 (bit-identical to fp32), stochastic
# rounding with bf16 states 6, with int8 states at most 4.2.
HELD_TARGETS = {"fp32": 12.0, "bf16-remainder": 12.0, "bf16-sr": 6.0, "bf16-sr-int8": 4.2}

_SIZE = {"fp32": 4, "bf16": 2}
_MASTER = {None: 0, "fp32": 4, "remainder": 2}


def _state_size(dtype, kwargs):
    state = kwargs.get("state_dtype")
    if state is None:
        return _SIZE[dtype]
    if state == "int8":
        return 1 + 4 / QBLOCK
    return torch.empty((), dtype=state).element_size()


def held_bytes_per_element(optimizer, mode):
    """Bytes the optimizer holds per parameter element in ``mode`` (large parameters: see the module docstring)."""
    dtype, kwargs = MODES[mode]
    return _SIZE[dtype] + _MASTER[kwargs.get("master_weights")] + STATES[optimizer] * _state_size(dtype, kwargs)


def moved_bytes_per_element(optimizer, mode, grad_write=False):
    """Bytes one step must read and write per element in ``mode`` (``grad_write``: and the gradient's landing)."""
    dtype, kwargs = MODES[mode]
    p, master = _SIZE[dtype], _MASTER[kwargs.get("master_weights")]
    states = STATES[optimizer] * _state_size(dtype, kwargs)
    return 2 * (p + master + states) + p * (1 + bool(grad_write))


def held_bytes(opt):
    """Bytes a flatopt optimizer holds in its flat buffers: parameters, masters, states and scales (not gradients)."""
    total = 0
    for buf in harness.internals(opt).buffers:
        tensors = [buf.data, *buf.states.values()] + ([buf.master] if buf.master is not None else [])
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
