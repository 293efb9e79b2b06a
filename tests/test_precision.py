"""Fewer bytes per parameter (flatopt.precision): master weights, stochastic rounding, the states' dtype.

Each mode is checked against what it is defined to be, on every backend (the pure-torch reference, the CPU
backend, which routes these modes to the reference, and the Triton kernels under the interpreter):

* ``master_weights="remainder"``: bfloat16 parameter and remainder are, bit for bit, the float32 parameter of
  a float32 model stepped by the float32 optimizer with the same gradients (AdamW, SGD, Lion);
* ``master_weights="fp32"``: the master copy is that float32 parameter, the parameter the master rounded;
* ``stochastic_rounding=True``: each parameter is one of the two bfloat16 neighbours of the float32 update,
  unbiased on average, the same for the same seed;
* ``state_dtype``: the states are stored in that dtype, the math in float32;

and the Triton kernels against the reference for every mode, over several steps with two param groups and a
parameter left out of one step. Parameters' sizes are not multiples of any block.
"""

import pytest
import torch
from conftest import TOL, TRITON_SKIP
from torch import nn

import flatopt
from flatopt.precision import join_master, nearest, random16, round_stochastic, split_master
from flatopt.quantize import INT8_MIN_NUMEL, QBLOCK, dequantize, quantize

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*received no gradient.*:UserWarning"),
    # 8-bit states: the interpreter evaluates both sides of tl.where(absmax > 0, |x| / absmax, 0), 0 / 0 included
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
]

OPTIMIZERS = {
    "adamw": (flatopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (flatopt.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "lion": (flatopt.Lion, dict(lr=1e-2, weight_decay=0.1)),
}
BACKENDS = ["torch", "cpu", pytest.param("triton", marks=TRITON_SKIP)]
MODES = [
    dict(master_weights="fp32"),
    dict(master_weights="remainder"),
    dict(master_weights="remainder", state_dtype=torch.float32),
    dict(stochastic_rounding=True),
    dict(stochastic_rounding=True, state_dtype=torch.bfloat16),
    dict(state_dtype=torch.float32),
    dict(state_dtype="int8"),
    dict(stochastic_rounding=True, state_dtype="int8"),
]
STEPS = 4


def model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    # 70 x 70 = 4900 elements: 8-bit states (state_dtype="int8") from 4096 on, float32 ones for the others
    net = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 70), nn.Linear(70, 70))
    return net.to(dtype)


def groups(net):
    params = list(net.parameters())
    return [{"params": params[::2]}, {"params": params[1::2], "lr": 3e-3}]


def grads(net, step, dtype=torch.bfloat16):
    """Gradients of ``dtype`` for ``step`` (the same on every run); the last parameter gets none at step 1."""
    gen = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=gen).to(dtype) for p in net.parameters()]
    if step == 1:
        out[-1] = None
    return out


def train(net, opt, dtype=torch.bfloat16, steps=STEPS):
    for step in range(steps):
        for p, g in zip(net.parameters(), grads(net, step, dtype)):
            p.grad = None if g is None else g.to(p.dtype)
        opt.step()


def float32_twin(net):
    """A float32 copy of ``net`` with the same values."""
    twin = model(torch.float32)
    with torch.no_grad():
        for t, p in zip(twin.parameters(), net.parameters()):
            t.copy_(p.float())
    return twin


