"""Question: does a bfloat16 model trained with flatopt.AdamW's storage options (master_weights, stochastic_rounding,
state_dtype; docs/precision.md) reach the final loss that float32 AdamW reaches?

Task: flatopt.demo's character-level transformer learning Python from this interpreter's standard library (read from
disk, no download), trained with flatopt.demo's code (data, model, loss, warm-up + cosine schedule, training loop).
For each seed (the initialisation and the order of the batches) every mode starts from the same initialisation (its
dtype's copy of it) and trains on the same batches: the modes of a seed train interleaved step by step
(``flatopt.demo.training.train_interleaved``). Each is evaluated every tenth of the run and after the last step on
the same held-out batches, drawn once from ``VAL_SEED`` and the same for every seed and mode, so that the spread
over seeds is the spread of training alone. The loss is computed in float32 (a bfloat16 model's logits are upcast).
Hyper-parameters: AdamW lr of the size (warm-up over a tenth of the run, at most 100 steps, then cosine to a tenth),
betas (0.9, 0.99), weight decay 0.1 on every parameter, the demo's.

Modes (benchmarks/precision_modes.py; every bf16 mode's model is the float32 initialisation rounded to bfloat16, its
forward and backward run in bfloat16):

    fp32               float32 parameters, forward and backward in float32: the baseline
    bf16-remainder     master_weights="remainder", state_dtype=torch.float32
    bf16-master-fp32   master_weights="fp32", state_dtype=torch.float32
    bf16-sr            stochastic_rounding=True, state_dtype=torch.bfloat16
    bf16-sr-int8       stochastic_rounding=True, state_dtype="int8"
    bf16               no option (bfloat16 parameters and states, rounded to nearest): a contrast, no verdict

Verdicts (:func:`verdicts`), on the final validation loss (after the last step), over the seeds that finished:

* the spread: fp32's largest final loss minus its smallest, over its seeds (at least 2);
* a mode's difference: the mean of its final losses minus fp32's mean, over the seeds both finished;
* bf16-master-fp32 and bf16-sr: met when |difference| <= the spread;
* bf16-sr-int8: met when |difference| <= 2 % of fp32's mean;
* bf16-remainder: met when it is identical, as defined below, for every seed.

What "identical" means. The fp32 run is not what ``"remainder"`` is bit-identical to, and cannot be: its forward and
backward see float32 weights and compute in float32, so its gradients differ from the first step on. What the mode
keeps is the float32 master that float32 AdamW would compute from the same gradients: the gradients of the bfloat16
model that holds the master rounded to nearest (ties away from zero, ``flatopt.precision.round_nearest``). So every
bf16-remainder run carries a float32 *shadow*: a float32 copy of its initial (bfloat16) parameters, stepped by
flatopt.AdamW on float32 parameters with float32 states, the same hyper-parameters and schedule, and the backend
that steps the remainder buffers (the Triton kernels on CUDA; on the CPU the pure-torch reference, to which
backend="cpu" routes the precision modes), fed after each step the remainder run's own gradients (bfloat16, converted
to float32 exactly). At every evaluation three checks: (1) every parameter joined with its remainder
(``flatopt.precision.join_master``, from ``state_dict()["flatopt"]``) equals the shadow's float32 parameter bit for
bit; (2) ``exp_avg`` and ``exp_avg_sq`` equal the shadow's bit for bit; (3) the validation loss of a bfloat16 model
holding the shadow's parameters rounded to nearest equals the remainder run's, as a float. "Identical": no element
differs and every loss is equal, at every evaluation, including the final one. The shadow takes the gradients
instead of computing its own because a second forward and backward of the same weights is bit-reproducible only
where torch's kernels are (on CUDA, flash attention's backward accumulates with atomics): that would test torch's
determinism, not flatopt's. The remainder run's final loss is also compared with fp32's like the others' (its
difference and the spread are in the table), without a verdict: there the bfloat16 forward is what differs.

Sizes (``--size``): ``gpu`` (default): 4 blocks of width 256, 4 heads, batches of 32 x 256 characters of 6 MB of
source, lr 2e-3, 1500 steps, 16 held-out batches; ``tiny``: 1 block of width 32, batches of 4 x 32 characters,
8 steps, a code-path check whose output is not a result (``--smoke`` is the same).

Writes a JSON (per mode and seed: the training loss at every step, its centred moving mean, the validation losses
and the steps they were measured after, the final validation loss, the median training-step time; the shadow's
checks; the verdicts as targets; device, library versions, date, git commit and command) and a PNG of the curves
beside it (``benchmarks/plot.py`` draws it again from the JSON). ``--budget-s``: a seed that would not finish in the
time left (judged by the previous seed's time) is not started, and one that runs out of time stops and is left out
of the verdicts; the JSON is rewritten after every seed. Exit status 1 when a run of a mode failed (raised).

GPU run from the repository root (or ``FLATOPT_SECTIONS=convergence bash benchmarks/run_gpu.sh``):

    PYTHONPATH=. python3 benchmarks/convergence.py [--seeds 3] [--steps N] [--modes fp32,bf16-sr] [--out DIR]

CPU check of the code path (tiny size, measures nothing):

    PYTHONPATH=. python3 benchmarks/convergence.py --device cpu --smoke --out /tmp/flatopt-smoke

Markdown table of a stored result: ``python3 benchmarks/convergence.py --report RESULT.json``.
"""

