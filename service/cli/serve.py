"""``hoist serve``, and the checks made before serving: the address's exposure without a
token, and whether the port can be bound."""

from __future__ import annotations

import argparse
import gc
import logging
import logging.config
from pathlib import Path
from typing import Any


def settings_for(args: argparse.Namespace, models_dir: str | None) -> Any:
    """The service's :class:`~service.api.settings.Settings`, with the command line's
    devices, models directory and ``--allow-unauthenticated`` over the environment.

    Raises:
        pydantic.ValidationError: an invalid setting.
    """
    from service.api.settings import Settings

    overrides: dict[str, Any] = {"emulated_devices": args.emulated_devices, "cuda": not args.no_cuda}
    if models_dir is not None:
        overrides["models_dir"] = Path(models_dir)
    if getattr(args, "allow_unauthenticated", False):
        overrides["allow_unauthenticated"] = True
    return Settings(**overrides)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (``127.0.0.1``,
    ``::1``, ``localhost``); an unresolvable name counts as not loopback."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_exposure(host: str, settings: Any) -> None:
    """Refuse to serve without a token on an address other hosts can reach, unless the
    settings say so explicitly.

    Raises:
        RequestError: no token, not loopback, and ``allow_unauthenticated`` not set.
    """
    from service.errors import RequestError

    if settings.token() is None and not settings.allow_unauthenticated and not is_loopback(host):
        raise RequestError(
            f"refusing to serve on {host} without an API token: anyone who reaches it could load and unload models",
            hint="set HOIST_API_TOKEN or HOIST_API_TOKEN_FILE, or, if the network in front of hoist is trusted, "
            "pass --allow-unauthenticated (or set HOIST_ALLOW_UNAUTHENTICATED=1)",
        )


def check_port_free(host: str, port: int) -> None:
    """Raise RequestError when ``host:port`` cannot be bound (in use, or not ours)."""
    import socket

    from service.errors import RequestError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise RequestError(f"cannot resolve host '{host}': {exc}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise RequestError(
                f"cannot listen on {host}:{port}: {exc.strerror}", hint="choose another port with --port"
            ) from exc


def cmd_serve(args: argparse.Namespace) -> int:
    """``hoist serve``: run the HTTP service until stopped.

    The cyclic garbage collector is paused while the libraries are imported and the app
    is built (they make a great many long-lived objects and almost no garbage, and its
    passes over them took a tenth of the start); what they made is then frozen out of
    its later passes (:func:`gc.freeze`), and it runs as usual while serving."""
    gc.disable()
    try:
        import uvicorn

        from service.api.app import create_app
        from service.api.server import raise_open_files_limit, server_config
        from service.logs import log_config

        settings = settings_for(args, args.models_dir)
        logging.config.dictConfig(log_config(settings.log_format, args.log_level))  # before anything logs
        check_exposure(args.host, settings)
        # uvicorn sets its own loggers' level; hoist's follow the same flag
        logging.getLogger("service").setLevel(args.log_level.upper())
        raise_open_files_limit()
        app = create_app(settings)
        check_port_free(args.host, args.port)
        server = uvicorn.Server(server_config(app, settings, host=args.host, port=args.port, log_level=args.log_level))
    finally:
        gc.freeze()
        gc.enable()
    server.run()
    return 0