def buffers(opt):
    """The flat buffer of ``opt`` (with 8-bit states, the one that has them)."""
    bufs = flatopt.inspect(opt).buffers
    return next((b for b in bufs if b.quantized), None) or bufs[0] if len(bufs) > 1 else bufs[0]


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "dtype, kwargs, match",
    [
        (torch.bfloat16, dict(master_weights="bf16"), r"Invalid master_weights: 'bf16'"),
        (torch.bfloat16, dict(master_weights=True), r"Invalid master_weights: True"),
        (torch.bfloat16, dict(stochastic_rounding=1), r"Invalid stochastic_rounding: 1"),
        (torch.bfloat16, dict(state_dtype=torch.float16), r"Invalid state_dtype: torch.float16"),
        (torch.bfloat16, dict(state_dtype="int4"), r"Invalid state_dtype: 'int4'"),
        (torch.bfloat16, dict(state_dtype=torch.int8), r"Invalid state_dtype: torch.int8.* or 'int8'"),
        (torch.bfloat16, dict(stochastic_rounding=True, master_weights="fp32"), r"choose one of them"),
        (torch.float32, dict(master_weights="remainder"), r"parameters are float32: they are their own master"),
        (torch.float32, dict(master_weights="fp32"), r"parameters are float32: they are their own master"),
        (torch.float16, dict(master_weights="remainder"), r"use master_weights='fp32' for float16"),
        (torch.float16, dict(stochastic_rounding=True), r"some parameters are float16"),
        (torch.float32, dict(stochastic_rounding=True), r"parameters are float32, which the update is stored"),
        (torch.bfloat16, dict(flat=False, state_dtype=torch.float32), r"need flat=True"),
    ],
)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_invalid_combinations_are_refused_at_construction(name, dtype, kwargs, match):
    cls, hp = OPTIMIZERS[name]
    net = model(dtype)
    before = [p.data_ptr() for p in net.parameters()]
    with pytest.raises(ValueError, match=match):
        cls(net, **hp, **kwargs)
    assert [p.data_ptr() for p in net.parameters()] == before  # nothing laid out


def test_sgd_without_momentum_refuses_a_state_dtype():
    with pytest.raises(ValueError, match=r"no param group has momentum, so SGD keeps no state"):
        flatopt.SGD(model(), lr=0.1, state_dtype=torch.float32)
    flatopt.SGD(model(), lr=0.1, momentum=0.9, state_dtype=torch.bfloat16)  # with momentum it is taken


def test_a_param_group_the_options_cannot_serve_is_refused_before_it_is_added():
    opt = flatopt.AdamW(model(), master_weights="remainder")
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"use master_weights='fp32' for float16 parameters"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1 and len(flatopt.inspect(opt).buffers) == 1


def test_a_param_group_with_the_defaults_is_added_to_an_sgd_with_a_state_dtype():
    opt = flatopt.SGD(model(), lr=0.1, momentum=0.9, state_dtype=torch.float32)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt.add_param_group({"params": [extra]})  # momentum from the defaults
    extra.grad = torch.ones_like(extra)
    opt.step()
    assert opt.state[extra]["momentum_buffer"].dtype == torch.float32


def test_a_mixed_model_applies_a_master_copy_to_its_bfloat16_parameters_only():
    net = model()
    net[0].float()
    opt = flatopt.AdamW(net, master_weights="remainder")
    kinds = {buf.dtype: buf.master for buf in flatopt.inspect(opt).buffers}
    assert kinds[torch.float32] is None and kinds[torch.bfloat16].dtype == torch.int16


# ---------------------------------------------------------------------------------------------- the bits


def test_remainder_split_and_join_are_exact_and_round_to_nearest():
    x = torch.randn(100_000) * torch.logspace(-30, 30, 100_000)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), -1.0 - 2**-8])  # a tie (half an ulp of 1): away from zero
    p, rem = split_master(x)
    assert torch.equal(join_master(p, rem).view(torch.int32), x.view(torch.int32))
    finite = x.isfinite()
    err = (p.float() - x)[finite].abs()
    assert (err <= (p.float().abs() * 2**-8)[finite]).all()  # within half a bfloat16 ulp
    assert p[3].item() == -1.0 - 2**-7


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    n = 400_000
    # (value, its neighbour towards zero, the one away from zero): an eighth of an ulp away from the first
    for value, near, far in ((1.0 + 2**-10, 1.0, 1.0 + 2**-7), (-3.0 - 2**-9, -3.0, -3.0 - 2**-6)):
        r = round_stochastic(torch.full((n,), value), 7, torch.arange(n), torch.tensor(5.0)).float()
        assert set(r.unique().tolist()) == {near, far}
        sigma = abs(far - near) * (1 / 8 * 7 / 8 / n) ** 0.5
        assert abs(r.mean().item() - value) < 5 * sigma, (r.mean().item(), value)


