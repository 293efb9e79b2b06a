"""Every kernel compiles for a real GPU (sm_90), ahead of time, on a machine without one.

The Triton interpreter runs kernel code that the compiler would reject (it accepted module-level
``X: tl.constexpr = 0`` globals, which Triton's compiler refuses), so CPU-only CI also compiles
each kernel, in its main variants, for an H100 target."""

import inspect
import json

import pytest
import triton
from conftest import json_lines_without_interpreter

from flatopt.kernels.adamw import NUM_HPARAMS as ADAMW_HP
from flatopt.kernels.adamw import adamw_kernel
from flatopt.kernels.common import BLOCK_SIZE, GRANULE, NUM_WARPS, STEP_BLOCK
from flatopt.kernels.lion import NUM_HPARAMS as LION_HP
from flatopt.kernels.lion import lion_kernel
from flatopt.kernels.sgd import NUM_HPARAMS as SGD_HP
from flatopt.kernels.sgd import sgd_kernel

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - very old triton
    GPUTarget = ASTSource = None

KERNELS = {"adamw": (adamw_kernel, ADAMW_HP), "sgd": (sgd_kernel, SGD_HP), "lion": (lion_kernel, LION_HP)}
INT_POINTERS = {
    "param_of_granule_ptr": "*i32", "param_group_ptr": "*i32", "counter_ptr": "*i32", "active_ptr": "*u8",
    "src_ptr": "*i64", "start_ptr": "*i64", "numel_ptr": "*i64",
}  # fmt: skip
F32_POINTERS = {"hp_ptr", "step_ptr", "grad_scale_ptr", "found_inf_ptr"}
DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


STATE_POINTERS = {"m_ptr", "v_ptr", "buf_ptr"}
MASTER_POINTER = {0: "*fp32", 1: "*fp32", 2: "*i16"}  # w_ptr: unused (0), float32 master (1), int16 remainders (2)


def compile_for_sm90(
    kernel, num_hp, dtype, uniform, flags, gather=0, master=0, stochastic=False, state_dtype=None, gather_store=True
):
    fn = getattr(kernel, "fn", kernel)  # the interpreter wraps the function
    names = list(inspect.signature(fn).parameters)
    constexprs = dict(
        NUM_HP=num_hp, GRANULE=GRANULE, UNIFORM=uniform, BLOCK_SIZE=BLOCK_SIZE, STEP_BLOCK=STEP_BLOCK,
        HAS_ACTIVE=flags, HAS_GRAD_SCALE=flags, HAS_FOUND_INF=flags, HAS_MOMENTUM=True, GATHER=gather,
        GATHER_STORE=gather_store, MASTER=master, STOCHASTIC=stochastic, QUANT=state_dtype == "int8",
    )  # fmt: skip
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = INT_POINTERS[name]
        elif name in F32_POINTERS:
            signature[name] = "*fp32"
        elif name == "w_ptr":
            signature[name] = MASTER_POINTER[master]
        elif name in STATE_POINTERS and state_dtype == "int8":
            signature[name] = "*u8" if name == "v_ptr" else "*i8"  # AdamW's second moment has unsigned codes
        elif name.endswith("_scale_ptr"):
            signature[name] = "*fp32"
        elif name in STATE_POINTERS and state_dtype is not None:
            signature[name] = DTYPES[state_dtype]
        elif name.endswith("_ptr"):
            signature[name] = DTYPES[dtype]
        else:
            signature[name] = "i64"
    # what the JIT specialises on in a real launch: 16-byte aligned buffers, a length divisible by 16
    aligned = [
        i for i, n in enumerate(names) if signature[n] != "constexpr" and (n.endswith("_ptr") or n == "n_elements")
    ]
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items() if k in names},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))


# (dtype, UNIFORM, HAS_ACTIVE/GRAD_SCALE/FOUND_INF, GATHER: 0, or the gathered loads' width)
VARIANTS = [
    ("fp32", True, False, 0), ("bf16", False, True, 0), ("fp16", False, False, 0),
    ("fp32", True, False, 1), ("fp32", True, False, 4), ("bf16", False, True, 8), ("fp16", False, False, 1),
]  # fmt: skip