import copy
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch

import flatopt
from benchmarks import harness, precision_modes
from benchmarks.harness import num
from flatopt.demo import CharData, DemoConfig, Run
from flatopt.demo.data import load_stdlib_text
from flatopt.demo.measure import timed_steps
from flatopt.demo.model import warmup_cosine
from flatopt.demo.report import smooth, smoothing_half_width
from flatopt.demo.training import initial_model, train_interleaved, validation_batches, warmup_steps
from flatopt.precision import join_master, round_nearest

QUESTION = "final validation loss of each precision mode against float32 AdamW's seed-to-seed spread"
MODES = ("fp32", "bf16-remainder", "bf16-master-fp32", "bf16-sr", "bf16-sr-int8", "bf16")
CRITERIA = {  # mode: what its final validation loss is held to (module docstring)
    "fp32": "baseline",
    "bf16-remainder": "identical",
    "bf16-master-fp32": "spread",
    "bf16-sr": "spread",
    "bf16-sr-int8": "relative",
    "bf16": "contrast",
}
RELATIVE = 0.02  # bf16-sr-int8: |difference| <= 2 % of fp32's mean final loss
BETAS = (0.9, 0.99)
VAL_SEED = 1_000_003  # the held-out batches: the same for every seed and mode
SIZES = {
    "gpu": dict(steps=1500, batch_size=32, seq_len=256, dim=256, layers=4, heads=4, lr=2e-3, data_mb=6.0,
                eval_batches=16),
    "tiny": dict(steps=8, batch_size=4, seq_len=32, dim=32, layers=1, heads=2, lr=3e-3, data_mb=0.3, eval_batches=2),
}  # fmt: skip
CURVE_POINTS = 300  # the smoothed training curve is stored at about this many steps


# ------------------------------------------------------------------------------------------------ runs
class GuardedRun(Run):
    """A demo run that records an exception in a step or an evaluation (``error``) and stops there, so that the
    other modes of its seed train on."""

    def __init__(self, name, model, optimizer, scheduler):
        super().__init__(name, model, optimizer, scheduler)
        self.error = None

    def _guard(self, fn, *args):
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as e:  # recorded in the result; the other modes go on
            self.error = harness.error_fields(e)

    def train_step(self, x, y, clock):
        self._guard(super().train_step, x, y, clock)

    def evaluate(self, batches):
        self._guard(super().evaluate, batches)


def shadow_optimizer(model, hparams, backend):
    """The float32 AdamW that steps a remainder run's shadow (module docstring)."""
    return flatopt.AdamW(model, **hparams, backend=backend)


