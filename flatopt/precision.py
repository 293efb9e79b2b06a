"""Fewer bytes per parameter: master weights, stochastic rounding and the states' storage dtype.

Three keyword arguments of every optimizer, parsed here (:func:`parse`) and resolved per flat buffer
(:meth:`Precision.of_buffer`):

* ``master_weights=None | "fp32" | "remainder"``, for bfloat16 (``"fp32"``: also float16) parameters:
  ``"fp32"`` keeps a float32 master copy (4 bytes more per element); ``"remainder"`` keeps the 16 bits that
  bfloat16 drops from the float32 master, as an int16 (2 bytes more): parameter and remainder together are
  the float32 master, bit for bit (:func:`split_master`, :func:`join_master`), so the parameters step
  exactly as a float32 model stepped by the float32 optimizer would, and the model sees the master rounded
  to nearest (ties away from zero).
* ``stochastic_rounding=True``, for bfloat16 parameters with no master copy: the float32 update is rounded
  to bfloat16 up or down with probabilities that make the rounding unbiased (:func:`round_stochastic`). The
  random bits are a hash of the optimizer's seed, the element's place in its flat buffer and its parameter's
  step count (:func:`random16`): the same seed gives the same result, the kernels and the torch reference
  draw the same bits, and a resumed run continues the stream where it stopped (the step counts are in the
  state dict, the seed too).
* ``state_dtype=None | torch.float32 | torch.bfloat16 | "int8"``: the dtype the moments are stored in (None: the
  parameter's, torch.optim's rule); ``"int8"``: one byte per element and a float32 scale per block of 64
  (:mod:`flatopt.quantize`; parameters of fewer than 4096 elements keep float32 states). The math runs in
  float32 whatever it is.

Every mode is applied inside the one kernel launch per buffer: load, update in float32, round, store.
"""

from dataclasses import dataclass

import torch

from flatopt.quantize import INT8_MIN_NUMEL

MASTER_WEIGHTS = (None, "fp32", "remainder")
STATE_DTYPES = (None, torch.float32, torch.bfloat16, "int8")

# random16's hash (Chris Wellons' "lowbias32"): two multiplications and three xor-shifts of a uint32. One home for
# its constants: the Triton kernels read them from here.
HASH_MUL1 = 0x7FEB352D
HASH_MUL2 = 0x846CA68B
MASK32 = 0xFFFFFFFF
SEED_BOUND = 2**31  # seeds are drawn in [0, SEED_BOUND) from torch's default generator


@dataclass(frozen=True)
class BufferPrecision:
    """How one flat buffer stores its parameters and states.

    Attributes:
        state_dtype: the dtype of its state buffers, or ``"int8"`` (codes and scales: see :mod:`flatopt.quantize`).
        master: None, ``"fp32"`` (a float32 master buffer) or ``"remainder"`` (an int16 buffer of low bits).
        stochastic: its parameters are rounded stochastically from the float32 update.
        unsigned: with ``"int8"``, the states stored with unsigned codes (the rule's nonnegative states).
    """

    state_dtype: object
    master: str | None = None
    stochastic: bool = False
    unsigned: tuple = ()

    @property
    def master_dtype(self):
        """The dtype of the master buffer (None without one)."""
        return {None: None, "fp32": torch.float32, "remainder": torch.int16}[self.master]


