"""How parameters and states are stored, inside the kernels: the master copy or remainder, stochastic rounding
and 8-bit states (see :mod:`flatopt.precision` and :mod:`flatopt.quantize`, which define them in torch; the
kernels compute the same bits). Every kernel loads its parameter with load_param and its states with
load_state, and stores them with store_param and store_state; ``MASTER``, ``STOCHASTIC`` and ``QUANT`` (the
launch's compile-time arguments, see common.py) choose the mode, and each costs nothing when off.
"""

import torch
import triton
import triton.language as tl

from flatopt import precision

HASH_MUL1 = tl.constexpr(precision.HASH_MUL1)
HASH_MUL2 = tl.constexpr(precision.HASH_MUL2)


@triton.jit
def mix32(x):
    """flatopt.precision.mix32 on uint32 values (products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * HASH_MUL1
    x = x ^ (x >> 15)
    x = x * HASH_MUL2
    return x ^ (x >> 16)


@triton.jit
def random16(seed, index, steps):
    """flatopt.precision.random16: 16 random bits (uint32 below 2**16) per element from the seed, the element's int64
    index in its flat buffer and its parameter's completed steps (float32, scalar or per element)."""
    key = mix32(mix32(steps.to(tl.uint32) ^ seed.to(tl.uint32)))
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return mix32(lo ^ mix32(key ^ hi)) >> 16


@triton.jit
def round_bf16_bits(bits):
    """The bfloat16 bits (uint32 below 2**16) of float32 bits rounded to nearest, ties away from zero
    (flatopt.precision.split_master)."""
    return (bits + 0x8000) >> 16


@triton.jit
def bf16_from_bits(bits):
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_master(x, P: tl.constexpr):
    """The float32 master ``x`` rounded to the parameters' dtype ``P`` (flatopt.precision.nearest)."""
    if P == tl.bfloat16:
        return bf16_from_bits(round_bf16_bits(x.to(tl.uint32, bitcast=True)))
    else:
        return x.to(P)


@triton.jit
def load_param(p_ptr, w_ptr, offsets, active, MASTER: tl.constexpr, COMPUTE: tl.constexpr):
    """The value a step starts from, in COMPUTE (flatopt.precision.load_param): MASTER 1, the float32 master
    unless the parameter is no longer the master rounded (written since: then the parameter); MASTER 2, the
    bfloat16 parameter and its int16 remainder joined (the parameter where they join into a NaN it is not:
    written in place since); MASTER 0, the parameter."""
    p = tl.load(p_ptr + offsets, mask=active)
    if MASTER == 1:
        w = tl.load(w_ptr + offsets, mask=active)
        if p_ptr.dtype.element_ty == tl.bfloat16:
            same = round_bf16_bits(w.to(tl.uint32, bitcast=True)) == p.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            same = w.to(p_ptr.dtype.element_ty) == p
        x = tl.where(same, w, p.to(tl.float32))
    elif MASTER == 2:
        r = tl.load(w_ptr + offsets, mask=active)
        bits = (p.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) + r.to(tl.int32).to(tl.uint32, bitcast=True)
        x = bits.to(tl.float32, bitcast=True)
        x = tl.where((x != x) & (p == p), p.to(tl.float32), x)  # a written ±0 or ±inf: see precision.join_master
    else:
        x = p.to(COMPUTE)
    return x


@triton.jit
def store_param(
    p_ptr, w_ptr, offsets, x, active, steps, seed, rng_base, MASTER: tl.constexpr, STOCHASTIC: tl.constexpr
):  # fmt: skip
    """Store the update ``x`` (flatopt.precision.store_param): MASTER 1, into the master and the parameter
    rounded to nearest; MASTER 2, split into the bfloat16 parameter and its remainder; STOCHASTIC, rounded
    to bfloat16 stochastically (the random bits of each element's index ``rng_base + offsets`` and its
    parameter's ``steps``); otherwise rounded to nearest even."""
    P = p_ptr.dtype.element_ty
    if MASTER == 1:
        tl.store(w_ptr + offsets, x, mask=active)
        tl.store(p_ptr + offsets, round_master(x, P), mask=active)
    elif MASTER == 2:
        bits = x.to(tl.uint32, bitcast=True)
        hi = round_bf16_bits(bits)
        tl.store(p_ptr + offsets, bf16_from_bits(hi), mask=active)
        tl.store(w_ptr + offsets, (bits - (hi << 16)).to(tl.uint16).to(tl.int16, bitcast=True), mask=active)
    elif STOCHASTIC:
        bits = x.to(tl.uint32, bitcast=True) + random16(seed, rng_base + offsets, steps)
        tl.store(p_ptr + offsets, bf16_from_bits(bits >> 16), mask=active)
    else:
        tl.store(p_ptr + offsets, x.to(P), mask=active)