class ShadowedRun(GuardedRun):
    """The bf16-remainder run and its float32 shadow: after each of the run's steps the shadow takes its gradients
    and steps; at each evaluation both are compared (``checks``) and the shadow is evaluated (``shadow.val_losses``).

    Args:
        shadow (torch.nn.Module): a float32 copy of the bfloat16 model before the run's optimizer was built
        shadow_eval (torch.nn.Module): a bfloat16 copy of it, evaluated with the shadow rounded to nearest
    """

    def __init__(self, name, model, optimizer, scheduler, shadow, shadow_eval, hparams, schedule):
        super().__init__(name, model, optimizer, scheduler)
        backend = "torch" if optimizer.backend == "cpu" else optimizer.backend  # what steps the remainder buffers
        shadow_opt = shadow_optimizer(shadow, hparams, backend)
        self.shadow_params = list(shadow.parameters())
        self.shadow = Run(
            f"{name} shadow", shadow_eval, shadow_opt, torch.optim.lr_scheduler.LambdaLR(shadow_opt, schedule)
        )
        self.checks = []

    def train_step(self, x, y, clock):
        super().train_step(x, y, clock)
        self._guard(self._step_shadow)

    def _step_shadow(self):
        with torch.no_grad():
            for src, dst in zip(self.model.parameters(), self.shadow_params, strict=True):
                if dst.grad is None:
                    dst.grad = src.grad.float()
                else:
                    dst.grad.copy_(src.grad)
        self.shadow.optimizer.step()
        self.shadow.scheduler.step()

    def evaluate(self, batches):
        super().evaluate(batches)
        self._guard(self._check, batches)

    @torch.no_grad()
    def _check(self, batches):
        for p, q in zip(self.shadow.model.parameters(), self.shadow_params, strict=True):
            p.copy_(round_nearest(q))
        self.shadow.evaluate(batches)
        ours, theirs = self.optimizer.state_dict(), self.shadow.optimizer.state_dict()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        remainders = ours["flatopt"]["master"]
        masters = [join_master(p.detach(), remainders[i]) for i, p in enumerate(params)]
        states = [
            (ours["state"][i][k], theirs["state"][i][k]) for i in ours["state"] for k in ("exp_avg", "exp_avg_sq")
        ]
        self.checks.append(
            dict(
                step=len(self.losses),
                params_differing=differing(zip(masters, self.shadow_params, strict=True)),
                states_differing=differing(states),
                val_loss=self.val_loss,
                shadow_val_loss=self.shadow.val_loss,
                val_loss_equal=self.val_loss == self.shadow.val_loss,
            )
        )

    @property
    def identical(self):
        """Whether every check found no element differing and equal losses (None before the first check)."""
        if not self.checks:
            return None
        return all(
            c["params_differing"] == 0 and c["states_differing"] == 0 and c["val_loss_equal"] for c in self.checks
        )


def differing(pairs):
    """Elements whose bits differ between the float32 tensors of each pair."""
    return sum(int((a.view(torch.int32) != b.detach().view(torch.int32)).sum()) for a, b in pairs)


def hparams_of(config):
    return dict(lr=config.lr, betas=BETAS, weight_decay=config.weight_decay)


