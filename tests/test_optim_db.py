"""flatopt.AdamW and flatopt.SGD against the part of torch's optimizer test database that applies to them, with
torch.optim as the reference.

Inputs: every constructor configuration that ``torch.testing._internal.common_optimizers`` lists for AdamW and
SGD (``optim_inputs_func_adamw`` / ``optim_inputs_func_sgd``, for every device), its error inputs and scheduler
inputs, kept as tables of our own in ``tests/optim_inputs.py`` (``test_tables_cover_torchs_database`` checks that
the installed torch lists nothing they lack). flatopt takes every configuration except amsgrad, and of torch's
implementation flags ``foreach=None``, ``fused=None/True``, ``differentiable=False`` and any ``capturable``; the
others must raise a ValueError that names the flag and says what to do, and change nothing. Every flatopt
optimizer here passes ``skip_unused=True``: torch.optim's rule for a parameter whose ``.grad`` is None. Both
backends run every test; the Triton backend (about 10 ms a step under the interpreter) runs the long ones on a
shortlist of inputs that takes every path of its kernels (``TRITON_SHORTLIST``).

Ported from torch's ``test/test_optim.py`` (``TestOptimRenewed``, torch 2.6 and later), as checks against
torch.optim at every step (parameters and every state tensor) where torch's test only checks a direction or a
self-consistency:

- test_optim_infos_do_not_specify_global_cliquey_kwargs: ``test_tables_hold_no_implementation_flags``
- test_errors: ``test_error_inputs``, ``test_refused_inputs``, ``test_implementation_flags``
- test_forloop_goes_right_direction: ``test_goes_right_direction`` (with and without every scheduler list);
  contiguous=False: ``test_non_contiguous_parameters`` (flatopt refuses non-dense parameters, with ``flat=True``
  at construction and with ``flat=False`` at the step; made contiguous, they step as torch.optim steps the
  non-contiguous ones)
- test_param_group_with_lrscheduler_goes_right_direction, test_tensor_lr: same names
- test_rosenbrock_sparse (SGD takes sparse gradients): ``test_sparse_gradient_refused``
- test_complex, test_complex_2d: ``test_complex_refused_and_view_as_real_matches``
- test_foreach_matches_forloop / _compare_between (a step without gradients, a layer frozen and unfrozen, a 0-dim
  and a 0-element parameter): ``test_inputs_match_torch``; in float64: ``test_float64_parameters``
- test_fused_matches_forloop (float32, bfloat16, float16 on the CPU): ``test_fused_matches_torch_fused``
- test_fused_error_on_params_on_meta: ``test_meta_parameters_refused``
- test_fused_does_not_step_if_foundinf (CUDA in torch; flatopt takes ``found_inf`` on the CPU too):
  ``test_found_inf_skips_the_step``
- test_set_default_dtype_works_with_foreach (its step-dtype half): ``test_step_dtype_follows_default_dtype``
- test_param_groups_weight_decay, test_param_groups_lr, test_step_is_noop_when_params_have_no_grad,
  test_step_is_noop_for_zero_grads, test_state_dict_deterministic, test_can_load_older_state_dict,
  test_can_load_from_to_named_state_dict, test_save_load_equality_with_weights_only, test_load_nontensor_step,
  test_state_dict_pre_hook, test_state_dict_post_hook, test_state_dict_pre_post_hook,
  test_load_state_dict_pre_hook_and_prepend, test_load_state_dict_post_hook, test_load_state_dict_pre_post_hook,
  test_step_post_hook, test_step_pre_hook, test_step_all_hooks, test_non_empty_state: same names
- test_optimizer_can_be_printed: ``test_repr_is_torchs``
- test_state_dict_with_cuda_params: on the CPU ``test_state_dict_loads_into_equal_parameters`` (torch.optim's or
  flatopt's state dict, from either backend, into flatopt over equal parameters on either backend); on a GPU
  ``test_state_dict_with_cuda_params`` (with test_cpu_load_state_dict's ``fused``/``capturable`` marks)
- test_deepcopy_copies_all_public_attrs: ``test_deepcopy_refused`` (flatopt refuses copies, saying to save
  ``state_dict()``; docs/semantics.md)

Not ported, and why:

- test_forloop_goes_right_direction_multigpu, test_mixed_device_dtype: need two GPUs. (Mixed dtypes on one
  device: tests/test_dtypes.py.)
- test_foreach_large_tensor, test_fused_large_tensor: 64-72 GB of GPU memory; tests/test_gpu.py steps a buffer
  of more than 2**31 elements instead.
- test_peak_memory_foreach, test_defaults_changed_to_foreach: about torch's foreach implementation, which flatopt
  refuses (``foreach`` must be None).
- test_cpu_load_state_dict: skipped by torch on the CPU; its GPU case is in ``test_state_dict_with_cuda_params``.
- test_fused_cpu_matches_cuda: torch's CPU and CUDA fused kernels against each other; flatopt's kernels against
  its reference on a GPU are in tests/test_gpu.py.
- test_second_order_optims_return_consistent_types: LBFGS only.
- test_set_default_dtype_works_with_foreach (its foreach half): foreach is refused.

One strict expected failure names what still differs from torch.optim (it fails once flatopt does it; remove the
mark then): ``opt.state`` entries for parameters never stepped (``test_state_holds_stepped_parameters_only``).
"""

import ast
import copy
import importlib.util
import io
import warnings
from pathlib import Path

import pytest
import torch
from conftest import INTERPRET, TOL, TRITON_SKIP, device_for, triton_available
from optim_inputs import (
    CLIQUEY_FLAGS,
    OPTIMS,
    TAKES,
    assert_matches,
    reference_kwargs,
    refusal,
    scheduler_step,
    state_keys,
)
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import flatopt

# torch's tests leave parameters without a gradient at the first step, which flatopt names in a warning (tested in
# test_compat.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*received no gradient before the first step:UserWarning")

EXACT = dict(atol=0, rtol=0)
TORCH_DEFAULT_FP32 = dict(atol=1e-5, rtol=1.3e-6)  # torch's assertEqual for float32, where torch's test uses it


def supported_cases():
    return [pytest.param(o, i, id=f"{o.name}-{i.desc}") for o in OPTIMS.values() for i in o.supported()]


# The Triton backend under the interpreter costs about 10 ms a step: the long runs (20 steps, scheduler lists,
# named and unnamed parameters) run it on these inputs, which between them take every path of the kernels (weight
# decay, maximize, tensor lr and betas, momentum, dampening, nesterov); the torch backend runs them on every input,
# and the shorter tests run every input on both.
TRITON_SHORTLIST = {
    "AdamW": ("maximize", "Tensor lr, Tensor betas, with capturable"),
    "SGD": ("maximize", "tensor lr", "dampening", "nesterov"),
}


def on_triton(optim, case):
    return case.desc in TRITON_SHORTLIST[optim.name]


def case_grid(*extras, triton_extras=None):
    """``(optim, case, backend, *extra)`` for every supported input on the torch backend and the shortlisted ones
    on the Triton backend, each with every tuple of ``extras`` (on Triton: of ``triton_extras``, if given)."""
    extras = extras or ((),)
    grid = []
    for optim in OPTIMS.values():
        for case in optim.supported():
            for backend in ("torch", "cpu", "triton"):
                if backend == "triton" and not on_triton(optim, case):
                    continue
                marks = [TRITON_SKIP] if backend == "triton" else []
                for extra in triton_extras or extras if backend == "triton" else extras:
                    label = "-".join([backend, optim.name, case.desc, *map(str, extra)])
                    grid.append(pytest.param(optim, case, backend, *extra, marks=marks, id=label))
    return grid


def refused_cases():
    return [pytest.param(o, i, id=f"{o.name}-{i.desc}") for o in OPTIMS.values() for i in o.refused()]


def make_ours(optim, args, backend, **kwargs):
    return optim.ours(args, backend=backend, skip_unused=True, **kwargs)


def weight_bias(device, contiguous=True, dtype=torch.float32):
    """torch's (10, 5) weight, (10,) bias and (5,) input, from one seed: equal on every call."""
    gen = torch.Generator().manual_seed(0)
    if contiguous:
        w, b = torch.randn(10, 5, generator=gen), torch.randn(10, generator=gen)
    else:
        w, b = torch.randn(10, 5, 2, generator=gen)[..., 0], torch.randn(10, 2, generator=gen)[..., 0]
    x = torch.randn(5, generator=gen)
    cast = dict(device=device, dtype=dtype)
    return nn.Parameter(w.to(**cast)), nn.Parameter(b.to(**cast)), x.to(**cast)