def test_random_bits_are_uniform_and_depend_on_seed_index_and_step():
    index = torch.arange(1 << 16)
    a = random16(1, index, torch.tensor(0.0))
    assert 0 <= a.min() and a.max() < 2**16
    assert abs(a.float().mean().item() / 2**16 - 0.5) < 0.01
    for other in (random16(2, index, torch.tensor(0.0)), random16(1, index + 1, torch.tensor(0.0)),
                  random16(1, index, torch.tensor(1.0))):  # fmt: skip
        assert (a != other).float().mean() > 0.99


# ---------------------------------------------------------------------------------------------- the modes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("state_dtype", [None, torch.float32])
def test_remainder_is_bit_for_bit_the_float32_optimizer(name, backend, state_dtype):
    """bfloat16 parameter + remainder == the float32 parameter of the float32 optimizer fed the same (bfloat16)
    gradients, and the states are that optimizer's: float32 states, or (state_dtype None: the bfloat16
    parameters') bfloat16 states, as the float32 optimizer with state_dtype=torch.bfloat16 keeps them."""
    cls, hp = OPTIMIZERS[name]
    net = model()
    twin = float32_twin(net)
    ours = cls(groups(net), **hp, master_weights="remainder", state_dtype=state_dtype, backend=backend)
    reference_backend = "torch" if backend == "cpu" else backend  # the CPU backend routes this mode to the reference
    theirs = cls(groups(twin), **hp, state_dtype=state_dtype or torch.bfloat16, backend=reference_backend)
    assert buffers(ours).master.dtype == torch.int16
    for step in range(STEPS):
        for ps, g in ((net.parameters(), grads(net, step)), (twin.parameters(), grads(net, step))):
            for p, gi in zip(ps, g):
                p.grad = None if gi is None else gi.to(p.dtype)
        ours.step()
        theirs.step()
        a, b = buffers(ours), buffers(theirs)
        master = join_master(a.data, a.master)
        assert torch.equal(master.view(torch.int32), b.data.view(torch.int32)), f"step {step}"
        assert torch.equal(a.data, nearest(b.data, torch.bfloat16)), f"step {step}: the parameter is the master rounded"
        for key in b.states:
            assert torch.equal(a.states[key], b.states[key]), f"step {step}, {key}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_master_is_the_float32_optimizer_and_the_parameter_its_rounding(name, backend):
    cls, hp = OPTIMIZERS[name]
    net = model()
    twin = float32_twin(net)
    ours = cls(groups(net), **hp, master_weights="fp32", state_dtype=torch.float32, backend=backend)
    theirs = cls(groups(twin), **hp, backend="torch" if backend == "cpu" else backend)
    train(net, ours)
    train(twin, theirs)
    a, b = buffers(ours), buffers(theirs)
    assert a.master.dtype == torch.float32
    assert torch.equal(a.master, b.data)
    assert torch.equal(a.data, nearest(a.master, torch.bfloat16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_written_in_place_takes_over_from_its_float32_master(backend):
    """model.load_state_dict() (or any in-place write) between steps: the step starts from the written value."""
    net = model()
    opt = flatopt.SGD(net, lr=0.1, master_weights="fp32", backend=backend)
    train(net, opt, steps=1)
    with torch.no_grad():
        net[0].weight.fill_(0.5)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert (net[0].weight == 0.5).all()
    assert (buffers(opt).master_views[0] == 0.5).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_parameter_written_to_zero_restarts_from_zero_with_remainders(name, backend):
    """A remainder is the low half of the master's bits: an element written in place to ±0 (nn.init.zeros_, a
    loaded checkpoint) beside an old negative remainder would join into a NaN, whose update splits back into the
    same pair, so the element would never move again. It starts from the written value instead."""
    cls, hp = OPTIMIZERS[name]
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64).bfloat16())
    opt = cls([w], **hp, master_weights="remainder", backend=backend)
    for _ in range(3):
        w.grad = torch.randn(64).bfloat16()
        opt.step()
    rem = buffers(opt).master_views[0]
    assert (rem < 0).any()  # the case: old remainders of the wrong sign for a zero
    with torch.no_grad():
        w[:32].zero_()
        w[32:48].fill_(-0.0)
    before = w.detach().clone()
    opt.param_groups[0]["lr"] = 0.0  # a step that moves nothing: it starts from the written values, and keeps them
    w.grad = torch.ones(64).bfloat16()
    opt.step()
    assert torch.equal(w.detach(), before)  # (a zero may change sign, as 0.0 + -0.0 does)
    hi = w.detach().view(torch.int16).to(torch.int64) & 0xFFFF
    joined = (((hi << 16) + rem.to(torch.int64)) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)  # bits, as is
    assert not joined.isnan().any()  # pairs a split makes (a NaN master kept the old remainders of the wrong sign)
    opt.param_groups[0]["lr"] = hp["lr"]
    for _ in range(3):
        opt.step()
    assert (w[:48] != 0).all()  # every zeroed element moves


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_written_back_restore_the_remainder_master_exactly(backend):
    """An EMA swap (other values written in, then the parameter's own written back) keeps the master bit for bit:
    a written element keeps its low 16 bits."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64).bfloat16())
    opt = flatopt.SGD([w], lr=0.1, master_weights="remainder", backend=backend)
    for _ in range(3):
        w.grad = torch.randn(64).bfloat16()
        opt.step()
    master = join_master(w.detach(), buffers(opt).master_views[0])
    own = w.detach().clone()
    with torch.no_grad():
        w.copy_(torch.randn(64).bfloat16())
        w.copy_(own)
    assert torch.equal(join_master(w.detach(), buffers(opt).master_views[0]), master)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_stochastic_rounding_rounds_the_float32_update_to_a_neighbour_reproducibly(name, backend):
    cls, hp = OPTIMIZERS[name]
    runs = []
    for seed in (3, 3, 4):
        net = model()
        torch.manual_seed(seed)
        opt = cls(groups(net), **hp, stochastic_rounding=True, backend=backend)
        # one step, against the float32 update of the same bfloat16 values
        twin = float32_twin(net)
        ref = cls(groups(twin), **hp, backend="torch" if backend == "cpu" else backend)
        train(net, opt, steps=1)
        train(twin, ref, steps=1)
        a, x = buffers(opt).data.float(), buffers(ref).data
        down, up = x.bfloat16().float(), x.bfloat16().float()
        below = torch.where(down > x, torch.nextafter(x.bfloat16(), torch.full_like(x, -1e30).bfloat16()).float(), down)
        above = torch.where(up < x, torch.nextafter(x.bfloat16(), torch.full_like(x, 1e30).bfloat16()).float(), up)
        assert ((a == below) | (a == above)).all()
        runs.append(a)
    assert torch.equal(runs[0], runs[1])  # the same seed: the same result
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_keeps_updates_far_below_an_ulp_on_average(backend):
    """SGD with updates of 1/8 of a bfloat16 ulp: rounding to nearest never moves the parameters, stochastic
    rounding moves them by the update on average."""
    n = 1 << 14
    start = 1.0
    for sr in (False, True):
        p = nn.Parameter(torch.full((n,), start, dtype=torch.bfloat16))
        opt = flatopt.SGD([p], lr=2**-11, stochastic_rounding=sr, backend=backend)
        for _ in range(8):
            p.grad = torch.ones_like(p)  # each step subtracts 2**-11: an ulp below 1.0 is 2**-8
            opt.step()
        moved = start - p.float().mean().item()
        if not sr:
            if backend != "triton":  # the interpreter stores bfloat16 by truncating (see above)
                assert moved == 0.0
        else:
            assert abs(moved - 8 * 2**-11) < 5 * 2**-8 / n**0.5 * 8**0.5, moved


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dtype_stores_the_states_in_that_dtype(name, backend):
    cls, hp = OPTIMIZERS[name]
    net = model()
    opt = cls(groups(net), **hp, state_dtype=torch.float32, backend=backend)
    train(net, opt)
    buf = buffers(opt)
    assert {t.dtype for t in buf.states.values()} == {torch.float32} and buf.data.dtype == torch.bfloat16
    for p in net.parameters():
        for key, t in opt.state[p].items():
            if key != "step":
                assert t.dtype == torch.float32 and t.shape == p.shape


@TRITON_SKIP
@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_kernels_match_the_reference_in_every_mode(name, mode):
    """The same steps through the Triton kernels and the reference, each step from the same buffers (the
    reference's): float32 values (masters, float32 states) a few float32 roundings apart (the kernels' bias
    corrections are computed another way), bfloat16 values an ulp apart at most (the interpreter stores bfloat16
    by truncating where torch rounds to nearest; the modes' own roundings are exact integer arithmetic)."""
    cls, hp = OPTIMIZERS[name]
    nets, opts = [], []
    for backend in ("torch", "triton"):
        nets.append(model())
        torch.manual_seed(11)
        opts.append(cls(groups(nets[-1]), **hp, **mode, backend=backend))
    for step in range(STEPS):
        for net, opt in zip(nets, opts):
            for p, g in zip(net.parameters(), grads(net, step)):
                p.grad = g
            opt.step()
        pairs = []
        for ref, ker in zip(*(flatopt.inspect(o).buffers for o in opts)):
            assert ref.quantized == ker.quantized
            pairs += [("data", ker.data, ref.data), *((k, ker.states[k], t) for k, t in ref.states.items())]
            if ref.master is not None:
                pairs.append(("master", ker.master, ref.master))
                if ref.master.dtype == torch.int16:  # remainders, the bits below the parameter's: the masters
                    masters = ("master", join_master(ker.data, ker.master), join_master(ref.data, ref.master))
        assert any(k.endswith("_absmax") for k, _, _ in pairs) == (mode.get("state_dtype") == "int8")
        for what, a, b in pairs:
            assert a.dtype == b.dtype, what
            if a.dtype == torch.int16:
                what, a, b = masters
            if a.dtype in (torch.int8, torch.uint8):  # 8-bit codes: the reference's definitions, exactly
                assert torch.equal(a, b), f"step {step}, {what}"
                continue
            tol = TOL[torch.float32] if a.dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"step {step}, {what}: {m}")
        for ref, ker in zip(*(flatopt.inspect(o).buffers for o in opts)):
            assert torch.equal(ker.meta.steps, ref.meta.steps)
        with torch.no_grad():  # the next step from the same buffers
            for _, a, b in pairs:
                a.copy_(b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_backward_mode_steps_as_step_mode(backend):
    def run(in_backward):
        net = model()
        torch.manual_seed(5)
        opt = flatopt.AdamW(
            net,
            lr=1e-2,
            master_weights="remainder",
            state_dtype=torch.float32,
            in_backward=in_backward,
            backend=backend,
            **({"bucket_size": 64} if in_backward else {}),
        )
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            x = torch.randn(4, 7, generator=gen).bfloat16()
            net(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        masters = [buf.master.clone() for buf in flatopt.inspect(opt).buffers]
        return [p.detach().clone() for p in net.parameters()], masters

    (p1, m1), (p2, m2) = run(False), run(True)
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
    assert torch.equal(torch.sort(torch.cat(m1)).values, torch.sort(torch.cat(m2)).values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scaler_tensors_with_a_float16_model_and_a_float32_master(backend):
    """GradScaler's grad_scale divides the gradients and found_inf skips the step, with the master copy."""

    def run(scale, found):
        net = model(torch.float16)
        opt = flatopt.AdamW(net, lr=1e-2, master_weights="fp32", backend=backend)
        for p, g in zip(net.parameters(), grads(net, 0, torch.float16)):
            p.grad = g * scale
        opt.grad_scale = torch.tensor([float(scale)])
        opt.found_inf = torch.tensor([float(found)])
        opt.step()
        return buffers(opt)

    plain, scaled, skipped = run(1, 0), run(1024, 0), run(1024, 1)
    assert torch.equal(scaled.master, plain.master) and torch.equal(scaled.data, plain.data)
    start = buffers(flatopt.AdamW(model(torch.float16), master_weights="fp32", backend=backend))
    assert torch.equal(skipped.master, start.master) and torch.equal(skipped.data, start.data)
    assert not torch.equal(plain.master, start.master)


# ---------------------------------------------------------------------------------------------- 8-bit states


def test_8bit_codes_read_back_within_their_step_and_never_turn_a_positive_second_moment_into_zero():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 50, generator=gen) * torch.logspace(-8, 2, 64 * 50)
    for signed, values in ((True, x), (False, x.square())):
        q, absmax = quantize(values, signed)
        assert q.dtype == (torch.int8 if signed else torch.uint8) and absmax.shape == (50,)
        back = dequantize(q, absmax, signed)
        scale = absmax.repeat_interleave(QBLOCK)
        # codes y = (v / absmax) ** (1/2 or 1/4) are spaced 1/127 or 1/255: half a step in y, mapped back
        power, levels = (2, 127) if signed else (4, 255)
        y = (values.abs() / scale) ** (1 / power)
        bound = scale * ((y + 0.5 / levels) ** power - y**power) * 1.0001 + 1e-30
        assert ((back - values).abs() <= bound).all()
        if not signed:
            assert (back[values > 0] > 0).all()
    assert torch.equal(dequantize(*quantize(torch.zeros(64), False), False), torch.zeros(64))


def test_int8_states_cost_a_byte_and_a_scale_per_64_elements_and_small_parameters_keep_float32():
    net = model()
    opt = flatopt.AdamW(net, state_dtype="int8", stochastic_rounding=True)
    bufs = flatopt.inspect(opt).buffers
    big = [b for b in bufs if b.quantized]
    assert len(big) == 1 and [p.numel() for p in big[0].params] == [4900]
    assert all(p.numel() < INT8_MIN_NUMEL for b in bufs if not b.quantized for p in b.params)
    assert all(t.dtype == torch.float32 for b in bufs if not b.quantized for t in b.states.values())
    buf = big[0]
    stored = sum(t.numel() * t.element_size() for t in buf.states.values()) + buf.data.numel() * 2
    assert stored / buf.numel == 2 + 2 * (1 + 4 / 64)  # 4.125 bytes per element: bf16 parameter, two states


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_state_dict_exports_float32_values_that_torch_optim_loads(backend):
    net = model()
    opt = flatopt.AdamW(net, lr=1e-2, state_dtype="int8", backend=backend)
    train(net, opt)
    sd = opt.state_dict()
    w = net[3].weight
    k = next(i for i, p in enumerate(net.parameters()) if p is w)  # one param group: the module's order
    entry = sd["state"][k]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and entry["exp_avg"].dtype == torch.float32
    own = opt.state[w]
    assert own["exp_avg"].dtype == torch.int8 and own["exp_avg_sq"].dtype == torch.uint8
    torch.testing.assert_close(entry["exp_avg_sq"], opt.state_dict()["state"][k]["exp_avg_sq"])
    twin = model()
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    theirs.load_state_dict(sd)
    assert torch.equal(theirs.state[twin[3].weight]["exp_avg"], entry["exp_avg"].bfloat16())


def test_int8_states_refuse_a_tensor_assigned_into_opt_state_and_take_a_reset():
    net = model()
    opt = flatopt.AdamW(net, lr=1e-2, state_dtype="int8")
    train(net, opt, steps=1)
    w = net[3].weight
    opt.state[w]["exp_avg"] = torch.zeros_like(w)
    with pytest.raises(ValueError, match=r"state_dtype='int8' the entries are views of the 8-bit codes"):
        opt.step()
    opt.state[w] = {}
    opt.step()
    assert float(opt.state[w]["step"]) == 1.0


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    "mode", [MODES[2], MODES[4], MODES[7]], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items())
)
def test_captured_steps_match_eager_steps(mode):
    """capture(): warm-up puts masters, codes and scales back as it puts the states back, and each replay steps
    as an eager step does (10 replays, the same batches)."""
    results = []
    for captured in (False, True):
        net = model().cuda()
        torch.manual_seed(3)
        opt = flatopt.AdamW(net, lr=1e-2, **mode)
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randn(4, 7, generator=gen).bfloat16().cuda() for _ in range(10)]

        def train_step(x):
            loss = net(x).float().square().mean()
            loss.backward()
            return loss

        if captured:
            step = opt.capture(train_step, batches[0])
            for x in batches:
                step(x)
        else:
            for x in batches:
                opt.zero_grad()
                train_step(x)
                opt.step()
        torch.cuda.synchronize()
        buffers_now = flatopt.inspect(opt).buffers
        tensors = {(i, "data"): b.data for i, b in enumerate(buffers_now)}
        tensors.update({(i, k): t for i, b in enumerate(buffers_now) for k, t in b.states.items()})
        tensors.update({(i, "master"): b.master for i, b in enumerate(buffers_now) if b.master is not None})
        results.append({k: t.clone() for k, t in tensors.items()})
    eager, replayed = results
    for key in eager:
        torch.testing.assert_close(replayed[key].float(), eager[key].float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("mode", [dict(master_weights="remainder"), dict(stochastic_rounding=True)], ids=str)
def test_a_float16_parameter_that_starts_training_later_is_refused_as_at_construction(mode):
    """The constructor refuses float16 parameters with "remainder" or stochastic rounding; one frozen at
    construction and unfrozen later, or appended to a group's params, is refused at the step that would lay it
    out, before anything changes (it would otherwise be stepped in plain float16, with no master and no stochastic
    rounding)."""
    w = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    h = nn.Parameter(torch.ones(8, dtype=torch.float16), requires_grad=False)
    opt = flatopt.SGD([w, h], lr=1e-2, **mode)
    h.requires_grad_(True)
    w.grad, h.grad = torch.ones_like(w), torch.ones_like(h)
    with pytest.raises(ValueError, match=r"parameter params\[1\] .* is float16"):
        opt.step()
    assert (w == 1).all() and (h == 1).all()

    opt = flatopt.SGD([w], lr=1e-2, **mode)
    late = nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt.param_groups[0]["params"].append(late)  # torch.optim steps what the groups hold
    late.grad = torch.ones_like(late)
    with pytest.raises(ValueError, match="is float16"):
        opt.step()
    assert (w == 1).all() and (late == 1).all()


@pytest.mark.parametrize(
    "mode", [dict(master_weights="remainder"), dict(master_weights="fp32"), dict(stochastic_rounding=True)], ids=str
)
def test_a_bfloat16_body_frozen_at_construction_counts_for_the_options(mode):
    """Progressive unfreezing: a float32 head trains while the bfloat16 body is frozen. The options apply to the
    body once unfrozen, so they are taken (they were refused, as if every parameter were float32), and the body
    gets its master copy (or its stochastic rounding) when it is laid out."""
    torch.manual_seed(0)
    head = nn.Parameter(torch.randn(4, 4))
    body = nn.Parameter(torch.randn(64, 64).bfloat16(), requires_grad=False)
    opt = flatopt.AdamW([head, body], lr=1e-2, **mode)
    head.grad = torch.randn(4, 4)
    opt.step()
    body.requires_grad_(True)
    head.grad, body.grad = torch.randn(4, 4), torch.randn(64, 64).bfloat16()
    opt.step()
    bufs = {b.dtype: b for b in flatopt.inspect(opt).buffers}
    assert bufs[torch.float32].master is None
    assert (bufs[torch.bfloat16].master is not None) == ("master_weights" in mode)


@pytest.mark.parametrize("mode", [dict(stochastic_rounding=True), dict(master_weights="remainder")], ids=str)
def test_built_under_a_meta_default_device_the_precision_options_work(mode):
    """The stochastic-rounding seed is drawn on the CPU (torch's default generator), not on the default device of
    a ``with torch.device(...)`` context the optimizer is created in."""
    torch.manual_seed(0)
    net = model(torch.bfloat16)
    with torch.device("meta"):
        opt = flatopt.AdamW(net, lr=1e-2, **mode)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert not any(p.is_meta for p in net.parameters())