def make_run(mode, base, config):
    """The run of ``mode`` for one seed: its dtype's copy of ``base``, flatopt.AdamW with the mode's options (the
    stochastic rounding seed drawn from ``config.seed``), the demo's schedule; a bf16-remainder run with its shadow."""
    dtype, kwargs = precision_modes.MODES[mode]
    model = copy.deepcopy(base).to(harness.DTYPES[dtype])
    schedule = warmup_cosine(config.steps, warmup_steps(config))
    hparams = hparams_of(config)
    shadow = (copy.deepcopy(model).float(), copy.deepcopy(model)) if CRITERIA[mode] == "identical" else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        optimizer = flatopt.AdamW(model, **hparams, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if shadow is not None:
        return ShadowedRun(mode, model, optimizer, scheduler, *shadow, hparams, schedule)
    return GuardedRun(mode, model, optimizer, scheduler)


def result_row(run, seed, eval_steps, complete, budget_s):
    """A run's entry in the JSON (``complete``: its seed trained every step; ``budget_s``: the run's --budget-s)."""
    losses = run.losses
    half = smoothing_half_width(len(losses))
    stride = max(1, len(losses) // CURVE_POINTS)
    smoothed = smooth(losses, half)
    keep = sorted(set(range(stride - 1, len(losses), stride)) | ({len(losses) - 1} if losses else set()))
    finished = complete and run.error is None
    row = dict(
        mode=run.name,
        seed=seed,
        status="failed" if run.error else ("ok" if complete else "incomplete"),
        backend=run.optimizer.backend,
        steps_done=len(losses),
        train_losses=[round(v, 5) if math.isfinite(v) else v for v in losses],
        smoothed=dict(half_width=half, steps=[i + 1 for i in keep], values=[round(smoothed[i], 5) for i in keep]),
        val_steps=eval_steps[: len(run.val_losses)],
        val_losses=run.val_losses,
        final_val_loss=run.val_losses[-1] if finished and run.val_losses else None,
        median_train_step_ms=_median_ms(run.train_step_s[timed_steps(len(run.train_step_s))]),
        **(run.error or {}),
    )
    if isinstance(run, ShadowedRun):
        row["shadow"] = dict(backend=run.shadow.optimizer.backend, val_losses=run.shadow.val_losses,
                             checks=run.checks, identical=run.identical if finished else None)  # fmt: skip
    if not complete and run.error is None:
        row["reason"] = f"time budget (--budget-s {budget_s:g}) ran out after {len(losses)} steps"
    return row


def _median_ms(seconds):
    if not seconds:
        return None
    s = sorted(seconds)
    mid = len(s) // 2
    return 1e3 * (s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2)


# ---------------------------------------------------------------------------------------------- verdicts
def finals_of(results):
    """{mode: {seed: final validation loss}} of the runs that finished; {seed: identical} of the remainder runs."""
    finals, identity = {}, {}
    for r in results:
        if r.get("final_val_loss") is None:
            continue
        finals.setdefault(r["mode"], {})[r["seed"]] = r["final_val_loss"]
        if r.get("shadow") is not None and r["shadow"].get("identical") is not None:
            identity[r["seed"]] = r["shadow"]["identical"]
    return finals, identity


def comparison(finals, mode):
    """How ``mode``'s final losses compare with fp32's (None without a seed both finished): fp32's mean, spread
    (None under 2 seeds) and seeds; the mode's mean and its difference from fp32's over the seeds both finished."""
    base, mine = finals.get("fp32", {}), finals.get(mode, {})
    common = sorted(set(base) & set(mine))
    if not common:
        return None
    fp32 = list(base.values())
    mean_base = sum(base[s] for s in common) / len(common)
    mean_mine = sum(mine[s] for s in common) / len(common)
    return dict(
        seeds=common,
        fp32_seeds=sorted(base),
        fp32_mean=sum(fp32) / len(fp32),
        spread=max(fp32) - min(fp32) if len(fp32) >= 2 else None,
        mean=mean_mine,
        difference=mean_mine - mean_base,
        relative=(mean_mine - mean_base) / mean_base if mean_base else None,
    )


def verdicts(finals, identity, modes=MODES):
    """The targets of the modes in ``modes`` (harness.target rows with ``mode`` and ``criterion``).

    Args:
        finals (dict): {mode: {seed: final validation loss}} of the runs that finished
        identity (dict): {seed: whether the bf16-remainder run was identical to its shadow}
    """
    targets = []
    for mode in modes:
        criterion = CRITERIA[mode]
        if criterion in ("baseline", "contrast"):
            continue
        where = dict(mode=mode, criterion=criterion)
        if criterion == "identical":
            what = "bit-identical to float32 AdamW fed the same gradients (seeds that differ)"
            differ = sum(not v for v in identity.values()) if identity else None
            why = (
                f"differs at seed(s) {', '.join(str(s) for s, v in sorted(identity.items()) if not v)}"
                if differ
                else None
            )
            targets.append(harness.target(what, differ, 0, "seeds", note="no finished run", why=why, **where))
            continue
        c = comparison(finals, mode)
        if criterion == "spread":
            what = "distance of the mean final loss from fp32's <= fp32's seed-to-seed spread"
            note = "no seed finished by both this mode and fp32" if c is None else "fp32 finished fewer than 2 seeds"
            value, threshold = (None, None) if c is None else (abs(c["difference"]), c["spread"])
            targets.append(harness.target(what, value, threshold, "nats", note=note, **where))
        else:
            what = f"distance of the mean final loss from fp32's <= {100 * RELATIVE:g} % of fp32's"
            value = None if c is None or c["relative"] is None else 100 * abs(c["relative"])
            targets.append(harness.target(what, value, 100 * RELATIVE, "%", note="no seed finished by both", **where))
        if targets[-1]["met"] is False:
            targets[-1]["why"] = f"mean final loss {c['mean']:.4f} against fp32's {c['mean'] - c['difference']:.4f}"
    return targets


# ---------------------------------------------------------------------------------------------- output
def markdown(record):
    lines = harness.smoke_banner(record)
    m = record["model"]
    cfg = record["config"]
    lines += [
        f"Convergence of the precision modes: {harness.env_line(record)}. Task: flatopt.demo's character-level "
        f"transformer ({m['parameters']:,} parameters: {m['layers']} blocks, width {m['dim']}, {m['heads']} heads, "
        f"vocabulary {m['vocab_size']}) on {record['data']['characters']:,} characters of Python's standard library, "
        f"{cfg['steps']} steps of {cfg['batch_size']} x {cfg['seq_len']} characters, AdamW lr {cfg['lr']:g} "
        f"(warm-up {record['warmup_steps']} steps, then cosine), weight decay {cfg['weight_decay']:g}; seeds "
        f"{', '.join(map(str, record['seeds']))}. Loss: nats per character, validation on "
        f"{cfg['eval_batches']} fixed held-out batches.",
        "",
        f"Command: `{record.get('command')}`",
        "",
    ]
    finals, _ = finals_of(record["results"])
    by_mode = {}
    for r in record["results"]:
        by_mode.setdefault(r["mode"], []).append(r)
    head = ["mode", "options", "final validation loss per seed", "mean", "- fp32's mean", "%", "fp32's spread",
            "criterion"]  # fmt: skip
    rows = []
    for mode in record["modes"]:
        runs = by_mode.get(mode, [])
        per_seed = ", ".join(f"{r['seed']}: {num(r.get('final_val_loss'), '.4f')}" if r["status"] == "ok"
                             else f"{r['seed']}: {r['status'].upper()}" for r in runs)  # fmt: skip
        c = comparison(finals, mode)
        mine = list(finals.get(mode, {}).values())
        mean = sum(mine) / len(mine) if mine else None
        diff = "-" if c is None or mode == "fp32" else f"{c['difference']:+.4f}"
        rel = "-" if c is None or mode == "fp32" or c["relative"] is None else f"{100 * c['relative']:+.2f}"
        spread = "-" if c is None else num(c["spread"], ".4f")
        rows.append([mode, record["mode_options"][mode], per_seed, num(mean, ".4f"), diff, rel, spread,
                     CRITERIA[mode]])  # fmt: skip
    lines += harness.md_table(head, rows)
    shadowed = [r for r in record["results"] if r.get("shadow")]
    if shadowed:
        lines += ["", "bf16-remainder against its float32 shadow (float32 AdamW fed the same gradients), at every "
                  "evaluation:", ""]  # fmt: skip
        for r in shadowed:
            checks = r["shadow"]["checks"]
            params = sum(c["params_differing"] for c in checks)
            states = sum(c["states_differing"] for c in checks)
            equal = sum(bool(c["val_loss_equal"]) for c in checks)
            verdict = {True: "identical", False: "**differs**", None: "not finished"}[r["shadow"]["identical"]]
            lines.append(
                f"- seed {r['seed']}: {verdict}; {len(checks)} checks, parameter elements differing {params}, state "
                f"elements differing {states}, validation losses equal {equal} of {len(checks)}"
            )
    lines += [""] + harness.targets_markdown(record["targets"], ("mode",))
    return "\n".join(lines) + "\n"


def options_text(mode):
    dtype, kwargs = precision_modes.MODES[mode]
    shown = ", ".join(f"{k}={_value(v)}" for k, v in kwargs.items())
    return f"{dtype} parameters" + (f", {shown}" if shown else "")


def _value(v):
    return repr(v) if isinstance(v, (str, bool)) else f"torch.{str(v).removeprefix('torch.')}"


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=math.inf)
    add = p.add_argument
    add("--size", choices=tuple(SIZES), default=None, help="gpu (default) or tiny (a code-path check; --smoke)")
    add("--steps", type=int, default=None, help="training steps (default: the size's, gpu 1500, tiny 8)")
    add("--seeds", type=int, default=3, help="seeds --seed, --seed + 1, ... (default 3)")
    add("--modes", type=harness.csv_list(MODES), default=list(MODES), help=f"default: {','.join(MODES)}")
    add("--png", type=Path, default=None, help="PNG path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    if args.report is not None:
        return args
    if args.smoke and args.size not in (None, "tiny"):
        p.error(f"--smoke runs the tiny size; drop --smoke to run --size {args.size}")
    args.size = args.size or ("tiny" if args.smoke else "gpu")
    args.smoke = args.size == "tiny"  # the tiny size measures nothing
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1 (3 gives fp32 a spread to compare with), got {args.seeds}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    harness.check_device(p, args, cpu_ok=True)
    return args


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    start = time.monotonic()
    device = torch.device(args.device)
    size = dict(SIZES[args.size], **({} if args.steps is None else dict(steps=args.steps)))
    config = DemoConfig(**size, device=str(device), quiet=True)
    path = harness.output_path(args, "convergence")
    text, source = load_stdlib_text(int(config.data_mb * 1e6))
    data = CharData(text, config.val_fraction, config.seq_len)
    val_batches = validation_batches(config, data, device, VAL_SEED)
    seeds = [args.seed + i for i in range(args.seeds)]
    n_params = sum(p.numel() for p in initial_model(config, data, "cpu").parameters())
    modes = [m for m in MODES if m in args.modes]
    record = harness.new_record(
        "convergence", QUESTION, "convergence", args, argv, device,
        size=args.size,
        config={k: v for k, v in asdict(config).items() if k not in ("out", "quiet", "threads", "torch_impl", "seed")},
        warmup_steps=warmup_steps(config),
        betas=list(BETAS),
        model=dict(parameters=n_params, layers=config.layers, dim=config.dim, heads=config.heads,
                   vocab_size=data.vocab_size),
        data=dict(**source, characters=len(data.train) + len(data.val), train_characters=len(data.train),
                  val_characters=len(data.val), val_seed=VAL_SEED),
        settings=dict(float32_matmul_precision=torch.get_float32_matmul_precision(), budget_s=args.budget_s),
        seeds=seeds,
        modes=modes,
        mode_options={m: options_text(m) for m in modes},
        criteria={m: CRITERIA[m] for m in modes},
        relative_tolerance=RELATIVE,
        results=[],
        seconds_per_seed={},
        targets=[],
        complete=False,
    )  # fmt: skip
    harness.announce(record, path)
    print(
        f"{n_params:,} parameters; {config.steps} steps of {config.batch_size} x {config.seq_len}; modes "
        f"{', '.join(modes)}; seeds {', '.join(map(str, seeds))}",
        flush=True,
    )
    last = None
    for seed in seeds:
        elapsed = time.monotonic() - start
        if last is not None and elapsed + last > args.budget_s:
            for mode in modes:
                record["results"].append(harness.budget_spent(dict(mode=mode, seed=seed, steps_done=0), args))
            print(f"seed {seed}: skipped, the time budget (--budget-s {args.budget_s:g}) would run out", flush=True)
            continue
        t0 = time.monotonic()
        record["results"] += train_seed(seed, modes, config, data, device, val_batches, args, start)
        last = time.monotonic() - t0
        record["seconds_per_seed"][str(seed)] = round(last, 1)
        harness.write_json(path, record)
    finals, identity = finals_of(record["results"])
    record["targets"] = verdicts(finals, identity, modes)
    record["complete"] = all(r["status"] == "ok" for r in record["results"])
    failed = [r for r in record["results"] if r["status"] == "failed"]
    status = harness.finish(record, path, args, markdown, failed, start)
    draw_png(record, args.png or path.with_suffix(".png"))
    return status


def train_seed(seed, modes, config, data, device, val_batches, args, start):
    """Train every mode from seed ``seed``'s initialisation on its batches, interleaved; their result rows."""
    config = replace(config, seed=seed)
    base = initial_model(config, data, device)
    runs, rows = [], []
    for mode in modes:
        try:
            runs.append(make_run(mode, base, config))
        except Exception as e:  # recorded; the other modes go on
            rows.append(dict(mode=mode, seed=seed, status="failed", steps_done=0, **harness.error_fields(e)))
    t0 = time.monotonic()

    def out_of_time(done):
        return time.monotonic() - start > args.budget_s

    eval_steps = train_interleaved(runs, config, data, device, val_batches, stop=out_of_time)
    complete = bool(eval_steps) and eval_steps[-1] == config.steps
    rows += [result_row(r, seed, eval_steps, complete, args.budget_s) for r in runs]
    rows.sort(key=lambda r: modes.index(r["mode"]))
    for r in rows:
        final = num(r.get("final_val_loss"), ".4f")
        extra = f", identical to its shadow: {r['shadow']['identical']}" if r.get("shadow") else ""
        print(f"seed {seed} {r['mode']:17} {r['status']:10} final validation loss {final}{extra}", flush=True)
    print(f"seed {seed}: {time.monotonic() - t0:.1f} s", flush=True)
    return rows


def draw_png(record, png):
    from benchmarks import plot

    try:
        plot.draw(record, png, "convergence")
    except ImportError as e:
        print(f"PNG skipped: matplotlib is not importable ({e}); the JSON and markdown are complete")
    else:
        print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
