"""Block-wise 8-bit states (``state_dtype="int8"``), in torch: the definitions the Triton kernels follow
(``flatopt.kernels.common.load_state`` and ``store_state``).

Each state is cut into blocks of ``QBLOCK`` = 64 consecutive elements, the layout's alignment granule, so a
block never spans two parameters (and a parameter left out of a step, or stepped in another launch, never
changes another's codes). A block stores one float32 scale, its largest magnitude (``absmax``), and one byte
per element, with a companded mapping (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization", block-wise absmax scaling; the code spacing follows their dynamic quantization's idea of
finer steps near zero, with a power law instead of a lookup table):

* a signed state (AdamW's ``exp_avg``, SGD's ``momentum_buffer``, Lion's ``exp_avg``): int8
  ``q = round(127 * sign(x) * sqrt(|x| / absmax))``, read back as ``absmax * sign(q) * (q / 127)**2``;
* the second moment (AdamW's ``exp_avg_sq``, never negative): uint8 ``q = round(255 * (x / absmax)**(1/4))``,
  read back as ``absmax * (q / 255)**4``, and at least 1 for any ``x > 0``: a positive second moment never reads
  back as zero, which would divide the update by ``eps`` alone (the zero point that Li et al. 2023, "Memory
  Efficient Optimizers with 4-bit States", identify as the failure of second-moment quantization).

``round`` is ``floor(y + 0.5)``. The 4th root spends the codes on the second moment's wide range: a block
whose largest value is 1 resolves values down to 2.3e-10 (code 1) where linear codes stop at 4e-3.

Parameters of fewer than ``INT8_MIN_NUMEL`` = 4096 elements (biases, norms) keep float32 states, as
bitsandbytes does (its ``min_8bit_size``): they cost little and are the most sensitive.

Bytes per element of a state: 1 + 4 / 64 = 1.0625.
"""

import torch

from flatopt.layout import ALIGN

QBLOCK = ALIGN  # elements per scale
INT8_MIN_NUMEL = 4096  # smaller parameters keep float32 states
SIGNED_MAX = 127
UNSIGNED_MAX = 255
ABSMAX = "_absmax"  # the scales of state ``name`` are state ``name + ABSMAX``


def code_dtype(signed):
    return torch.int8 if signed else torch.uint8


def dequantize(codes, absmax, signed):
    """float32 values of flat ``codes`` (int8 or uint8, from the start of a block) with their blocks' ``absmax``."""
    scale = absmax.repeat_interleave(QBLOCK)[: codes.numel()]
    if signed:
        y = codes.float() / SIGNED_MAX
        return scale * (y * y.abs())
    y = codes.float() / UNSIGNED_MAX
    return scale * ((y * y) * (y * y))


def quantize(x, signed):
    """``(codes, absmax)`` of the flat float32 ``x``, whose length is a multiple of QBLOCK."""
    rows = x.reshape(-1, QBLOCK)
    absmax = rows.abs().amax(dim=1)
    ratio = torch.where(absmax[:, None] > 0, rows.abs() / absmax[:, None], torch.zeros_like(rows))
    if signed:
        q = torch.floor(SIGNED_MAX * ratio.sqrt() + 0.5) * rows.sign()
    else:
        q = torch.floor(UNSIGNED_MAX * ratio.sqrt().sqrt() + 0.5)
        q = torch.where(rows > 0, q.clamp(min=1.0), q)
    return q.reshape(-1).to(code_dtype(signed)), absmax


def dequantize_param(codes, absmax, shape, stride):
    """The float32 tensor of ``shape`` and ``stride`` (a parameter's) that a parameter's view of codes (as laid out:
    ``codes`` of the parameter's shape and strides) and of its blocks' scales reads back as."""
    n = codes.numel()
    flat = codes.as_strided((n,), (1,), codes.storage_offset())  # dense: memory order is block order
    values = dequantize(flat, absmax, codes.dtype == torch.int8)
    out = torch.empty_strided(shape, stride, dtype=torch.float32, device=codes.device)
    out.as_strided((n,), (1,)).copy_(values)
    return out


def quantize_into(codes, absmax, t):
    """Quantize ``t`` (a parameter-shaped float tensor) into a parameter's views of codes and scales, in memory
    order, the block's padding as zeros."""
    n = codes.numel()
    padded = torch.zeros(absmax.numel() * QBLOCK, dtype=torch.float32, device=codes.device)
    src = t.to(codes.device, torch.float32)
    view = torch.empty_strided(codes.shape, codes.stride(), dtype=torch.float32, device=codes.device)
    view.copy_(src)
    padded[:n] = view.as_strided((n,), (1,))
    q, a = quantize(padded, codes.dtype == torch.int8)
    codes.as_strided((n,), (1,), codes.storage_offset()).copy_(q[:n])
    absmax.copy_(a)