@triton.jit
def load_state(s_ptr, a_ptr, offsets, active, GRANULE: tl.constexpr, QUANT: tl.constexpr, COMPUTE: tl.constexpr):
    """A state in COMPUTE: loaded and upcast, or, with QUANT, its 8-bit codes read back with their granule's scale
    (``a_ptr``; flatopt.quantize.dequantize): int8 codes as ``scale * y * |y|`` with ``y = q / 127``, uint8 ones as
    ``scale * y**4`` with ``y = q / 255``."""
    x = tl.load(s_ptr + offsets, mask=active)
    if QUANT:
        scale = tl.load(a_ptr + offsets // GRANULE, mask=active, other=0.0)
        if s_ptr.dtype.element_ty == tl.int8:
            y = x.to(tl.float32) / 127.0
            value = scale * (y * tl.abs(y))
        else:
            y = x.to(tl.float32) / 255.0
            value = scale * ((y * y) * (y * y))
    else:
        value = x
    return value.to(COMPUTE)


@triton.jit
def store_state(s_ptr, a_ptr, offsets, x, active, GRANULE: tl.constexpr, QUANT: tl.constexpr):
    """Store a state: rounded to its dtype, or, with QUANT (offsets one granule per row), as 8-bit codes and one
    scale per granule, its largest magnitude (flatopt.quantize.quantize): int8 ``round(127 * sign(x) *
    sqrt(|x| / absmax))``, uint8 ``round(255 * (x / absmax)**(1/4))`` and at least 1 where ``x > 0``."""
    if QUANT:
        mag = tl.where(active, tl.abs(x), 0.0)
        absmax = tl.max(mag, axis=1)
        ratio = tl.where(absmax[:, None] > 0.0, mag / absmax[:, None], 0.0)
        if s_ptr.dtype.element_ty == tl.int8:
            q = tl.floor(127.0 * tl.sqrt(ratio) + 0.5)
            q = tl.where(x < 0.0, -q, q)
        else:
            q = tl.floor(255.0 * tl.sqrt(tl.sqrt(ratio)) + 0.5)
            q = tl.where(x > 0.0, tl.maximum(q, 1.0), q)
        tl.store(s_ptr + offsets, q.to(s_ptr.dtype.element_ty), mask=active)
        row_active = tl.max(active.to(tl.int32), axis=1) > 0
        tl.store(a_ptr + tl.min(offsets, axis=1) // GRANULE, absmax, mask=row_active)
    else:
        tl.store(s_ptr + offsets, x.to(s_ptr.dtype.element_ty), mask=active)


def check_scales(states, scales, n_elements, GRANULE):
    """Raise ValueError unless ``scales`` (None, or one per state) fit the states: float32 ``[n_elements // GRANULE]``
    beside int8 or uint8 codes; float states without scales (GRANULE: the elements per scale)."""
    codes = [t is not None and t.dtype in (torch.int8, torch.uint8) for t in states]
    if scales is None:
        if any(codes):
            raise ValueError("8-bit states (int8 or uint8 codes) need their scales: pass scales=[...], one per state")
        return
    if len(scales) != len(states) or n_elements % GRANULE:
        raise ValueError(
            f"scales: one per state ({len(states)}), over a length that is a multiple of {GRANULE}; got {len(scales)} "
            f"over {n_elements} elements"
        )
    for t, a, code in zip(states, scales, codes):
        if t is None:
            continue
        if not code or a is None or a.dtype != torch.float32 or a.shape != (n_elements // GRANULE,):
            what = "None" if a is None else f"{a.dtype} of shape {tuple(a.shape)}"
            raise ValueError(
                f"a state of {t.dtype} with scales {what}: 8-bit states are int8 or uint8 codes with float32 scales "
                f"of shape ({n_elements // GRANULE},), one per {GRANULE} elements"
            )
