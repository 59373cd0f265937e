"""The parsed command line as the loader's inputs: devices, placement parameters and
load options."""

from __future__ import annotations

import argparse

from service.loader import pipeline
from service.loader.devices import Device, discover_devices, parse_size
from service.loader.placement import PlacementParams, make_params


def devices_for(args: argparse.Namespace) -> list[Device]:
    """The devices ``--emulated-devices`` and ``--no-cuda`` name.

    Raises:
        RequestError: a malformed ``--emulated-devices`` declaration.
    """
    return discover_devices(args.emulated_devices, cuda=not args.no_cuda)


def placement_params(args: argparse.Namespace, devices: list[Device]) -> PlacementParams:
    """The placement flags (``-ngl -sm -mg -ts -ot --no-host -lm -lzm``) for ``devices``.

    Raises:
        RequestError: an invalid ``-ngl``, ``-sm``, ``-ts``, ``-lm`` or ``-lzm`` value.
        PlacementError: an invalid ``-ot`` override.
    """
    return make_params(
        [d.default_buffer_type.name for d in devices],
        n_gpu_layers=args.n_gpu_layers,
        split_mode=args.split_mode,
        main_gpu=args.main_gpu,
        tensor_split=args.tensor_split,
        override_tensor=args.override_tensor or [],
        no_host=args.no_host,
        load_mode=args.load_mode,
        lazy_mode=args.lazy_mode,
    )


def load_options(args: argparse.Namespace) -> pipeline.LoadOptions:
    """``--staging-buffers``, ``--staging-size``, ``--check-tensors`` and ``--hash-tensors``.

    Raises:
        RequestError: an invalid ``--staging-size``.
    """
    return pipeline.LoadOptions(
        staging_buffers=args.staging_buffers,
        staging_nbytes=None if args.staging_size is None else parse_size(args.staging_size),
        check_tensors=args.check_tensors,
        hash_tensors=args.hash_tensors,
    )
