"""`meshforge megatron FLAGS...`: train from a Megatron-style command line.

    torchrun $DISTRIBUTED_ARGS -m meshforge megatron $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS ...

takes the flags of Megatron-LM's `pretrain_gpt.py` (and of the projects built on it) unchanged:
`config/megatron_import.py` maps each one to the native config and logs what it became, and the
run is `meshforge train`'s. The world size is the one torchrun's environment gives, as Megatron's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from meshforge.config.root import TrainConfig


def add_megatron_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `megatron` on the `meshforge` sub-commands."""
    megatron = subparsers.add_parser(
        "megatron",
        help="train from Megatron-LM flags (pretrain_gpt.py's), e.g. torchrun ... -m meshforge megatron $ARGS",
        description=__doc__,
    )
    megatron.add_argument(
        "flags", nargs=argparse.REMAINDER, help="Megatron-LM flags, as pretrain_gpt.py takes them"
    )


def megatron_loader(flags: list[str]) -> Callable[[Callable[[str], None]], TrainConfig]:
    """The config loader `run_train` calls: the flags imported and validated, each logged."""

    def load(log: Callable[[str], None]) -> TrainConfig:
        from meshforge.config.loader import validate_imported
        from meshforge.config.megatron_import import import_megatron

        origins: dict[str, tuple[str, object]] = {}
        log(f"Megatron flags: {len(flags)} words on the command line")
        data = import_megatron(flags, log, origins)
        return validate_imported(data, origins, source="the Megatron flags")

    return load
