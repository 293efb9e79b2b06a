"""The ``flatopt`` console command.

::

    flatopt demo [--steps N] [--batch-size B] [--seq-len T] [--device cpu|cuda] [--out DIR] ...

Each subcommand NAME has an ``add_NAME_arguments(parser)`` function that declares its options
and a ``run_NAME(parser, args)`` function that hands the parsed options to the subcommand's own
module (``flatopt.demo`` for ``demo``), where the work lives.
"""

import argparse
import sys

import torch

from flatopt import __version__


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _device(text):
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}; use 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} was asked for, but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"the demo runs on 'cpu' or 'cuda', got {text!r}")
    return device


def add_demo_arguments(parser):
    """Declare the options of ``flatopt demo``; the defaults train for 3 to 5 minutes on a 2-core CPU."""
    from flatopt import demo

    d = demo.DemoConfig()
    add = parser.add_argument
    add("--steps", type=_positive_int, default=d.steps, help="training steps per optimizer (default: %(default)s)")
    add("--batch-size", type=_positive_int, default=d.batch_size, help="sequences per batch (default: %(default)s)")
    add("--seq-len", type=_positive_int, default=d.seq_len, help="characters per sequence (default: %(default)s)")
    add("--dim", type=_positive_int, default=d.dim, help="model width (default: %(default)s)")
    add("--layers", type=_positive_int, default=d.layers, help="transformer blocks (default: %(default)s)")
    add(
        "--heads", type=_positive_int, default=d.heads, help="attention heads; must divide --dim (default: %(default)s)"
    )
    add("--lr", type=_positive_float, default=d.lr, help="peak learning rate (default: %(default)s)")
    add(
        "--data-mb",
        type=_positive_float,
        default=d.data_mb,
        help="megabytes of standard-library source to read (default: %(default)s)",
    )
    add(
        "--eval-every",
        type=_positive_int,
        default=None,
        help="steps between two measurements of the validation loss, also measured after the last step "
        "(default: a tenth of --steps)",
    )
    add(
        "--device",
        type=_device,
        default=None,
        help="'cpu' or 'cuda' (default: cuda if available, else cpu); on CUDA flatopt uses its Triton kernels",
    )
    add(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads for torch while the demo runs (default: the CPUs this process may use that other work "
        "does not keep busy)",
    )
    add(
        "--torch-impl",
        choices=sorted(demo.TORCH_IMPLS),
        default=d.torch_impl,
        help="torch.optim.AdamW implementation to compare against (default: %(default)s, torch's own choice)",
    )
    add("--out", default=d.out, help="folder for the plot and the results JSON (default: %(default)s)")
    add("--seed", type=int, default=d.seed, help="seed of the initialisation and the data order (default: %(default)s)")
    add("--quiet", action="store_true", help="no progress bar")


def run_demo(parser, args):
    from flatopt import demo

    config = demo.DemoConfig(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})
    try:
        demo.run(config)
    except demo.DemoError as e:
        parser.error(str(e))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="flatopt", description="flatopt: fused PyTorch optimizers over flat buffers.")
    parser.add_argument("--version", action="version", version=f"flatopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_parser = sub.add_parser(
        "demo",
        help="train a small character-level transformer with flatopt.AdamW and torch.optim.AdamW and compare",
        description=(
            "Train a character-level transformer on the Python standard library's source with flatopt.AdamW and "
            "with torch.optim.AdamW from the same initialisation and data order; print the final losses and step "
            "times, and write a plot of both loss curves and a results JSON."
        ),
    )
    add_demo_arguments(demo_parser)
    demo_parser.set_defaults(func=lambda args: run_demo(demo_parser, args))
    return parser


def main(argv=None):
    """Entry point of the ``flatopt`` command; returns the exit status.

    Args:
        argv (list[str], optional): the arguments after the program name (default: ``sys.argv[1:]``)
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