def wb_loss(w, b, x):
    return (w.mv(x) + b).pow(2).sum()


def pairs_of(ours_params, theirs_params, names=None):
    names = names or [f"params[{i}]" for i in range(len(ours_params))]
    return list(zip(names, ours_params, theirs_params))


def sequential(device, dtype):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid()).to(device=device, dtype=dtype)


def compare_between(optim, kwargs_ours, kwargs_theirs, backend, dtype=torch.float32, tol=None, iterations=7):
    """torch's _compare_between: the small model plus a 0-dim and a 0-element parameter, seven iterations; no
    backward at iteration 2 (every .grad None: the step is a no-op), the second Linear frozen at 3 and unfrozen
    at 5; parameters and states compared after every step."""
    device = device_for(backend)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype, device=device).reshape(3, 2)
    models, opts, params = [], [], []
    for side in ("ours", "theirs"):
        model = sequential(device, dtype)
        scalar = torch.tensor(0.25, device=device, dtype=dtype, requires_grad=True)
        scalar.grad = torch.tensor(0.75, device=device, dtype=dtype)
        empty = torch.zeros(0, device=device, dtype=dtype, requires_grad=True)
        empty.grad = torch.zeros_like(empty)
        ps = [*model.parameters(), scalar, empty]
        if side == "ours":
            opts.append(make_ours(optim, ps, backend, **kwargs_ours))
        else:
            opts.append(optim.theirs(ps, **reference_kwargs(kwargs_theirs, device)))
        models.append(model)
        params.append(ps)
    names = [n for n, _ in models[0].named_parameters()] + ["scalar", "empty"]
    for i in range(iterations):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            if i == 3:
                model[2].requires_grad_(False)
            if i == 5:
                model[2].requires_grad_(True)
            if i != 2:
                model(x).sum().backward()
            opt.step()
        assert_matches(opts[0], opts[1], pairs_of(*params, names), f"iteration {i}", tol)