@dataclass(frozen=True)
class Precision:
    """The three options, checked (see the module docstring)."""

    master_weights: str | None = None
    stochastic_rounding: bool = False
    state_dtype: object = None

    @property
    def default(self):
        return self.master_weights is None and not self.stochastic_rounding and self.state_dtype is None

    def small(self, p):
        """Whether ``p`` keeps float32 states under ``state_dtype="int8"`` (fewer than INT8_MIN_NUMEL elements): such
        parameters are laid out in buffers of their own."""
        return self.state_dtype == "int8" and p.numel() < INT8_MIN_NUMEL

    def of_buffer(self, dtype, small=False, rule=None):
        """The precision of a flat buffer of parameters of ``dtype`` (modes that do not apply to ``dtype`` are
        off: float32 and float64 parameters are their own master and need no rounding); ``small``: of parameters
        that keep float32 states (see :meth:`small`); ``rule``: the optimizer's (its nonnegative states)."""
        state_dtype = dtype if self.state_dtype is None else self.state_dtype
        if small:
            state_dtype = torch.float32
        master = self.master_weights if dtype in _MASTER_DTYPES.get(self.master_weights, ()) else None
        stochastic = self.stochastic_rounding and dtype == torch.bfloat16
        unsigned = () if rule is None or state_dtype != "int8" else tuple(rule.nonnegative_states)
        return BufferPrecision(state_dtype, master, stochastic, unsigned)

    def check_dtype(self, cls, dtype, name=None):
        """Raise ValueError for a trainable parameter of ``dtype`` (``name``: one that starts to train after
        construction) that the options cannot store: float16 with ``"remainder"`` or stochastic rounding."""
        if dtype != torch.float16 or not (self.master_weights == "remainder" or self.stochastic_rounding):
            return
        some = "some parameters are float16" if name is None else f"parameter {name} is float16"
        if self.master_weights == "remainder":
            raise ValueError(
                f"{cls}(master_weights='remainder') keeps the 16 low bits that bfloat16 drops from a float32 "
                f"master, and {some}, whose bits are not the top half of a float32; use master_weights='fp32' for "
                "float16 parameters"
            )
        raise ValueError(
            f"{cls}(stochastic_rounding=True) rounds bfloat16 parameters, and {some}; use master_weights='fp32' for "
            "float16 parameters"
        )

    def check_params(self, cls, rule, param_groups):
        """Raise ValueError for options that the parameters (of ``param_groups``) or the rule make meaningless: a
        master copy or stochastic rounding that applies to no parameter (trainable, or frozen for now),
        ``"remainder"`` or stochastic rounding with float16 parameters, a ``state_dtype`` for SGD without
        momentum."""
        tensors = [p for g in param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
        dtypes = {p.dtype for p in tensors if p.requires_grad}
        every = {p.dtype for p in tensors}  # frozen ones too: they apply once unfrozen (progressive unfreezing)
        if torch.float16 in dtypes:
            self.check_dtype(cls, torch.float16)
        if self.master_weights is not None:
            fits = _MASTER_DTYPES[self.master_weights]
            if dtypes and not every & fits:
                have = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                want = " or ".join(str(d).removeprefix("torch.") for d in sorted(fits, key=str))
                raise ValueError(
                    f"{cls}(master_weights={self.master_weights!r}) keeps a master copy of {want} parameters, and the "
                    f"parameters are {have}: they are their own master already. Drop master_weights, or convert the "
                    "model (model.to(torch.bfloat16)) before creating the optimizer"
                )
        if self.stochastic_rounding:
            if dtypes and torch.bfloat16 not in every:
                have = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                raise ValueError(
                    f"{cls}(stochastic_rounding=True) rounds bfloat16 parameters, and the parameters are {have}, "
                    "which the update is stored in exactly; drop stochastic_rounding, or convert the model "
                    "(model.to(torch.bfloat16)) before creating the optimizer"
                )
        if self.state_dtype is not None and rule.state_used is not None:
            if not any(rule.uses_state(n, g) for g in param_groups for n in rule.state_names):
                raise ValueError(
                    f"{cls}(state_dtype={_name(self.state_dtype)}) sets the storage of the momentum buffer, and no "
                    f"param group has momentum, so {cls} keeps no state; drop state_dtype, or pass momentum"
                )


_MASTER_DTYPES = {"fp32": frozenset({torch.bfloat16, torch.float16}), "remainder": frozenset({torch.bfloat16})}


def _name(value):
    return repr(value) if isinstance(value, str) or value is None else f"torch.{str(value).removeprefix('torch.')}"


def parse(cls, kwargs, flat):
    """The :class:`Precision` of a constructor's keyword arguments, checked before anything is built."""
    master = kwargs.get("master_weights")
    stochastic = kwargs.get("stochastic_rounding", False)
    state_dtype = kwargs.get("state_dtype")
    if master not in MASTER_WEIGHTS or isinstance(master, bool):
        raise ValueError(f"Invalid master_weights: {master!r}; expected None, 'fp32' or 'remainder'")
    if not isinstance(stochastic, bool):
        raise ValueError(f"Invalid stochastic_rounding: {stochastic!r}; expected True or False")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"Invalid state_dtype: {_name(state_dtype)}; expected None (the parameter's dtype), torch.float32, "
            "torch.bfloat16 or 'int8' (block-wise 8-bit)"
        )
    if stochastic and master is not None:
        raise ValueError(
            f"{cls}(stochastic_rounding=True, master_weights={master!r}): the parameters are rounded from the master "
            "copy, which holds the bits that stochastic rounding would keep on average; choose one of them"
        )
    precision = Precision(master, stochastic, state_dtype)
    if not flat and not precision.default:
        raise ValueError(
            f"{cls}(flat=False) steps the caller's own tensors and keeps no master copy or compact states: "
            "master_weights, stochastic_rounding and state_dtype need flat=True (the default)"
        )
    return precision


