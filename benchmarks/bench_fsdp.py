"""Question: on one GPU, under FSDP2 (``fully_shard`` on every block and on the root), how long does flatopt.AdamW's
optimizer work take against torch.optim.AdamW(fused=True) on the same shards, in step mode and in in-backward mode,
and how much lower is in-backward mode's peak memory than step mode's?

Model: bench_capture.py's GPT-2 small (12 layers, d=768, 12 heads, vocab 50257, 512 positions, head tied to the token
embedding: 124,046,592 parameters in 148 tensors), batch 8 x 512 tokens on every rank (each rank its own batches),
float32 parameters. Sharding: ``fully_shard`` on each block, then on the root (embeddings and final LayerNorm), over
a 1-D mesh of all the ranks, with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``,
torchtitan's default: bf16 all-gathers and compute, fp32 reduce-scatters, fp32 sharded parameters, gradients and
optimizer states. The GPT's own bf16 autocast stays on in its forward, as in bench_capture.py (under it layer norms
run in fp32; the loss is computed in fp32).

Cases, each on a fresh sharded model built from the same seed and trained on the same batches; every training step is
zero_grad(), forward, backward, step():

    fwd-bwd               forward + backward only, no optimizer (the gradients set to None before each forward)
    torch-fused           torch.optim.AdamW(fused=True) over the FSDP2 model's DTensor parameters
    flatopt               flatopt.AdamW(model), step mode
    flatopt-in-backward   flatopt.AdamW(model, in_backward=True): each fully_shard group stepped during backward, once
                          FSDP2 has reduce-scattered its gradients, which are then freed

Ranks: ``--ranks N`` processes (torch.multiprocessing, spawn; a FileStore, no port), NCCL on CUDA and gloo on the CPU
(``--backend`` chooses), every rank on the one device ``--device`` names: with N > 1 the ranks share it.
``--ranks 1,2`` runs a group of one rank, then a group of two. Whether each group ran is recorded under "worlds"
(status, and the reason when it did not: NCCL refuses two ranks on one GPU in the versions that detect it).

Two phases in each group, as in bench_eager.py; every time is the slowest rank's:

* Alone: each case on its own. Peak memory per rank (``torch.cuda.max_memory_allocated`` over the timed steps, its
  statistics reset after the warm-up, minus what was allocated before the model was built), the memory held after a
  step, the bytes of the local gradient shards left after a step (``p.grad.to_local()``: the sharded gradients; none
  in in-backward mode), the synchronised training-step time (harness.time_steps), and **the optimizer time in step
  mode**: CUDA events recorded right before and right after ``opt.step()`` in every timed step, whose elapsed time is
  the device's from reaching the first event to reaching the second, so that the host time the device waits for
  counts (torch's fused step over DTensors costs host time per parameter).
* Paired: the four cases built side by side and timed alternately, round by round (harness.time_paired, one
  synchronised step per turn, the same order on every rank). **A case's added time** is the median over rounds of
  its step minus the fwd-bwd step of the same round: what the optimizer adds to forward + backward, overlap included.
  It is **the optimizer time of in-backward mode** (its launches run between backward's kernels and FSDP2's
  reduce-scatters, where no event pair can isolate them), and is given for the step-mode cases too, comparable.

Every rank runs the same number of steps (no --min-time-s: a rank that decided alone to time more steps would wait
in a collective the others never join).

flatopt's targets, per group of ranks (reported with margins, not asserted):

    flatopt step() / torch-fused step() <= 0.5x (the events around step(), medians)
    flatopt-in-backward added time / torch-fused added time <= 0.5x (paired)
    flatopt-in-backward peak <= flatopt step-mode peak - its sharded gradient bytes (per rank; the rank with the
    smallest margin is reported)

GPU run from the repository root (one rank, then two ranks sharing the GPU; its time on a GPU has not been measured
yet, and --budget-s, default 300 s, skips what would start after it):

    PYTHONPATH=. python3 benchmarks/bench_fsdp.py --ranks 1,2 [--json PATH] [--markdown PATH]

CPU smoke run (two gloo ranks, a tiny GPT; checks the code path, measures nothing):

    PYTHONPATH=. python3 benchmarks/bench_fsdp.py --device cpu --smoke --out /tmp/flatopt-smoke

Markdown tables of a stored result: ``python3 benchmarks/bench_fsdp.py --report RESULT.json``.
"""