# ---------------------------------------------------------------------------------------------- the tables
def database_inputs():
    """The configurations the installed torch's database lists for AdamW and SGD on every device, read from
    ``common_optimizers.py`` (whose import needs ``expecttest``) by running its input functions with stand-ins
    for the names they use. Returns ``(inputs, None)`` or ``(None, why)``."""
    spec = importlib.util.find_spec("torch.testing._internal.common_optimizers")
    if spec is None or not spec.origin:
        return None, "torch.testing._internal.common_optimizers is not installed"
    tree = ast.parse(Path(spec.origin).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    wanted = {"AdamW": "optim_inputs_func_adamw", "SGD": "optim_inputs_func_sgd"}
    needed = ["optim_inputs_func_adam", *wanted.values()]
    missing = [n for n in needed if n not in functions]
    if missing:
        return None, f"torch's common_optimizers.py has no {missing}"

    class OptimizerInput:
        def __init__(self, params, kwargs, desc=""):
            self.kwargs, self.desc = kwargs, desc

    namespace = dict(
        torch=torch,
        OptimizerInput=OptimizerInput,
        CUDA_CONFIG_GPUS=["cuda", "xpu"],
        _get_device_type=lambda d: str(d).split(":")[0],
    )
    module = ast.Module(body=[functions[n] for n in needed], type_ignores=[])
    exec(compile(module, spec.origin, "exec"), namespace)
    found = {}
    for name, function in wanted.items():
        for device in ("cpu", "cuda", "mps", "xpu"):
            try:
                inputs = namespace[function](device)
            except (NameError, TypeError, AttributeError) as e:
                return None, f"torch's {function} now needs more than its inputs' table: {e!r}"
            found.setdefault(name, []).extend((i.desc, i.kwargs) for i in inputs)
    return found, None


def same_kwargs(a, b):
    def same(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.shape == y.shape
                and x.dtype == y.dtype
                and torch.equal(x, y)
            )
        if isinstance(x, tuple) and isinstance(y, tuple):
            return len(x) == len(y) and all(map(same, x, y))
        return type(x) is type(y) and x == y

    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def test_tables_cover_torchs_database():
    found, why = database_inputs()
    if found is None:
        pytest.skip(f"cannot read torch's optimizer database: {why}")
    for name, inputs in found.items():
        ours = OPTIMS[name].inputs
        lacking = [(desc, kw) for desc, kw in inputs if not any(same_kwargs(kw, i.kwargs) for i in ours)]
        assert not lacking, f"torch's database lists {name} inputs that tests/optim_inputs.py lacks: {lacking}"


def test_tables_hold_no_implementation_flags():
    """torch's test_optim_infos_do_not_specify_global_cliquey_kwargs, on our tables: the tests add the flags."""
    for optim in OPTIMS.values():
        for i in optim.inputs:
            assert not set(i.kwargs) & set(CLIQUEY_FLAGS), f"{optim.name} {i.desc}: {i.kwargs}"


# ---------------------------------------------------------------------------------------------- errors
def one_param():
    p = nn.Parameter(torch.randn(1, 1))
    p.grad = torch.randn(1, 1)
    return p


def named_params_supported():
    try:
        torch.optim.SGD([("w", nn.Parameter(torch.zeros(1)))])
    except (TypeError, ValueError, AttributeError):
        return False
    return True


# (description, params(p, p2), kwargs, error type, torch's regex, flatopt's regex where it differs, needs names)
COMMON_ERRORS = [
    (
        "invalid param type",
        lambda p, p2: p,
        {},
        TypeError,
        "params argument given to the optimizer should be an iterable of Tensors or dicts",
    ),
    (
        "a param group cannot have duplicate parameters",
        lambda p, p2: [p, p],
        {},
        UserWarning,
        ".*a parameter group with duplicate parameters.*",
    ),
    (
        "duplicate parameters should not occur across param groups either",
        lambda p, p2: [{"params": p}, {"params": p}],
        {},
        ValueError,
        "some parameters appear in more than one parameter group",
    ),
    (
        "Tensor lr must be 1-element",
        lambda p, p2: [p],
        dict(lr=torch.tensor([0.001, 0.001])),
        ValueError,
        "Tensor lr must be 1-element",
    ),
    (
        "all optimizer params should be with/without names",
        lambda p, p2: [("weight", p), p2],
        {},
        ValueError,
        "all optimizer params should be with/without names. Some param names are missing",
    ),
    (
        "all optimizer param groups should be with/without names.",
        lambda p, p2: [{"params": [p], "lr": 1e-2}, {"params": [("weight", p2)]}],
        {},
        ValueError,
        "all optimizer param groups should be with/without names. cannot add param group with names to the optimizer",
    ),
]
ADAMW_ERRORS = [
    (
        "beta1 should be between 0 and 1",
        dict(lr=1e-2, betas=(1.0, 0.0)),
        ValueError,
        "Invalid beta parameter at index 0: 1.0",
        None,
    ),
    ("weight_decay should > 0", dict(lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1", None),
    (
        "lr as Tensor doesn't work with foreach & not capturable",
        dict(lr=torch.tensor(0.001), foreach=True),
        ValueError,
        "lr as a Tensor is not supported for capturable=False and foreach=True",
        refusal("AdamW", "foreach", True),
    ),
    (
        "betas must be either both floats or both Tensors",
        dict(lr=1e-2, betas=(0.9, torch.tensor(0.99))),
        ValueError,
        "betas must be either both floats or both Tensors",
        None,
    ),
    (
        "betas must be either both floats or both Tensors (2)",
        dict(lr=1e-2, betas=(torch.tensor(0.9), 0.99)),
        ValueError,
        "betas must be either both floats or both Tensors",
        None,
    ),
    (
        "betas[0] as a Tensor is not supported for capturable=False and foreach=True",
        dict(lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True),
        ValueError,
        r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True",
        refusal("AdamW", "foreach", True),
    ),
    # torch lists these two for CUDA only (RuntimeError there); flatopt refuses the flag on any device
    (
        "`fused` and `foreach` cannot be `True` together",
        dict(foreach=True, fused=True),
        None,
        None,
        refusal("AdamW", "foreach", True),
    ),
    (
        "`fused` does not support `differentiable`",
        dict(fused=True, differentiable=True),
        None,
        None,
        refusal("AdamW", "differentiable", True),
    ),
]
SGD_ERRORS = [
    (
        "momentum should be between 0 and 1",
        dict(lr=1e-2, momentum=-0.5),
        ValueError,
        "Invalid momentum value: -0.5",
        None,
    ),
    (
        "`fused` and `foreach` cannot be `True` together",
        dict(foreach=True, fused=True),
        None,
        None,
        refusal("SGD", "foreach", True),
    ),
    (
        "`fused` does not support `differentiable`",
        dict(fused=True, differentiable=True),
        None,
        None,
        refusal("SGD", "differentiable", True),
    ),
]


def error_cases():
    cases = []
    for optim in OPTIMS.values():
        for desc, params, kwargs, error, regex in COMMON_ERRORS:
            cases.append(pytest.param(optim, params, kwargs, error, regex, regex, id=f"{optim.name}-{desc}"))
        for desc, kwargs, error, regex, ours in {"AdamW": ADAMW_ERRORS, "SGD": SGD_ERRORS}[optim.name]:
            cases.append(
                pytest.param(
                    optim, lambda p, p2: [p], kwargs, error, regex, ours, id=f"{optim.name}-optimizer-specific-{desc}"
                )
            )
    return cases


def snapshot(*params):
    return [(p, p.data_ptr(), p.detach().clone(), p.grad, p.grad.detach().clone()) for p in params]


def assert_unchanged(before):
    for p, ptr, value, grad, grad_value in before:
        assert p.data_ptr() == ptr and torch.equal(p.detach(), value), "a refused construction changed a parameter"
        assert p.grad is grad and torch.equal(p.grad, grad_value), "a refused construction changed a .grad"


@pytest.mark.parametrize("optim, params, kwargs, error, regex, ours_regex", error_cases())
def test_error_inputs(optim, params, kwargs, error, regex, ours_regex):
    """torch's test_errors: each error input raises (or warns) in torch's words, or, where flatopt refuses the
    implementation flag first, with flatopt's reason; a refused construction changes nothing."""
    if regex and "names" in regex and not named_params_supported():
        pytest.skip("this torch does not take named parameters (torch >= 2.6 does)")
    p, p2 = one_param(), one_param()
    if error is not None:  # the row is torch's, on this device: torch.optim must agree with it
        check = pytest.warns if issubclass(error, Warning) else pytest.raises
        with check(error, match=regex):
            optim.theirs(params(p, p2), **copy.deepcopy(kwargs))
    before = snapshot(p, p2)
    ours_error = ValueError if error is None else error
    if issubclass(ours_error, Warning):
        with pytest.warns(ours_error, match=ours_regex):
            optim.ours(params(p, p2), skip_unused=True, **copy.deepcopy(kwargs))
    else:
        with pytest.raises(ours_error, match=ours_regex):
            optim.ours(params(p, p2), skip_unused=True, **copy.deepcopy(kwargs))
        assert_unchanged(before)


@pytest.mark.parametrize("optim, case", refused_cases())
def test_refused_inputs(optim, case):
    """The configurations of torch's database that flatopt does not implement (amsgrad) raise, say what to use,
    and change nothing."""
    p, p2 = one_param(), one_param()
    before = snapshot(p, p2)
    with pytest.raises(ValueError, match=case.refused):
        optim.ours([p, p2], skip_unused=True, **case.make())
    assert_unchanged(before)


def flag_variants():
    """torch's _get_optim_inputs_including_global_cliquey_kwargs (all three flags False, then each True) and each
    flag alone at each value."""
    base = dict.fromkeys(CLIQUEY_FLAGS, False)
    variants = [base] + [{**base, flag: True} for flag in CLIQUEY_FLAGS]
    variants += [
        {flag: value}
        for flag in CLIQUEY_FLAGS
        for value in (None, False, True)
        if (flag, value) != ("differentiable", None)
    ]
    return variants


@pytest.mark.parametrize("flags", flag_variants(), ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_implementation_flags(optim, flags, backend):
    """foreach=None, fused=None or True and differentiable=False are taken, and then flatopt steps as torch.optim
    with the same flags; any other value raises a ValueError naming the flag and saying what to do."""
    refused = [(k, v) for k, v in flags.items() if (k, v) not in TAKES]
    device = device_for(backend)
    if refused:
        p = one_param()
        before = snapshot(p)
        alternatives = "|".join(refusal(optim.name, k, v) for k, v in refused)
        with pytest.raises(ValueError, match=alternatives):
            optim.ours([p], backend=backend, skip_unused=True, **flags)
        assert_unchanged(before)
        return
    ours_params, theirs_params = [weight_bias(device)[:2] for _ in range(2)]
    x = weight_bias(device)[2]
    ours = make_ours(optim, ours_params, backend, lr=0.01, **flags)
    theirs = optim.theirs(theirs_params, lr=0.01, **flags)
    for step in range(3):
        for ps, opt in ((ours_params, ours), (theirs_params, theirs)):
            opt.zero_grad()
            wb_loss(*ps, x).backward()
            opt.step()
        assert_matches(ours, theirs, pairs_of(ours_params, theirs_params), f"step {step}")


# ---------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("optim, case", supported_cases())
def test_inputs_match_torch(optim, case, backend):
    compare_between(optim, case.make(), case.make(), backend)


FUSED_DTYPES = [
    pytest.param("AdamW", torch.float32, id="AdamW-float32"),
    pytest.param("AdamW", torch.bfloat16, id="AdamW-bfloat16"),
    pytest.param("AdamW", torch.float16, id="AdamW-float16"),
    pytest.param("SGD", torch.float32, id="SGD-float32"),
    # SGD in bfloat16/float16 is not compared with torch's fused CPU SGD, which (torch 2.13) does not compute in
    # float32 (its parameters drift from a float32 step rounded once); tests/test_dtypes.py checks flatopt's SGD
    # there against a float32 torch.optim step rounded once.
]


# Triton's interpreter (3.x, TRITON_INTERPRET=1) rounds float32 to bfloat16 toward zero, whatever the kernel asks
# (compiled kernels round to nearest even, as torch does): on the CPU the Triton backend's bfloat16 parameters come
# out a unit in the last place lower at some steps, which the model's iterations carry on.
INTERPRETED_BF16 = "Triton's interpreter rounds float32 to bfloat16 toward zero (compiled kernels: to nearest even)"


@pytest.mark.parametrize("name, dtype", FUSED_DTYPES)
def test_fused_matches_torch_fused(name, dtype, backend):
    """torch's test_fused_matches_forloop: flatopt computes low-precision parameters in float32 and rounds once,
    as torch's fused kernels do, so it is compared with torch.optim(fused=True), input by input."""
    if backend == "triton" and INTERPRET and dtype == torch.bfloat16:
        pytest.skip(INTERPRETED_BF16 + "; this comparison runs on a GPU and with the torch backend")
    optim = OPTIMS[name]
    for case in optim.supported():
        if backend != "triton" or on_triton(optim, case):
            kwargs = case.make(fused=True)
            compare_between(optim, kwargs, case.make(fused=True), backend, dtype=dtype, tol=TOL[dtype])


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_float64_parameters(optim, backend):
    """torch's test_foreach_matches_forloop runs in float64. Tensor hyper-parameters are made float64 on both
    sides: torch.optim computes with a float32 tensor lr in float32 (its step size rounds to float32), where
    flatopt reads the tensor's value into its float64 table."""

    def wide(kwargs):
        def cast(v):
            if isinstance(v, torch.Tensor):
                return v.double()
            if isinstance(v, tuple):
                return tuple(cast(x) for x in v)
            return v

        return {k: cast(v) for k, v in kwargs.items()}

    for case in optim.supported():
        kwargs = wide(case.make())
        tol = dict(atol=1e-12, rtol=1e-10)
        compare_between(optim, kwargs, wide(case.make()), backend, dtype=torch.float64, tol=tol)


def test_step_dtype_follows_default_dtype():
    """torch's test_set_default_dtype_works_with_foreach asserts the step's dtype: float64 when the default dtype
    is float64, float32 otherwise."""
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        p, q = (nn.Parameter(torch.ones(3, dtype=torch.float32)) for _ in range(2))
        p.grad, q.grad = torch.ones(3, dtype=torch.float32), torch.ones(3, dtype=torch.float32)
        ours, theirs = flatopt.AdamW([p], skip_unused=True), torch.optim.AdamW([q])
        ours.step()
        theirs.step()
        assert theirs.state[q]["step"].dtype == torch.float64
        assert ours.state_dict()["state"][0]["step"].dtype == theirs.state_dict()["state"][0]["step"].dtype
    finally:
        torch.set_default_dtype(old)


def run_weight_bias(optim, backend, build, schedulers=(), contiguous=True, steps=20, **options):
    """flatopt and torch.optim on torch's weight/bias problem, compared at every step (with the optimizer's
    ``run_tol``). ``build(w, b, fix)`` makes the constructor's first argument, with ``fix`` applied to each set of
    keyword arguments (torch.optim's side drops what only flatopt takes); torch.optim's parameters are
    non-contiguous when ``contiguous`` is False, flatopt's are contiguous copies. Returns the loss before and both
    losses after (torch.optim's, flatopt's)."""
    device = device_for(backend)
    theirs_side = weight_bias(device, contiguous=contiguous)
    ours_side = tuple(nn.Parameter(t.detach().contiguous()) for t in theirs_side[:2]) + theirs_side[2:]
    ours = make_ours(optim, build(*ours_side[:2], lambda k: k), backend, **options)
    theirs = optim.theirs(build(*theirs_side[:2], lambda k: reference_kwargs(k, device)))
    scheds = [[make(o) for make in schedulers] for o in (ours, theirs)]
    initial = float(wb_loss(*theirs_side).detach())
    for step in range(steps):
        losses = []
        for (w, b, x), opt in zip((ours_side, theirs_side), (ours, theirs)):
            opt.zero_grad()
            loss = wb_loss(w, b, x)
            loss.backward()
            opt.step()
            losses.append(loss)
        for ss in scheds:
            for s in ss:
                scheduler_step(s, losses[1])  # one metric for both: ReduceLROnPlateau decides alike
        pairs = pairs_of(ours_side[:2], theirs_side[:2], ["weight", "bias"])
        assert_matches(ours, theirs, pairs, f"step {step}", optim.run_tol)
    return initial, float(wb_loss(*theirs_side).detach()), float(wb_loss(*ours_side).detach())


def one_group(case):
    return lambda w, b, fix: [{"params": [w, b], **fix(case.make())}]


def assert_direction(kwargs, initial, *finals):
    for final in finals:
        if kwargs.get("maximize", False):
            assert final > initial, f"maximize: the loss went from {initial} to {final}"
        else:
            assert final < initial, f"the loss went from {initial} to {final}"


@pytest.mark.parametrize("optim, case, backend, with_lrsched", case_grid(("no-sched",), ("lrsched",)))
def test_goes_right_direction(optim, case, backend, with_lrsched):
    """torch's test_forloop_goes_right_direction (contiguous parameters), with every scheduler list of the
    optimizer's OptimizerInfo (the first one on the Triton backend: schedulers change the param groups, which both
    backends read through the same hyper-parameter table)."""
    lists = optim.scheduler_inputs if backend != "triton" else optim.scheduler_inputs[:1]
    for schedulers in lists if with_lrsched == "lrsched" else [()]:
        initial, *finals = run_weight_bias(optim, backend, one_group(case), schedulers)
        assert_direction(case.kwargs, initial, *finals)


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_non_contiguous_parameters(optim, backend):
    """torch's test_forloop_goes_right_direction with contiguous=False: flatopt needs dense parameters and says so
    at construction, with flat=True and with flat=False (the caller's tensors, one launch each), changing nothing;
    with flat=False a parameter that stops being dense after construction is refused at the step. Parameters made
    contiguous as the message says then step as torch.optim steps the non-contiguous ones."""
    w, b, x = weight_bias(device_for(backend), contiguous=False)
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    before = snapshot(w, b)
    for flat in (True, False):
        with pytest.raises(ValueError, match=r"needs dense parameters.*make it contiguous before creating the optim"):
            optim.ours([w, b], backend=backend, skip_unused=True, flat=flat)
        assert_unchanged(before)
    dense_w = nn.Parameter(w.detach().contiguous())
    dense_w.grad = torch.ones_like(dense_w)
    opt = optim.ours([dense_w, b.detach().contiguous().requires_grad_()], backend=backend, flat=False)
    dense_w.data = w.detach()  # no longer dense
    with pytest.raises(
        RuntimeError, match=r"needs dense parameters.*make it contiguous \(p\.data = p\.data\.contiguous"
    ):
        opt.step()
    assert torch.equal(dense_w, w)
    with pytest.raises(ValueError, match=r"needs dense parameters.*make it contiguous before creating the optim"):
        opt.add_param_group({"params": [w]})
    assert len(opt.param_groups) == 1
    for case in optim.supported():
        if backend != "triton" or on_triton(optim, case):
            initial, *finals = run_weight_bias(optim, backend, one_group(case), contiguous=False)
            assert_direction(case.kwargs, initial, *finals)


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_param_group_with_lrscheduler_goes_right_direction(optim, backend):
    for schedulers in optim.scheduler_inputs:
        initial, *finals = run_weight_bias(
            optim, backend, lambda w, b, fix: [{"params": [w]}, {"params": [b], "lr": 0.01}], schedulers
        )
        assert_direction({}, initial, *finals)


@pytest.mark.parametrize("optim, case", supported_cases())
def test_tensor_lr(optim, case, backend):
    """A tensor lr steps as the same float lr (both rounded to float32), and as torch.optim with it."""
    device = device_for(backend)
    kwargs = case.make()
    kwargs.pop("lr", None)
    sides = [weight_bias(device) for _ in range(3)]
    with_float = make_ours(optim, list(sides[0][:2]), backend, lr=1e-3, **kwargs)
    with_tensor = make_ours(optim, list(sides[1][:2]), backend, lr=torch.tensor(1e-3), **copy.deepcopy(kwargs))
    theirs = optim.theirs(list(sides[2][:2]), lr=torch.tensor(1e-3), **reference_kwargs(copy.deepcopy(kwargs), device))
    for step in range(5):
        for (w, b, x), opt in zip(sides, (with_float, with_tensor, theirs)):
            opt.zero_grad()
            wb_loss(w, b, x).backward()
            opt.step()
        for i in range(2):
            torch.testing.assert_close(
                sides[0][i], sides[1][i], **EXACT, msg=lambda m: f"step {step}: float lr against tensor lr: {m}"
            )
        assert_matches(with_tensor, theirs, pairs_of(sides[1][:2], sides[2][:2]), f"step {step}")


@pytest.mark.parametrize("optim, case, backend", case_grid())
def test_param_groups_weight_decay(optim, case, backend):
    def build(w, b, fix):
        return [{"params": [w], **fix(case.make())}, {"params": [b], **fix(case.make(weight_decay=0.0))}]

    initial, *finals = run_weight_bias(optim, backend, build)
    assert_direction(case.kwargs, initial, *finals)


@pytest.mark.parametrize("optim, case, backend", case_grid())
def test_param_groups_lr(optim, case, backend):
    """A group at lr 1e-28 beside one at the input's lr: its parameter does not move (within torch's float32
    tolerance), and everything is as torch.optim's."""
    device = device_for(backend)
    kwargs = case.make()
    if "lr" not in kwargs or kwargs["lr"] == 0:
        kwargs["lr"] = 1e-3
    sides, irrelevant = [], []
    for _ in range(2):
        sides.append(weight_bias(device))
        irrelevant.append(nn.Parameter(torch.linspace(-1, 1, 2, device=device)))
    start = irrelevant[0].detach().clone()

    def groups(w, b, other, fix):
        return [{"params": [w, b], **fix(copy.deepcopy(kwargs))}, {"params": [other]}]

    ours = make_ours(optim, groups(*sides[0][:2], irrelevant[0], lambda k: k), backend, lr=1e-28)
    theirs = optim.theirs(groups(*sides[1][:2], irrelevant[1], lambda k: reference_kwargs(k, device)), lr=1e-28)
    gen = torch.Generator().manual_seed(3)
    initial = float(wb_loss(*sides[1]).detach())
    for step in range(20):
        g = torch.rand(2, generator=gen).to(device)
        for (w, b, x), other, opt in zip(sides, irrelevant, (ours, theirs)):
            opt.zero_grad()
            wb_loss(w, b, x).backward()
            other.grad = g.clone()
            opt.step()
        pairs = pairs_of([*sides[0][:2], irrelevant[0]], [*sides[1][:2], irrelevant[1]])
        assert_matches(ours, theirs, pairs, f"step {step}", optim.run_tol)
    assert_direction(kwargs, initial, float(wb_loss(*sides[0]).detach()))
    torch.testing.assert_close(irrelevant[0].detach(), start, **TORCH_DEFAULT_FP32)


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_step_is_noop_when_params_have_no_grad(optim, backend):
    params = [torch.randn(2, 3) for _ in range(2)]
    old = [p.clone() for p in params]
    for case in optim.supported():
        opt = make_ours(optim, params, backend, **case.make())
        assert opt.step(lambda: torch.tensor([1.0])) == torch.tensor([1.0])
        for p, q in zip(params, old):
            assert torch.equal(p, q), case.desc
        assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize(
    "optim, case", [c for c in supported_cases() if c.values[1].kwargs.get("weight_decay", 0) == 0]
)
def test_step_is_noop_for_zero_grads(optim, case, backend):
    """A zero gradient leaves the parameter where it was, as in torch.optim. As torch's test: the inputs without
    weight decay (by its criterion, none in the input, so AdamW's default 0.01 stays), AdamW at lr 1e-5."""
    kwargs = case.make()
    if optim.name == "AdamW":
        kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr"), torch.Tensor) else 1e-5
    device = device_for(backend)
    old = torch.linspace(-1, 1, 5, device=device).reshape(5, 1)
    p, q = nn.Parameter(old.clone()), nn.Parameter(old.clone())
    ours = make_ours(optim, [p], backend, **kwargs)
    theirs = optim.theirs([q], **reference_kwargs(copy.deepcopy(kwargs), device))
    for param, opt in ((p, ours), (q, theirs)):
        param.grad = torch.zeros_like(param)
        assert opt.step(lambda: torch.tensor([1.0])) == torch.tensor([1.0])
    assert_matches(ours, theirs, [("param", p, q)], "after the step")
    torch.testing.assert_close(p.detach(), old, **TORCH_DEFAULT_FP32)


@pytest.mark.parametrize("optim, case", supported_cases())
def test_repr_is_torchs(optim, case):
    """torch's test_optimizer_can_be_printed; flatopt prints as torch.optim does (one-element tensor betas as the
    installed torch keeps them: 0-dim from torch 2.13 on)."""
    params = [nn.Parameter(torch.randn(2, 3)) for _ in range(2)]
    ours = optim.ours(params, skip_unused=True, **case.make())
    theirs = optim.theirs(params, **reference_kwargs(case.make(), "cpu"))
    assert repr(ours) == repr(theirs)


# ---------------------------------------------------------------------------------------------- state dicts
def named(params, is_named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else params


def without_param_names(state_dict):
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        group.pop("param_names", None)
    return state_dict


NAMED_PAIRS = [(False, False), (False, True), (True, False), (True, True)]


@pytest.mark.parametrize(
    "optim, case, backend, is_named_optim0, is_named_optim1", case_grid(*NAMED_PAIRS, triton_extras=[(False, False)])
)
def test_state_dict_deterministic(optim, case, backend, is_named_optim0, is_named_optim1):
    if (is_named_optim0 or is_named_optim1) and not named_params_supported():
        pytest.skip("this torch does not take named parameters (torch >= 2.6 does)")
    device = device_for(backend)
    w, b, x = weight_bias(device)
    opt = make_ours(optim, named([w, b], is_named_optim0), backend, **case.make())

    def fwd_bwd(o, w, b):
        o.zero_grad()
        wb_loss(w, b, x).backward()

    for _ in range(10):
        fwd_bwd(opt, w, b)
        opt.step()
    with torch.no_grad():
        w_c, b_c = nn.Parameter(w.clone()), nn.Parameter(b.clone())
    opt_c = make_ours(optim, named([w_c, b_c], is_named_optim1), backend, **case.make())
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(10):
        fwd_bwd(opt, w, b)
        fwd_bwd(opt_c, w_c, b_c)
        opt.step()
        opt_c.step()
        torch.testing.assert_close(w_c, w, **EXACT, msg=lambda m: f"step {step}, weight: {m}")
        torch.testing.assert_close(b_c, b, **EXACT, msg=lambda m: f"step {step}, bias: {m}")
    torch.testing.assert_close(without_param_names(opt_c.state_dict()), without_param_names(opt.state_dict()), **EXACT)
    opt_c.param_groups.extend(opt_c.param_groups)  # repeated parameters are numbered as the first time
    torch.testing.assert_close(
        without_param_names(opt_c.state_dict())["param_groups"][-1],
        without_param_names(opt.state_dict())["param_groups"][-1],
        **EXACT,
    )


def conv_bn(device):
    """torch's Conv2d + BatchNorm2d. Its test trains the BatchNorm and sums the output: the convolution's
    gradients are then rounding noise (a normalised output's sum does not depend on them), which AdamW scales up
    to full steps and no two implementations agree on. Compared with torch.optim here, the BatchNorm normalises
    with its running statistics (eval mode) and the output is weighted."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(4, 2, 1, stride=2), nn.BatchNorm2d(2, eps=1e-05, momentum=0.1)).to(device)
    return model.eval(), torch.rand(1, 4, 16, 16, generator=torch.Generator().manual_seed(2)).to(device)


def conv_bn_step(opt, model, x):
    opt.zero_grad()
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    (out * weights).sum().backward()
    opt.step()


@pytest.mark.parametrize("optim, case, backend", case_grid())
def test_can_load_older_state_dict(optim, case, backend):
    """A state dict without the flags torch added after the optimizer's first release (foreach, differentiable,
    fused, maximize, capturable) loads and steps, as in torch.optim."""
    device = device_for(backend)
    (model, x), (ref, _) = conv_bn(device), conv_bn(device)
    ours = make_ours(optim, list(model.parameters()), backend, **case.make())
    theirs = optim.theirs(ref.parameters(), **reference_kwargs(case.make(), device))
    pairs = [(n, p, q) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
    for _ in range(3):
        conv_bn_step(ours, model, x)
        conv_bn_step(theirs, ref, x)
    for opt in (ours, theirs):
        old = copy.deepcopy(opt.state_dict())
        for group in old["param_groups"]:
            for flag in optim.not_og_supported_flags:
                group.pop(flag, None)
        opt.load_state_dict(old)
    assert_matches(ours, theirs, pairs, "after loading")
    for step in range(2):
        conv_bn_step(ours, model, x)
        conv_bn_step(theirs, ref, x)
        assert_matches(ours, theirs, pairs, f"step {step} after loading")


@pytest.mark.parametrize(
    "optim, case, backend, is_named_optim0, is_named_optim1", case_grid(*NAMED_PAIRS, triton_extras=[(True, False)])
)
def test_can_load_from_to_named_state_dict(optim, case, backend, is_named_optim0, is_named_optim1):
    if (is_named_optim0 or is_named_optim1) and not named_params_supported():
        pytest.skip("this torch does not take named parameters (torch >= 2.6 does)")
    device = device_for(backend)
    model, x = conv_bn(device)
    params = model.named_parameters() if is_named_optim0 else model.parameters()
    opt = make_ours(optim, params, backend, **case.make())
    for _ in range(3):
        conv_bn_step(opt, model, x)
    old = copy.deepcopy(opt.state_dict())
    params2 = model.named_parameters() if is_named_optim1 else model.parameters()
    opt2 = make_ours(optim, params2, backend, **case.make())
    opt2.load_state_dict(old)
    conv_bn_step(opt2, model, x)
    if is_named_optim0 or is_named_optim1:
        assert opt2.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("is_named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("optim, case", supported_cases())
def test_save_load_equality_with_weights_only(optim, case, is_named, backend):
    if is_named and not named_params_supported():
        pytest.skip("this torch does not take named parameters (torch >= 2.6 does)")
    w, b, x = weight_bias(device_for(backend))
    opt = make_ours(optim, named([w, b], is_named), backend, **case.make())
    for _ in range(3):
        opt.zero_grad()
        wb_loss(w, b, x).backward()
        opt.step()
    sd = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    for weights_only in (False, True):
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=weights_only)
        torch.testing.assert_close(without_param_names(loaded), without_param_names(sd), **EXACT)
        names = [g.get("param_names") for g in sd["param_groups"]]
        assert [g.get("param_names") for g in loaded["param_groups"]] == names


@pytest.mark.parametrize("optim, case", supported_cases())
def test_load_nontensor_step(optim, case, backend):
    """A state dict whose step counts are Python numbers loads, and the next step is torch.optim's."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(4)
    values = [torch.randn(2, 3, generator=gen).to(device) for _ in range(2)]
    grads = [torch.rand(2, 3, generator=gen).to(device) for _ in range(2)]
    sides = [[nn.Parameter(v.clone()) for v in values] for _ in range(2)]
    for ps in sides:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
    ours = make_ours(optim, sides[0], backend, **case.make())
    theirs = optim.theirs(sides[1], **reference_kwargs(case.make(), device))
    for opt in (ours, theirs):
        for _ in range(3):
            opt.step()
        state_dict = copy.deepcopy(opt.state_dict())
        for entry in state_dict["state"].values():
            if torch.is_tensor(entry.get("step")):
                entry["step"] = entry["step"].item()
        opt.load_state_dict(state_dict)
        opt.step()
    assert_matches(ours, theirs, pairs_of(*sides), "after loading and one step")


@pytest.mark.parametrize(
    "optim, case, backend, source",
    case_grid(("torch.optim",), ("flatopt-torch",), ("flatopt-cpu",), ("flatopt-triton",)),
)
def test_state_dict_loads_into_equal_parameters(optim, case, backend, source):
    """torch's test_state_dict_with_cuda_params without a second device: a state dict made by torch.optim or by
    flatopt (any backend) over some parameters loads into flatopt over equal, other parameters; the state dict
    is not changed by loading, step counts stay float32 CPU tensors, and both then step alike."""
    source_backend = source.split("-")[1] if source.startswith("flatopt") else "torch"
    if source_backend == "triton" and not triton_available():
        pytest.skip("the state dict's source runs the Triton kernels, which need a GPU or TRITON_INTERPRET=1")
    device, source_device = device_for(backend), device_for(source_backend)
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(2, 3, generator=gen) for _ in range(2)]
    grads = [torch.randn(2, 3, generator=gen) for _ in range(2)]
    params = [nn.Parameter(v.clone().to(source_device)) for v in values]
    for p, g in zip(params, grads):
        p.grad = g.clone().to(source_device)
    if source == "torch.optim":
        first = optim.theirs(params, **reference_kwargs(case.make(), source_device))
    else:
        first = make_ours(optim, params, source_backend, **case.make())
    for _ in range(3):
        first.step()
    with torch.no_grad():
        params2 = [nn.Parameter(p.detach().clone().to(device)) for p in params]
    for p, q in zip(params2, params):
        p.grad = q.grad.to(device)
    second = make_ours(optim, params2, backend, **case.make())
    state_dict, loaded = copy.deepcopy(first.state_dict()), copy.deepcopy(first.state_dict())
    second.load_state_dict(loaded)
    torch.testing.assert_close(loaded, state_dict, **EXACT)
    for entry in second.state_dict()["state"].values():
        if "step" in entry:
            assert entry["step"].device.type == "cpu" and entry["step"].dtype == torch.float32
    for step in range(5):
        first.step()
        second.step()
        for i, (p, q) in enumerate(zip(params2, params)):
            torch.testing.assert_close(
                p.detach().cpu(), q.detach().cpu(), **TOL[torch.float32], msg=lambda m: f"step {step}, params[{i}]: {m}"
            )
        torch.testing.assert_close(
            without_param_names(second.state_dict()),
            without_param_names(first.state_dict()),
            check_device=False,
            **TOL[torch.float32],
        )


@pytest.mark.requires_cuda
@pytest.mark.parametrize("optim, case", supported_cases())
def test_state_dict_with_cuda_params(optim, case):
    """A state dict of CPU parameters (torch.optim's) loads into flatopt over the same values on the GPU."""
    gen = torch.Generator().manual_seed(5)
    params = [nn.Parameter(torch.randn(2, 3, generator=gen)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(2, 3, generator=gen)
    cpu = optim.theirs(params, **reference_kwargs(case.make(), "cpu"))
    for _ in range(3):
        cpu.step()
    with torch.no_grad():
        params_cuda = [nn.Parameter(p.detach().to("cuda")) for p in params]
    for p, q in zip(params_cuda, params):
        p.grad = q.grad.to("cuda")
    kwargs = case.make()
    if isinstance(kwargs.get("lr"), torch.Tensor):
        kwargs["lr"] = kwargs["lr"].cuda()
    on_cuda = optim.ours(params_cuda, skip_unused=True, **kwargs)
    state_dict = copy.deepcopy(cpu.state_dict())
    for group in state_dict["param_groups"]:  # torch's test_cpu_load_state_dict: a fused or capturable optimizer's
        group["fused"] = True
        if optim.name == "AdamW":
            group["capturable"] = True
    loaded = copy.deepcopy(state_dict)
    on_cuda.load_state_dict(loaded)
    torch.testing.assert_close(loaded, state_dict, **EXACT)
    for entry in on_cuda.state_dict()["state"].values():
        if "step" in entry:
            assert entry["step"].device.type == "cpu"
    for step in range(5):
        cpu.step()
        on_cuda.step()
        for i, (p, q) in enumerate(zip(params_cuda, params)):
            torch.testing.assert_close(
                p.detach().cpu(), q.detach(), **TOL[torch.float32], msg=lambda m: f"step {step}, params[{i}]: {m}"
            )


# ---------------------------------------------------------------------------------------------- hooks
def state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def state_dict_post_hook(optimizer, state_dict):
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def load_state_dict_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def load_state_dict_pre_hook2(optimizer, state_dict):
    mine = copy.deepcopy(state_dict)  # a hook returning another state dict: that one is loaded
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def load_state_dict_post_hook(optimizer):
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


def hook_subject(optim, case, backend):
    return make_ours(optim, [torch.rand(2, 3, requires_grad=True)], backend, **case.make())


@pytest.mark.parametrize("optim, case", supported_cases())
def test_state_dict_pre_hook(optim, case, backend):
    opt = hook_subject(optim, case, backend)
    opt.register_state_dict_pre_hook(state_dict_pre_hook)
    assert opt.state_dict()["state"]["test"] == 1


@pytest.mark.parametrize("optim, case", supported_cases())
def test_state_dict_post_hook(optim, case, backend):
    opt = hook_subject(optim, case, backend)
    opt.register_state_dict_post_hook(state_dict_post_hook)
    assert opt.state_dict()["ran_state_dict_pre_hook"] is False


@pytest.mark.parametrize("optim, case", supported_cases())
def test_state_dict_pre_post_hook(optim, case, backend):
    opt = hook_subject(optim, case, backend)
    opt.register_state_dict_pre_hook(state_dict_pre_hook)
    opt.register_state_dict_post_hook(state_dict_post_hook)
    state_dict = opt.state_dict()
    assert "test" not in state_dict["state"]
    assert state_dict["ran_state_dict_pre_hook"] is True


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_nontensor_state_keys_reach_the_state_dict(optim, backend):
    """What torch.optim's state_dict() makes of a non-tensor key in opt.state (a load post-hook's mark here)."""
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    ours, theirs = make_ours(optim, [p], backend), optim.theirs([q])
    for opt, param in ((ours, p), (theirs, q)):
        opt.register_load_state_dict_post_hook(load_state_dict_post_hook)
        opt.load_state_dict(opt.state_dict())
        param.grad = torch.ones(3)
        opt.step()
    assert ours.state_dict()["state"].keys() == theirs.state_dict()["state"].keys()


@pytest.mark.parametrize("optim, case", supported_cases())
def test_load_state_dict_pre_hook_and_prepend(optim, case, backend):
    opt = hook_subject(optim, case, backend)
    state_dict = opt.state_dict()
    opt.register_load_state_dict_pre_hook(load_state_dict_pre_hook1)
    opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(load_state_dict_pre_hook2, prepend=True)
    opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == 0.002  # prepended: hook1 runs after hook2, on the state dict it returned


@pytest.mark.parametrize("optim, case", supported_cases())
def test_load_state_dict_post_hook(optim, case, backend):
    opt = hook_subject(optim, case, backend)
    opt.register_load_state_dict_post_hook(load_state_dict_post_hook)
    opt.load_state_dict(opt.state_dict())
    assert not opt.state["ran_load_state_dict_pre_hook2"]  # a tensor with a tensor lr, as in torch.optim
    assert opt.state["ran_load_state_dict_post_hook"] is True


@pytest.mark.parametrize("optim, case", supported_cases())
def test_load_state_dict_pre_post_hook(optim, case, backend):
    opt = hook_subject(optim, case, backend)
    opt.register_load_state_dict_pre_hook(load_state_dict_pre_hook2)
    opt.register_load_state_dict_post_hook(load_state_dict_post_hook)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"]
    assert opt.state["ran_load_state_dict_post_hook"] is True


def step_hook_subject(optim, case, backend):
    """torch's step-hook tests step a tensor without requires_grad (and no gradient): nothing is stepped."""
    return make_ours(optim, [torch.tensor([1.0, 1.0])], backend, **case.make())


@pytest.mark.parametrize("register", ["register_step_post_hook", "register_step_pre_hook"])
@pytest.mark.parametrize("optim, case", supported_cases())
def test_step_hook(optim, case, backend, register):
    """torch's test_step_post_hook and test_step_pre_hook."""
    data = []
    opt = step_hook_subject(optim, case, backend)
    handle = getattr(opt, register)(lambda o, args, kwargs: data.append(2))
    opt.step()
    opt.step()
    assert data == [2, 2]
    handle.remove()
    opt.step()
    assert data == [2, 2]


@pytest.mark.parametrize("optim, case", supported_cases())
def test_step_all_hooks(optim, case, backend):
    data = []
    opt = step_hook_subject(optim, case, backend)
    other = torch.optim.SGD([nn.Parameter(torch.tensor([1.0, 1.0]))])
    handles = [
        register_optimizer_step_pre_hook(lambda o, args, kwargs: data.append(0)),
        register_optimizer_step_post_hook(lambda o, args, kwargs: data.append(5)),
    ]
    try:
        for o in (opt, other):
            handles.append(o.register_step_pre_hook(lambda o, args, kwargs: data.append(1)))
            handles.append(o.register_step_post_hook(lambda o, args, kwargs: data.append(2)))
        opt.step()
        assert data == [0, 1, 2, 5]
        other.step()
        assert data == [0, 1, 2, 5] * 2
        opt.step()
        assert data == [0, 1, 2, 5] * 3
    finally:
        for handle in handles:
            handle.remove()
    opt.step()
    other.step()
    assert data == [0, 1, 2, 5] * 3


# ---------------------------------------------------------------------------------------------- the rest
@pytest.mark.parametrize("optim, case", supported_cases())
def test_non_empty_state(optim, case, backend):
    """After a step, every state entry holds something, and the same keys as torch.optim's."""
    device = device_for(backend)
    torch.manual_seed(0)
    model = nn.Linear(5, 5).to(device)
    ref = copy.deepcopy(model)
    x = torch.rand(2, 5, generator=torch.Generator().manual_seed(0)).to(device)
    ours = make_ours(optim, list(model.parameters()), backend, **case.make())
    theirs = optim.theirs(ref.parameters(), **reference_kwargs(case.make(), device))
    for m, opt in ((model, ours), (ref, theirs)):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    for entry in ours.state.values():
        assert len(entry) > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert sorted(ours.state.get(p, {})) == sorted(theirs.state.get(q, {}))


@pytest.mark.xfail(
    strict=True,
    reason="known difference from torch.optim: flatopt's "
    "opt.state holds an entry (zeros, step 0) for every parameter from construction on; torch.optim's only "
    "for parameters it has stepped",
)
@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_state_holds_stepped_parameters_only(optim, backend):
    kwargs = {"momentum": 0.9} if optim.name == "SGD" else {}
    p, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    q, unused_ref = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    ours, theirs = make_ours(optim, [p, unused], backend, **kwargs), optim.theirs([q, unused_ref], **kwargs)
    assert len(ours.state) == len(theirs.state) == 0
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flatopt names the parameter without a gradient at the first step
        ours.step()
    theirs.step()
    assert (unused in ours.state) == (unused_ref in theirs.state) is False


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_frozen_parameter_with_a_grad_is_stepped(optim, backend):
    """Found by tests/test_property.py (kind "frozen_with_grad"): a layer frozen after training, its .grad zeroed
    (zero_grad(set_to_none=False)), then a new optimizer."""
    kwargs = dict(weight_decay=0.1) if optim.name == "AdamW" else dict(weight_decay=0.1, momentum=0.9)
    sides = []
    for make in (lambda ps: make_ours(optim, ps, backend, **kwargs), lambda ps: optim.theirs(ps, **kwargs)):
        frozen, trained = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
        frozen.requires_grad_(False)
        frozen.grad, trained.grad = torch.zeros(3), torch.ones(2)
        opt = make([frozen, trained])
        opt.step()
        sides.append((opt, frozen, trained))
    (ours, p, p2), (theirs, q, q2) = sides
    assert_matches(ours, theirs, [("frozen", p, q), ("trained", p2, q2)], "after one step")


def test_sgd_state_dict_keeps_momentum_buffers_while_momentum_is_off(backend):
    """Found by tests/test_property.py (kind "momentum_off")."""
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    ours = make_ours(OPTIMS["SGD"], [p], backend, lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    for param, opt in ((p, ours), (q, theirs)):
        param.grad = torch.ones(3)
        opt.step()
        opt.param_groups[0]["momentum"] = 0.0
        opt.step()
    assert state_keys(ours) == state_keys(theirs)


def test_sgd_state_dict_right_after_momentum_is_turned_on(backend):
    """Found by tests/test_property.py (kind "momentum_on_checkpoint")."""

    def make(cls, a, b, **options):
        groups = [{"params": [a], "momentum": 0.0}, {"params": [b]}]
        return cls(groups, lr=0.1, momentum=0.9, dampening=0.5, **options)

    params = [nn.Parameter(torch.ones(2)) for _ in range(4)]
    ours = make(flatopt.SGD, *params[:2], backend=backend, skip_unused=True)
    theirs = make(torch.optim.SGD, *params[2:])
    for opt, (a, b) in ((ours, params[:2]), (theirs, params[2:])):
        a.grad, b.grad = torch.ones(2), torch.ones(2)
        opt.step()
        opt.param_groups[0]["momentum"] = 0.9
    assert state_keys(ours) == state_keys(theirs)
    resumed = []
    for state_dict in (copy.deepcopy(ours.state_dict()), copy.deepcopy(theirs.state_dict())):
        a, b = nn.Parameter(params[2].detach().clone()), nn.Parameter(params[3].detach().clone())
        opt = make(torch.optim.SGD, a, b)
        opt.load_state_dict(state_dict)
        a.grad, b.grad = torch.ones(2), torch.ones(2)
        opt.step()
        resumed.append(a.detach())
    torch.testing.assert_close(resumed[0], resumed[1], msg="torch.optim resumed from flatopt's checkpoint")


def assert_state_dicts_match(ours, theirs, where):
    """``state_dict()['state']`` of ``ours`` against ``theirs``: the same parameters, keys and values."""
    mine, ref = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert state_keys(ours) == state_keys(theirs), f"{where}: state_dict keys {state_keys(ours)}, {state_keys(theirs)}"
    for k, entry in ref.items():
        for key, value in entry.items():
            where_key = f"{where}, {k}.{key}"
            torch.testing.assert_close(mine[k][key], value, **TOL[torch.float32], msg=lambda m: f"{where_key}: {m}")


def step_and_compare(ours, theirs, pairs, where):
    """One step of both optimizers, then their parameters (``pairs``: (name, ours, theirs)) and state dicts."""
    ours.step()
    theirs.step()
    assert_matches(ours, theirs, pairs, where)
    assert_state_dicts_match(ours, theirs, where)


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_sgd_parameter_first_stepped_while_momentum_is_off_starts_its_buffer_when_it_comes_back(backend, dampening):
    """torch.optim.SGD gives a parameter a momentum buffer at its first step with momentum: one that received no
    gradient before momentum was switched off, and was stepped during the stretch of momentum=0, has none then
    (state_dict() exports no state for it), and the step that follows momentum's return sets buf = d. Its group's
    other parameter, whose buffer started, goes on from it (buf = momentum * buf + (1 - dampening) * d)."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(5, generator=gen), torch.randn(7, generator=gen)
    a, b, a2, b2 = (nn.Parameter(t.clone().to(device)) for t in (a0, b0, a0, b0))
    kwargs = dict(lr=0.1, momentum=0.9, dampening=dampening)
    ours = make_ours(OPTIMS["SGD"], [a, b], backend, **kwargs)
    theirs = torch.optim.SGD([a2, b2], foreach=False, **kwargs)
    schedule = {1: 0.0, 3: 0.9, 5: 0.0, 7: 0.9}  # step -> momentum, set before that step
    for step in range(9):
        if step in schedule:
            ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = schedule[step]
        ga, gb = torch.randn(5, generator=gen).to(device), torch.randn(7, generator=gen).to(device)
        a.grad, a2.grad = ga.clone(), ga.clone()
        b.grad, b2.grad = (gb.clone(), gb.clone()) if step else (None, None)  # b: no gradient at the first step
        step_and_compare(ours, theirs, [("a", a, a2), ("b", b, b2)], f"step {step}")


@pytest.mark.parametrize("saved_by", ["torch", "flatopt"])
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["built_without_momentum", "built_with_momentum"])
def test_sgd_load_keeps_momentum_buffers_saved_while_momentum_is_off(backend, saved_by, momentum):
    """A checkpoint saved during a stretch of momentum=0 holds the momentum buffers (torch.optim keeps them, and so
    does flatopt): loading it keeps them, whatever momentum the loading optimizer was created with; state_dict()
    exports them again right after the load, and the step after momentum's return goes on from them."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(6, generator=gen)
    src = nn.Parameter(p0.clone().to(device))
    make_src = torch.optim.SGD if saved_by == "torch" else flatopt.SGD
    saver = make_src([src], lr=0.1, momentum=0.9, dampening=0.3)
    for step in range(4):
        if step == 3:
            saver.param_groups[0]["momentum"] = 0.0
        src.grad = torch.randn(6, generator=gen).to(device)
        saver.step()
    saved = copy.deepcopy(saver.state_dict())
    assert sorted(saved["state"][0]) == ["momentum_buffer"] and saved["param_groups"][0]["momentum"] == 0.0
    p, q = nn.Parameter(src.detach().clone()), nn.Parameter(src.detach().clone())
    ours = make_ours(OPTIMS["SGD"], [p], backend, lr=0.1, momentum=momentum)
    theirs = torch.optim.SGD([q], lr=0.1, momentum=momentum, foreach=False)
    ours.load_state_dict(copy.deepcopy(saved))
    theirs.load_state_dict(copy.deepcopy(saved))
    assert_matches(ours, theirs, [("p", p, q)], "right after the load")
    assert_state_dicts_match(ours, theirs, "right after the load")
    for step in range(4):
        if step == 1:
            ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.9
        g = torch.randn(6, generator=gen).to(device)
        p.grad, q.grad = g.clone(), g.clone()
        step_and_compare(ours, theirs, [("p", p, q)], f"step {step} after the load")


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["never_on", "switched_off"])
def test_sgd_momentum_buffer_assigned_while_momentum_is_off_is_used(backend, momentum):
    """``opt.state[p]["momentum_buffer"] = t`` while the group's momentum is 0: torch.optim keeps ``t`` (its
    state_dict() exports it) and its first step with momentum goes on from it."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(4, generator=gen)
    p, q = nn.Parameter(p0.clone().to(device)), nn.Parameter(p0.clone().to(device))
    ours = make_ours(OPTIMS["SGD"], [p], backend, lr=0.1, momentum=momentum, dampening=0.2)
    theirs = torch.optim.SGD([q], lr=0.1, momentum=momentum, dampening=0.2, foreach=False)
    for step in range(5):
        if step == 1:
            ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.0
        if step == 2:
            buf = torch.linspace(-1.0, 5.0, 4, device=device)
            ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"] = buf.clone(), buf.clone()
            assert_state_dicts_match(ours, theirs, "right after the assignment")
        if step == 3:
            ours.param_groups[0]["momentum"] = theirs.param_groups[0]["momentum"] = 0.9
        g = torch.randn(4, generator=gen).to(device)
        p.grad, q.grad = g.clone(), g.clone()
        step_and_compare(ours, theirs, [("p", p, q)], f"step {step}")


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_deepcopy_refused(optim, backend):
    """torch's test_deepcopy_copies_all_public_attrs: flatopt refuses copies (its tensors are views of buffers
    shared with the model) and says to save state_dict() instead."""
    p = nn.Parameter(torch.randn(2, 3))
    p.grad = torch.rand(2, 3)
    opt = make_ours(optim, [p], backend)
    opt.step()
    with pytest.raises(TypeError, match=r"cannot be pickled or copied.*Save opt\.state_dict\(\)"):
        copy.deepcopy(opt)


@pytest.mark.parametrize("optim, case", supported_cases())
def test_complex_refused_and_view_as_real_matches(optim, case, backend):
    """torch's test_complex: flatopt refuses complex parameters and says to optimize view_as_real(p); doing so
    steps as torch.optim steps the complex parameters (beside a real one)."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(6)
    complex_params = [
        torch.randn(10, 5, dtype=torch.complex64, generator=gen).requires_grad_(),
        torch.randn(10, dtype=torch.complex64, generator=gen).requires_grad_(),
        torch.randn(10, 5, generator=gen).requires_grad_(),
    ]
    with pytest.raises(ValueError, match=r"does not support complex parameters.*torch\.view_as_real\(p\)"):
        optim.ours(complex_params, backend=backend, skip_unused=True)
    complex_params = [p.to(device).detach().requires_grad_() for p in complex_params]
    real_params = [
        (torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_() for p in complex_params
    ]
    ours = make_ours(optim, real_params, backend, **case.make())
    theirs = optim.theirs(complex_params, **reference_kwargs(case.make(), device))
    for step in range(3):
        for r, c in zip(real_params, complex_params):
            g = torch.randn(r.shape, generator=gen).to(device)
            r.grad = g.clone()
            c.grad = torch.view_as_complex(g.clone()) if c.is_complex() else g.clone()
        ours.step()
        theirs.step()
        for i, (r, c) in enumerate(zip(real_params, complex_params)):
            expected = torch.view_as_real(c.detach()) if c.is_complex() else c.detach()
            torch.testing.assert_close(
                r.detach(), expected, **TOL[torch.float32], msg=lambda m: f"step {step}, params[{i}]: {m}"
            )


def test_sparse_gradient_refused(backend):
    """torch's test_rosenbrock_sparse (SGD takes sparse gradients in torch): flatopt refuses a sparse .grad at the
    step, says where it comes from, and changes nothing."""
    p = nn.Parameter(torch.tensor([1.5, 1.5]))
    opt = flatopt.SGD([p], lr=4.8e-3, backend=backend, skip_unused=True)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([0.5, 1.5]), (2,), check_invariants=True)
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients.*sparse=False"):
        opt.step()
    assert torch.equal(p.detach(), torch.tensor([1.5, 1.5]))
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("optim", OPTIMS.values(), ids=lambda o: o.name)
def test_meta_parameters_refused(optim, backend):
    """torch's test_fused_error_on_params_on_meta: torch's fused optimizers fail at the step on meta parameters;
    flatopt, which copies the parameters into its buffers, at construction, saying to materialise the model first.
    Materialised, the model trains."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid())
    with pytest.raises(ValueError, match=r"meta device has no data; materialise the model first"):
        optim.ours(model.parameters(), fused=True, backend=backend, skip_unused=True)
    model.to_empty(device=device_for(backend))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    opt = optim.ours(model.parameters(), fused=True, backend=backend, skip_unused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.all(p < 0.5) for p in model.parameters())


@pytest.mark.parametrize("no_grad_scale", [False, True], ids=["grad_scale", "no-grad_scale"])
@pytest.mark.parametrize("optim, case", supported_cases())
def test_found_inf_skips_the_step(optim, case, no_grad_scale, backend):
    """torch's test_fused_does_not_step_if_foundinf: with ``found_inf`` set nothing moves and no step is counted;
    the next step is then the first, as torch.optim's (whose own step a GradScaler skips) without the skipped one.
    (torch's fused optimizers on the CPU make state at the skipped step: AdamW a step count of 0 and zero moments,
    which flatopt's state dict leaves out, and SGD an uninitialised momentum buffer, torch 2.13.)"""
    device = device_for(backend)
    sides = [[torch.ones(1, device=device, requires_grad=True) for _ in range(5)] for _ in range(2)]
    ours = make_ours(optim, sides[0], backend, **case.make(fused=True))
    theirs = optim.theirs(sides[1], **reference_kwargs(case.make(), device))
    for p in sides[0]:
        p.grad = torch.ones_like(p)
    ours.grad_scale = None if no_grad_scale else torch.ones(1, device=device)
    ours.found_inf = torch.ones((), device=device)
    ours.step()
    for p in sides[0]:
        assert torch.equal(p.detach(), torch.ones(1, device=device))
        if "step" in ours.state.get(p, {}):
            assert float(ours.state[p]["step"]) == 0
    ours.found_inf = torch.zeros((), device=device)
    for ps, opt in ((sides[0], ours), (sides[1], theirs)):
        for i, p in enumerate(ps):
            p.grad = torch.full_like(p, 0.5 + i)
        opt.step()
    assert_matches(ours, theirs, pairs_of(*sides), "after a step with found_inf and one without")