def draw_seed():
    """A seed for stochastic rounding from torch's default generator (``torch.manual_seed`` fixes it)."""
    return int(torch.randint(SEED_BOUND, (), dtype=torch.int64, device="cpu"))


def check_master(param, master, rounding_seed):
    """Raise ValueError unless ``master`` (None, a float32 master or int16 remainders) and ``rounding_seed`` (None
    or an int) fit the flat ``param``: one element each, remainders and stochastic rounding for bfloat16 only."""
    if master is not None:
        if master.shape != param.shape or master.device != param.device:
            raise ValueError(
                f"the master buffer has shape {tuple(master.shape)} on {master.device}, the parameters "
                f"{tuple(param.shape)} on {param.device}; it holds one element per parameter element"
            )
        allowed = {torch.bfloat16: (torch.float32, torch.int16), torch.float16: (torch.float32,)}
        if master.dtype not in allowed.get(param.dtype, ()):
            raise ValueError(
                f"a {master.dtype} master buffer does not fit {param.dtype} parameters: float32 masters are for "
                "bfloat16 and float16 parameters, int16 remainders for bfloat16 ones"
            )
    if rounding_seed is not None and (param.dtype != torch.bfloat16 or master is not None):
        raise ValueError("stochastic rounding (rounding_seed) rounds bfloat16 parameters that have no master buffer")
    if rounding_seed is not None and not 0 <= rounding_seed < SEED_BOUND:
        raise ValueError(f"a stochastic rounding seed is an int in [0, 2**31), got {rounding_seed}")