import argparse
import faulthandler
import json
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch

import flatopt
from benchmarks import bench_capture, bench_eager, harness
from benchmarks.harness import num

HPARAMS = bench_capture.HPARAMS
FULL = bench_capture.MODELS["gpt2"]
SMOKE = bench_capture.SMOKE_MODELS["gpt2"]
CASES = {
    "fwd-bwd": "forward + backward only, no optimizer: the gradients set to None before each forward",
    "torch-fused": "torch.optim.AdamW(fused=True) over the FSDP2 model's DTensor parameters",
    "flatopt": "flatopt.AdamW(model), step mode",
    "flatopt-in-backward": "flatopt.AdamW(model, in_backward=True): each fully_shard group stepped in backward",
}
BASELINE, REFERENCE, MINE, MINE_IN_BACKWARD = "fwd-bwd", "torch-fused", "flatopt", "flatopt-in-backward"
OURS = (MINE, MINE_IN_BACKWARD)
SHARDING = "fully_shard on each block, then on the root, over a 1-D mesh of all the ranks"
PRECISION = (
    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32): bf16 all-gathers and compute, fp32 "
    "reduce-scatters, fp32 sharded parameters, gradients and states; and the GPT's own bf16 autocast in its forward"
)
TARGET_OPTIMIZER_RATIO = 0.5  # flatopt's optimizer time / torch-fused's, step mode and in-backward mode
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank waiting longer for the others raises (gloo) or is aborted (NCCL)
KILL_GRACE_S = 20  # once a rank has stopped with an error, the others get this long before they are terminated
KILL_MARGIN_S = 60  # a group of ranks still running this long after the budget is spent is killed
GIB = 2**30


# ---------------------------------------------------------------------------------------------- the ranks
class Stopwatch:
    """Times each call of ``fn`` made through it, where the training step makes it: CUDA events recorded right before
    and right after the call (the device's time from reaching the first to reaching the second), ``perf_counter`` on
    the CPU. ``times()`` synchronises and returns the milliseconds of the calls since ``clear()``."""

    def __init__(self, device):
        self.device, self.cuda, self.marks = device, harness.is_cuda(device), []

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.marks.append((start, end))
        else:
            t = time.perf_counter()
            fn()
            self.marks.append((time.perf_counter() - t) * 1e3)

    def times(self):
        harness.sync(self.device)
        return [s.elapsed_time(e) for s, e in self.marks] if self.cuda else list(self.marks)

    def clear(self):
        self.marks = []