# storage variants (flatopt.precision): (dtype, UNIFORM, flags, GATHER, MASTER, STOCHASTIC, the states' dtype)
PRECISION_VARIANTS = [
    ("bf16", True, False, 0, 1, False, None), ("bf16", False, True, 8, 2, False, "fp32"),
    ("bf16", False, True, 0, 0, True, "bf16"), ("fp16", True, True, 0, 1, False, "fp32"),
    ("fp32", True, False, 0, 0, False, "bf16"), ("bf16", False, True, 0, 0, True, "int8"),
    ("bf16", True, False, 8, 2, False, "int8"), ("fp32", False, True, 0, 0, False, "int8"),
]  # fmt: skip


# gathering launches that store nothing into the flat gradient buffer (GATHER_STORE off): sources built with
# store=False, the gradients read where autograd left them (with GradScaler's flags: unscaled back there)
NO_STORE_VARIANTS = [("fp32", True, False, 4), ("bf16", False, True, 8)]


def main():
    """Compile every kernel in every variant; print one JSON line per result (a variant that stores no gathered
    gradient ends with "no-store")."""
    runs = [(v, {}) for v in VARIANTS + PRECISION_VARIANTS] + [(v, dict(gather_store=False)) for v in NO_STORE_VARIANTS]
    for name, (kernel, num_hp) in KERNELS.items():
        for variant, kw in runs:
            try:
                ptx = compile_for_sm90(kernel, num_hp, *variant, **kw).asm["ptx"]
                ok, detail = f".entry {name}_kernel" in ptx, f"{len(ptx)} bytes of PTX"
                wide, stores = ptx.count("ld.global.v4.b32"), ptx.count("st.global")  # 16-byte loads; stores
            except Exception as e:  # reported by the test, with the compiler's message
                ok, detail, wide, stores = False, f"{type(e).__name__}: {e}", None, None
            tag = ["no-store"] if kw else []
            print(json.dumps(dict(name=name, variant=[*variant, *tag], ok=ok, detail=detail, wide_loads=wide,
                                  stores=stores)))  # fmt: skip


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
def test_every_kernel_compiles_for_sm90():
    results, run = json_lines_without_interpreter("test_compile", "main")
    variants = len(VARIANTS) + len(PRECISION_VARIANTS) + len(NO_STORE_VARIANTS)
    assert len(results) == len(KERNELS) * variants, run.stdout + run.stderr[-4000:]
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['name']} {r['variant']}: {r['detail']}" for r in failed)
    # a launch that gathers its gradients, when their sizes allow (GATHER > 1), loads them 16 bytes at a time, as
    # the flat buffer's gradient is loaded: as many 16-byte loads as the same variant without GATHER
    wide = {(r["name"], *r["variant"]): r["wide_loads"] for r in results}
    for name, dtype, uniform, flags, gather, *precision in wide:
        if gather > 1 and not precision:
            plain = wide[(name, dtype, uniform, flags, 0)]
            assert plain > 0 and wide[(name, dtype, uniform, flags, gather)] == plain, (name, dtype, gather, wide)
    # storing none: the same 16-byte loads, and without GradScaler's flags fewer global stores than the launch that
    # stores the gathered gradients into the flat buffer; with them as many (the store into the buffer becomes the
    # write-back of the unscaled gradient where it was read)
    stores = {(r["name"], *r["variant"]): r["stores"] for r in results}
    for name in KERNELS:
        for variant in NO_STORE_VARIANTS:
            key, mine = (name, *variant), (name, *variant, "no-store")
            assert wide[mine] == wide[key], (mine, wide[mine], wide[key])
            flags = variant[2]
            assert stores[mine] < stores[key] if not flags else stores[mine] == stores[key], (mine, stores, key)
