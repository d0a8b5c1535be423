"""What the benchmarks' command lines share."""

import argparse


def positive(value: str) -> int:
    """An option's value that must be a whole number >= 1 (--repeats, --nproc)."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    return int(value)