def sharded_model(cfg, mesh, device, seed):
    """bench_capture.py's GPT (``cfg``) from ``seed``, with fully_shard on each block and on the root (SHARDING,
    PRECISION)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = bench_capture.make_model(cfg, device, seed)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build(case, model, watch=None):
    """``case`` over the sharded ``model``: (optimizer or None, step(x, y) -> loss). ``watch`` (a Stopwatch), when
    given, times each ``opt.step()``."""
    if case == BASELINE:
        opt = None
    elif case == REFERENCE:
        opt = torch.optim.AdamW(model.parameters(), **HPARAMS, fused=True)
    elif case in OURS:
        opt = flatopt.AdamW(model, **HPARAMS, in_backward=case == MINE_IN_BACKWARD)
    else:
        raise ValueError(f"unknown case {case!r}; expected one of {', '.join(CASES)}")

    def step(x, y):
        (opt or model).zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if opt is not None:
            (watch or (lambda fn: fn()))(opt.step)
        return loss

    return opt, step


def grad_shard_bytes(model):
    """Bytes of the local gradient shards in ``.grad`` (each DTensor's local tensor)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return sum(g.numel() * g.element_size() for g in local)


def run_alone(case, cfg, mesh, device, args, rank):
    """One case on its own fresh sharded model: peak and held memory, sharded gradient bytes, synchronised step time
    and (step mode) the time of opt.step() in each timed step. Never raises; the row says how it went."""
    row = dict(case=case, ours=case in OURS, status=None)

    def body(row):
        cuda = device.type == "cuda"
        harness.free_memory(device)
        base = harness.allocated(device)
        model = sharded_model(cfg, mesh, device, args.seed)
        batches = bench_capture.make_batches(cfg, device, args.seed + 1000 * rank)
        watch = Stopwatch(device)
        opt, step = build(case, model, watch)
        last = [None]
        one = bench_eager.cycling(step, batches, last)
        for _ in range(args.warmup):
            one()
        harness.sync(device)
        row["grad_shard_bytes"] = grad_shard_bytes(model)  # what the last step left in .grad
        if cuda:
            row["warmup_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
            row["held_bytes"] = harness.allocated(device) - base
            torch.cuda.reset_peak_memory_stats(device)
        watch.clear()
        times = harness.time_steps(one, device, args.iters)
        if cuda:
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row.update(harness.timing_fields(times), iters=len(times))
        if opt is not None:
            row.update(harness.timing_fields(watch.times(), "step_"))
        row["final_loss"] = last[0].item()
        del opt, model

    return harness.run_guarded(row, device, body)


def run_paired(cases, cfg, mesh, device, args, rank):
    """Every case on its own fresh sharded model, side by side; after the warm-up, one synchronised step of each per
    round, for ``args.iters`` rounds (harness.time_paired). Keeps each round's milliseconds. Never raises."""
    row = dict(cases=list(cases), status=None)

    def body(row):
        steps, keep = {}, []
        for case in cases:
            model = sharded_model(cfg, mesh, device, args.seed)
            opt, step = build(case, model)
            steps[case] = bench_eager.cycling(step, bench_capture.make_batches(cfg, device, args.seed + 1000 * rank))
            keep.append((model, opt))
        for one in steps.values():
            for _ in range(args.warmup):
                one()
        timed = harness.time_paired(steps, device, args.iters)
        row["round_ms"] = {case: timed[case][0] for case in cases}
        row["rounds"] = args.iters
        del keep

    return harness.run_guarded(row, device, body)


def rank_device(name):
    """The device every rank uses: ``name``, index 0 when it has none (one GPU shared by the ranks)."""
    device = torch.device(name)
    return torch.device("cuda", device.index or 0) if device.type == "cuda" else device


def agreed(flag, device):
    """True on every rank when ``flag`` is true on any (one all-reduce): the ranks take decisions together, or a rank
    would wait in a collective the others never join."""
    import torch.distributed as dist

    t = torch.tensor([int(bool(flag))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def rank_main(rank, world, args, store, out_dir):
    """One rank: every case alone, then paired; its results go to ``out_dir/rank<r>.json`` after each case. A case
    that failed stops the rank (another rank may be waiting in that case's collectives), and the rank exits with an
    error, so that the others are stopped too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    faulthandler.enable()  # a crash prints where each thread was
    path = Path(out_dir) / f"rank{rank}.json"
    out = dict(rank=rank, status="running", results=[], paired=None)
    device = rank_device(args.device)
    cfg = SMOKE if args.smoke else FULL
    with harness.cpu_threads(device):
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            kw = dict(device_id=device) if device.type == "cuda" else {}  # NCCL starts now: a refusal shows here
            dist.init_process_group(args.backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                    timeout=COLLECTIVE_TIMEOUT, **kw)  # fmt: skip
            try:
                mesh = init_device_mesh(device.type, (world,))
                agreed(False, device)  # the first collective: a backend that cannot run these ranks fails here
                out["device_name"] = harness.environment(device)["device_name"]
                for case in args.cases:
                    if agreed(time.time() > args.deadline, device):
                        row = harness.budget_spent(dict(case=case, ours=case in OURS, seconds=0.0), args)
                    else:
                        row = run_alone(case, cfg, mesh, device, args, rank)
                    out["results"].append(row)
                    harness.write_json(path, out)
                    if row["status"] in ("failed", "oom"):
                        raise RuntimeError(f"case {case} {row['status']}: {row.get('reason')}")
                if args.paired and not agreed(time.time() > args.deadline, device):
                    out["paired"] = run_paired(args.cases, cfg, mesh, device, args, rank)
                    if out["paired"]["status"] in ("failed", "oom"):
                        raise RuntimeError(f"paired timing {out['paired']['status']}: {out['paired'].get('reason')}")
                out["status"] = "ok"
            finally:
                dist.destroy_process_group()
        except BaseException as e:
            out.update(status="failed", **harness.error_fields(e))
            raise
        finally:
            harness.write_json(path, out)


# ---------------------------------------------------------------------------------------------- the groups
@contextmanager
def repo_on_path():
    """The repository root on sys.path while processes are started: a spawned process imports ``benchmarks`` with
    the parent's sys.path."""
    root = str(harness.REPO)
    added = root not in sys.path
    if added:
        sys.path.append(root)
    try:
        yield
    finally:
        if added:
            sys.path.remove(root)


@contextmanager
def stopped_by_sigterm():
    """SIGTERM (``timeout`` stopping the run) raises SystemExit in this process, so that run_world kills the ranks on
    the way out instead of leaving them on the device."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def read_ranks(out_dir, world):
    """Every rank's file (None for a rank that wrote none)."""
    out = []
    for rank in range(world):
        path = Path(out_dir) / f"rank{rank}.json"
        out.append(json.loads(path.read_text()) if path.exists() else None)
    return out


def run_world(world, args, seconds):
    """Start ``world`` ranks and wait for them: at most ``seconds`` (the budget left; the ranks skip cases after it)
    plus KILL_MARGIN_S. Returns (the group's record, every rank's output or None)."""
    import torch.multiprocessing as mp

    t0 = time.monotonic()
    info = dict(ranks=world, backend=args.backend, device=str(rank_device(args.device)), shared_device=world > 1)
    with tempfile.TemporaryDirectory(prefix="flatopt-fsdp-") as tmp:
        rank_args = argparse.Namespace(**vars(args), deadline=time.time() + seconds)
        with repo_on_path():
            ctx = mp.start_processes(rank_main, args=(world, rank_args, str(Path(tmp) / "store"), tmp), nprocs=world,
                                     join=False, start_method="spawn")  # fmt: skip
        why = None
        try:
            while not ctx.join(timeout=1.0, grace_period=KILL_GRACE_S):
                if time.monotonic() - t0 > seconds + KILL_MARGIN_S:
                    why = f"the ranks did not finish within {seconds + KILL_MARGIN_S:.0f} s and were killed"
                    break
        except Exception as e:  # a rank exited with an error; torch stopped the others
            why = f"{type(e).__name__}: {harness.first_line(str(e), 300)}"
        finally:  # also on SystemExit (stopped_by_sigterm) and KeyboardInterrupt
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        ranks = read_ranks(tmp, world)
    errors = [f"rank {r['rank']}: {r.get('reason')}" for r in ranks if r is not None and r.get("status") == "failed"]
    missing = [str(i) for i, r in enumerate(ranks) if r is None]
    if missing:
        errors.append(f"rank(s) {', '.join(missing)} wrote nothing")
    if why is None and not errors and all(r["status"] == "ok" for r in ranks):
        info["status"] = "ok"
    else:
        info.update(status="failed", reason="; ".join(errors) or why or "a rank did not finish")
    names = {r.get("device_name") for r in ranks if r and r.get("device_name")}
    info["device_name"] = names.pop() if len(names) == 1 else None
    info["seconds"] = round(time.monotonic() - t0, 1)
    return info, ranks


def case_row(rank_output, i):
    """A rank's row of its ``i``-th case, or None (the rank wrote nothing, or stopped before that case)."""
    rows = (rank_output or {}).get("results") or []
    return rows[i] if i < len(rows) else None


def combine(case, world, rows, info):
    """One row for ``case`` from every rank's row (None where a rank has none): the status (the first rank's that is
    not "ok"), the slowest rank's timings, the largest memory figures, and every rank's row under "per_rank"."""
    row = dict(ranks=world, case=case, ours=case in OURS)
    bad = next((r for r in rows if r is not None and r["status"] != "ok"), None)
    if bad is None and any(r is None for r in rows):
        why = info.get("reason") or "the ranks stopped before it"
        return dict(row, status="skipped", reason=f"not run: {why}", seconds=0.0)
    row["status"] = bad["status"] if bad else "ok"
    if bad:
        row["reason"] = f"rank {rows.index(bad)}: {bad.get('reason')}"
    else:
        for prefix in ("", "step_"):
            key = f"{prefix}median_ms"
            if key in rows[0]:
                slow = max(rows, key=lambda r: r[key])
                row.update({f"{prefix}{q}": slow[f"{prefix}{q}"] for q in ("median_ms", "q20_ms", "q80_ms")})
        for key in ("peak_bytes", "warmup_peak_bytes", "held_bytes", "grad_shard_bytes"):
            if all(key in r for r in rows):
                row[key] = max(r[key] for r in rows)
        row.update(iters=rows[0]["iters"], final_loss=rows[0]["final_loss"])
    row["seconds"] = max((r or {}).get("seconds", 0.0) for r in rows)
    row["per_rank"] = rows
    return row


def combine_paired(world, paired, info):
    """The group's paired timing: each round's time is the slowest rank's; per case its quantiles and, against fwd-bwd,
    the quantiles of the per-round differences (``added``)."""
    out = dict(ranks=world)
    if any(p is None for p in paired):
        return dict(out, status="skipped", reason=f"not run: {info.get('reason') or 'the ranks stopped before it'}")
    bad = next((p for p in paired if p["status"] != "ok"), None)
    if bad:
        return dict(out, status=bad["status"], reason=f"rank {paired.index(bad)}: {bad.get('reason')}")
    cases = paired[0]["cases"]
    rounds = {c: [max(ms) for ms in zip(*(p["round_ms"][c] for p in paired), strict=True)] for c in cases}
    out.update(status="ok", cases=cases, rounds=paired[0]["rounds"], round_ms=rounds)
    for c in cases:
        out[c] = harness.timing_fields(rounds[c])
    if BASELINE in cases:
        base = rounds[BASELINE]
        out["added"] = {c: harness.timing_fields([a - b for a, b in zip(rounds[c], base, strict=True)])
                        for c in cases if c != BASELINE}  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------- targets
def _needs(row, key, what):
    """Why ``row`` has no ``key``: not run, its status, or ``what`` it takes."""
    if row is None or row["status"] != "ok":
        return harness.why_not(row)
    return None if row.get(key) is not None else what


def peak_target(world, rows):
    """flatopt-in-backward's peak against flatopt step mode's peak minus its sharded gradients, rank by rank; the rank
    with the smallest margin. (value, threshold, why not) in GiB."""
    ib, st = rows.get(MINE_IN_BACKWARD), rows.get(MINE)
    why = _needs(ib, "peak_bytes", "peak memory is torch.cuda.max_memory_allocated, on a CUDA device") or _needs(
        st, "peak_bytes", "peak memory is torch.cuda.max_memory_allocated, on a CUDA device")  # fmt: skip
    if why:
        return None, None, why
    pairs = [(a["peak_bytes"], b["peak_bytes"] - b["grad_shard_bytes"]) for a, b in
             zip(ib["per_rank"], st["per_rank"], strict=True)]  # fmt: skip
    value, threshold = min(pairs, key=lambda vt: vt[1] - vt[0])
    return value / GIB, threshold / GIB, None


def evaluate_targets(record):
    """flatopt's targets in every group of ranks (see the module docstring)."""
    out = []
    r = TARGET_OPTIMIZER_RATIO
    for info in record["worlds"]:
        world = info["ranks"]
        rows = {row["case"]: row for row in record["results"] if row["ranks"] == world}
        mine, ref = rows.get(MINE), rows.get(REFERENCE)
        why = _needs(mine, "step_median_ms", "no step() timing") or _needs(ref, "step_median_ms", "no step() timing")
        value = None if why else mine["step_median_ms"] / ref["step_median_ms"]
        what = f"flatopt step() / torch-fused step() <= {r:g}x"
        out.append(harness.target(what, value, r, "x", note=why, ranks=world))
        paired = next((p for p in record["paired"] if p["ranks"] == world), None)
        added = (paired or {}).get("added") or {}
        value, why = None, f"paired timing {harness.why_not(paired)}"
        if paired is not None and paired["status"] == "ok":
            ib, tf = added.get(MINE_IN_BACKWARD), added.get(REFERENCE)
            if ib is None or tf is None:
                why = f"needs the {BASELINE}, {REFERENCE} and {MINE_IN_BACKWARD} cases"
            elif tf["median_ms"] <= 0:
                why = f"{REFERENCE} added no time over {BASELINE} ({tf['median_ms']:.3f} ms): no ratio"
            else:
                value = ib["median_ms"] / tf["median_ms"]
        what = f"flatopt-in-backward added time / torch-fused added time <= {r:g}x (paired)"
        out.append(harness.target(what, value, r, "x", note=why, ranks=world))
        value, threshold, why = peak_target(world, rows)
        what = "flatopt-in-backward peak <= flatopt step-mode peak - sharded gradient bytes"
        out.append(harness.target(what, value, threshold, "GiB", note=why, ranks=world))
    return out


# -------------------------------------------------------------------------------------------------- output
def _gib(x):
    return f"{x / GIB:.3f}" if isinstance(x, (int, float)) else "-"


def markdown(record):
    lines = harness.smoke_banner(record)
    m, c = record["model"], record["model"]["config"]
    lines += [
        f"FSDP2 benchmark (AdamW on a sharded GPT, one device): {harness.env_line(record)}. Model: "
        f"{c['layers']} layers, d={c['dim']}, vocab {c['vocab']}, {m['params']:,} parameters in {m['tensors']} "
        f"tensors, batch {c['batch']}x{c['tokens']} per rank. "
        f"Sharding: {record['sharding']}. Precision: {record['precision']}. GiB = 2**30 bytes.",
        "",
        f"Command: `{record.get('command')}`",
        "",
    ]
    rows = [[w["ranks"], w["backend"], w["device"], w["status"], harness.first_line(w.get("reason"), 200) or "-",
             num(w.get("seconds"), ".0f")] for w in record["worlds"]]  # fmt: skip
    lines += ["Groups of ranks (every rank of a group on the one device):", ""]
    lines += harness.md_table(["ranks", "backend", "device", "status", "why not", "s"], rows)
    head = ["ranks", "case", "training step ms (p20-p80)", "step() ms (p20-p80)", "peak GiB", "held GiB",
            "sharded gradients GiB", "final loss (rank 0)"]  # fmt: skip
    rows = []
    for r in record["results"]:
        if r["status"] != "ok":
            rows.append([r["ranks"], r["case"], f"{r['status']}: {harness.first_line(r.get('reason'))}"] + [""] * 5)
            continue
        rows.append([r["ranks"], r["case"], harness.spread(r), harness.spread(r, "step_"),
                     _gib(r.get("peak_bytes")), _gib(r.get("held_bytes")), _gib(r.get("grad_shard_bytes")),
                     num(r.get("final_loss"), ".4f")])  # fmt: skip
    lines += ["", "Alone: each case on its own (the slowest rank's times, the largest rank's memory; step(): CUDA "
              "events around opt.step() in each timed step; peak over the timed steps).", ""]  # fmt: skip
    lines += harness.md_table(head, rows)
    rows = []
    for p in record["paired"]:
        if p["status"] != "ok":
            rows.append([p["ranks"], "-", f"{p['status']}: {harness.first_line(p.get('reason'))}", ""])
            continue
        for c in p["cases"]:
            added = (p.get("added") or {}).get(c)
            rows.append([p["ranks"], c, harness.spread(p[c]), harness.spread(added) if added else "-"])
    lines += ["", f"Paired: the cases side by side, one synchronised step of each per round; added = the median over "
              f"rounds of the case's step minus {BASELINE}'s (p20-p80).", ""]  # fmt: skip
    lines += harness.md_table(["ranks", "case", "training step ms (p20-p80)", "added ms (p20-p80)"], rows)
    lines += [""] + harness.targets_markdown(record["targets"], ("ranks",))
    return "\n".join(lines) + "\n"


def print_world(info, rows, paired):
    why = f" ({info['reason']})" if info.get("reason") else ""
    print(f"  {info['ranks']} rank(s), {info['backend']}: {info['status']}{why}, {info['seconds']:.0f} s", flush=True)
    for r in rows:
        if r["status"] == "ok":
            step = f", step() {r['step_median_ms']:.3f} ms" if r.get("step_median_ms") is not None else ""
            peak = f", peak {_gib(r.get('peak_bytes'))} GiB" if r.get("peak_bytes") is not None else ""
            detail = f"{r['median_ms']:.3f} ms per step{step}{peak}"
        else:
            detail = f"{r['status'].upper()}: {harness.first_line(r.get('reason'))}"
        print(f"    {r['case']:20} {detail}", flush=True)
    if paired.get("added"):
        print("    added over fwd-bwd (paired): " + ", ".join(f"{c} {a['median_ms']:.3f} ms"
                                                          for c, a in paired["added"].items()), flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- main
def rank_counts(text):
    """An argparse type: a comma-separated list of rank counts (each at least 1)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected rank counts such as 1 or 1,2; got {text!r}")
    return counts


def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=300.0)
    add = p.add_argument
    add("--ranks", type=rank_counts, default=None, help="groups of ranks, one after another (default: 1 on CUDA, "
        "2 on the CPU); 1,2 runs one rank, then two sharing the device")  # fmt: skip
    add("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on CUDA, gloo on the CPU")
    add("--cases", type=harness.csv_list(tuple(CASES)), default=list(CASES), help="default: all")
    add("--warmup", type=int, default=None, help="steps before timing (default 5; smoke 1)")
    add("--iters", type=int, default=None, help="timed steps alone, and paired rounds (default 40; smoke 2)")
    add("--no-paired", dest="paired", action="store_false", help="skip the paired timing (and the added times)")
    args = p.parse_args(argv)
    harness.check_device(p, args, measures="measures FSDP2 step time and memory on a GPU")
    cuda = torch.device(args.device).type == "cuda"
    if args.backend == "nccl" and not cuda:
        p.error("--backend nccl needs --device cuda; the CPU runs gloo")
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    args.ranks = args.ranks or [1 if cuda else 2]
    args.warmup = max(1, args.warmup if args.warmup is not None else (1 if args.smoke else 5))
    args.iters = max(1, args.iters if args.iters is not None else (2 if args.smoke else 40))
    return args


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run_group(world, args, record, path, start):
    """Run a group of ``world`` ranks (unless the budget is spent), add its records to ``record`` and evaluate the
    targets, and write the JSON: a run stopped in a later group keeps this one's results and targets."""
    left = args.budget_s - (time.monotonic() - start)
    if left <= 0:
        info = harness.budget_spent(dict(ranks=world, backend=args.backend, device=str(rank_device(args.device)),
                                         shared_device=world > 1, seconds=0.0), args)  # fmt: skip
        ranks = [None] * world
    else:
        info, ranks = run_world(world, args, left)
    record["worlds"].append(info)
    rows = [combine(c, world, [case_row(r, i) for r in ranks], info) for i, c in enumerate(args.cases)]
    record["results"] += rows
    paired = dict(ranks=world, status="skipped", reason="--no-paired")
    if args.paired:
        paired = combine_paired(world, [(r or {}).get("paired") for r in ranks], info)
    record["paired"].append(paired)
    record["targets"] = evaluate_targets(record)
    print_world(info, rows, paired)
    harness.write_json(path, record)


def run(args, argv):
    start = time.monotonic()
    device = torch.device(args.device)
    path = harness.output_path(args, "fsdp")
    record = harness.new_record(
        "fsdp",
        "on one GPU under FSDP2: flatopt.AdamW's optimizer time (step mode, in-backward mode) against torch.optim."
        "AdamW(fused=True) on the same shards, and in-backward mode's peak memory against step mode's",
        "bench_fsdp", args, argv, device,
        settings=dict(ranks=args.ranks, backend=args.backend, warmup=args.warmup, iters=args.iters,
                      paired=args.paired, budget_s=args.budget_s, seed=args.seed),
        hparams=HPARAMS,
        model=bench_eager.describe("gpt2", SMOKE if args.smoke else FULL),
        sharding=SHARDING,
        precision=PRECISION,
        cases={c: CASES[c] for c in args.cases},
        optimizer_time=dict(
            step_mode="CUDA events right before and right after opt.step() in every timed step (perf_counter on the "
                      "CPU): the device's time from the first to the second, host time it waits for included",
            added=f"paired: the median over rounds of the case's synchronised step minus {BASELINE}'s in the same "
                  "round; the optimizer time of in-backward mode, whose launches run inside backward"),
        targets_definition=dict(optimizer_ratio=TARGET_OPTIMIZER_RATIO,
                                peak="flatopt-in-backward peak <= flatopt step-mode peak - its sharded gradient bytes, "
                                     "per rank"),
        worlds=[],
        results=[],
        paired=[],
        targets=[],
    )  # fmt: skip
    harness.announce(record, path)
    with stopped_by_sigterm():
        for world in args.ranks:
            run_group(world, args, record, path, start)
    failed = [r for r in record["results"] if r["ours"] and r["status"] in ("failed", "oom")]
    return harness.finish(record, path, args, markdown, failed, start)


if __name__ == "__main__":
    sys.exit(main())