# ------------------------------------------------------------------------------------------ bits, in torch
def _bits(x):
    """The float32 ``x``'s bit patterns as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & MASK32


def _from_bits(bits, dtype):
    """Float tensors of ``dtype`` (bfloat16: 16 bits, float32: 32) from bit patterns held in int64."""
    if dtype == torch.bfloat16:
        half = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
        return half.view(torch.bfloat16)
    word = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return word.view(torch.float32)


def split_master(x):
    """The float32 master ``x`` as (bfloat16 parameter, int16 remainder): the parameter is ``x`` rounded to
    nearest, ties away from zero (its bits plus 0x8000, the top half kept), the remainder the difference of
    the bit patterns, in [-2**15, 2**15): :func:`join_master` gives ``x`` back bit for bit."""
    bits = _bits(x)
    hi = ((bits + 0x8000) & MASK32) >> 16
    rem = (bits - (hi << 16)) & 0xFFFF
    rem = torch.where(rem >= 2**15, rem - 2**16, rem).to(torch.int16)
    return _from_bits(hi, torch.bfloat16), rem


def join_master(p, rem):
    """The float32 master of a bfloat16 parameter ``p`` and its int16 remainder (see :func:`split_master`).

    A pair that no split makes, a parameter written in place since (``nn.init.zeros_``, ``model.load_state_dict()``)
    to ±0 or ±inf beside an old remainder of the wrong sign, would join into a NaN (0x0000 with a negative
    remainder wraps to 0xFFFF....): the master is then the parameter itself. Other written values keep the old low
    16 bits (less than half a bfloat16 ulp), so that values written back (an EMA swap) restore the master exactly."""
    hi = p.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    x = _from_bits(((hi << 16) + rem.to(torch.int64)) & MASK32, torch.float32)
    return torch.where(x.isnan() & ~p.isnan(), p.float(), x)


def round_nearest(x):
    """The float32 ``x`` rounded to bfloat16, to nearest with ties away from zero (as :func:`split_master`)."""
    return split_master(x)[0]


def mix32(x):
    """The hash of :func:`random16` (lowbias32: x ^= x >> 16; x *= HASH_MUL1; x ^= x >> 15; x *= HASH_MUL2;
    x ^= x >> 16), on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_MUL2)
    return x ^ (x >> 16)


def _mul32(x, c):
    """(x * c) mod 2**32 for x in [0, 2**32), without leaving int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def random16(seed, index, steps):
    """16 uniform random bits (int64 in [0, 2**16)) for each element: a hash of the seed (in [0, 2**31)), the
    element's index in its flat buffer (int64) and its parameter's completed steps (a float count, per element or
    one for all).
    The Triton kernels compute the same values (``flatopt.kernels.common.random16``)."""
    steps = torch.as_tensor(steps).to(torch.int64) & MASK32
    key = mix32(mix32(steps ^ seed))
    lo, hi = index & MASK32, (index >> 32) & MASK32
    return mix32(lo ^ mix32(key ^ hi)) >> 16


def round_stochastic(x, seed, index, steps):
    """The float32 ``x`` rounded to bfloat16 stochastically: its bits plus 16 random bits, the top half kept, so
    that it rounds up with probability (distance to the lower neighbour) / (gap between the neighbours)."""
    bits = (_bits(x) + random16(seed, index, steps)) & MASK32
    return _from_bits(bits >> 16, torch.bfloat16)


def nearest(x, dtype):
    """The float32 ``x`` rounded to the 16-bit ``dtype`` as the master modes round it: bfloat16 as
    :func:`round_nearest` does, float16 to nearest even."""
    return round_nearest(x) if dtype == torch.bfloat16 else x.to(dtype)


def load_param(p, master):
    """The float32 value a step starts from: the master copy (float32 ``master``) unless the parameter was written
    since the last step (it is no longer the master rounded: then the parameter), the parameter joined with its
    remainder (int16 ``master``), or the parameter upcast (``master`` None)."""
    if master is None:
        return p.float()
    if master.dtype == torch.int16:
        return join_master(p, master)
    return torch.where(nearest(master, p.dtype) == p, master, p.float())


def store_param(p, master, x, seed=None, index=None, steps=None):
    """(buffer, new value) pairs that store the float32 update ``x`` of the parameters ``p``: into the master copy
    and the parameter rounded to nearest, into parameter and remainder, stochastically rounded (``seed`` not
    None: see :func:`round_stochastic`, ``index`` each element's place in its flat buffer), or rounded to nearest
    even (``x.to(p.dtype)``, done by the caller's copy)."""
    if master is None:
        if seed is not None:
            return [(p, round_stochastic(x, seed, index, steps))]
        return [(p, x)]
    if master.dtype == torch.int16:
        hi, rem = split_master(x)
        return [(p, hi), (master, rem)]
    return [(p, nearest(x, p.dtype)), (master, x)]
