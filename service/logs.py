"""Log records in one format for hoist's loggers and uvicorn's (server and access logs):
text lines or JSON lines (``HOIST_LOG_FORMAT``), each with an RFC 3339 UTC timestamp, on
standard error, never wrapped.

A load job's records carry its ``job_id`` and ``model``: :func:`bind_load` sets them for
the job's task (and the threads it starts with :func:`asyncio.to_thread`), and
:class:`LoadContext` adds them to every record logged there; a record given them with
``extra=`` keeps its own. Messages are written as logged, so llama.cpp's report lines
(``  CPU_Mapped model buffer size =   235.16 MiB``) keep their spacing.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from contextvars import ContextVar
from enum import StrEnum
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter


class LogFormat(StrEnum):
    """How log records are written: ``text`` lines or ``json`` lines."""

    TEXT = "text"
    JSON = "json"


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""Level names the CLI and :func:`log_config` take."""

CONTEXT_FIELDS = ("job_id", "model")
"""Record attributes that tie a record to a load job."""

_LOAD: ContextVar[tuple[str, str] | None] = ContextVar("hoist_load", default=None)


def bind_load(job_id: str, model: str) -> None:
    """Tag the records logged from now on in the current context (a load job's task)
    with ``job_id`` and ``model``; a task started afterwards from it inherits them."""
    _LOAD.set((job_id, model))


class LoadContext(logging.Filter):
    """A handler filter that adds the bound load's ``job_id`` and ``model`` (see
    :func:`bind_load`) to each record that does not carry them already; it never drops
    a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        load = _LOAD.get()
        if load is not None:
            for name, value in zip(CONTEXT_FIELDS, load, strict=True):
                if getattr(record, name, None) is None:
                    setattr(record, name, value)
        return True


class StderrHandler(logging.Handler):
    """Writes each record as a line to whatever ``sys.stderr`` is when it is emitted (as
    logging's last-resort handler does), so that a redirected or replaced standard error
    is followed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def utc_time(record: logging.LogRecord) -> str:
    """The record's time, RFC 3339 in UTC with milliseconds: ``2026-09-01T10:00:03.512Z``."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(record.created))}.{int(record.msecs):03d}Z"


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def escape_controls(text: str) -> str:
    """``text`` with its control characters but tab written as ``\\xNN``, so that a
    message (a request path, say) cannot end its line and forge the next."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger> [<job_id> <model>]: <message>`` (the bracket only for a
    load's records; control characters in the message escaped, see
    :func:`escape_controls`), then the traceback, if any, on the lines after."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_time(record)

    def format(self, record: logging.LogRecord) -> str:
        context = [str(v) for v in (getattr(record, name, None) for name in CONTEXT_FIELDS) if v is not None]
        where = f"{record.name} [{' '.join(context)}]" if context else record.name
        line = f"{self.formatTime(record)} {record.levelname:<7} {escape_controls(where)}: "
        line += escape_controls(record.getMessage())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


_ACCESS_FIELDS = ("client_addr", "method", "path", "http_version", "status_code")
"""The arguments of uvicorn's access log record, in order."""


class JsonFormatter(_JsonFormatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``message``, then the
    record's extra fields (``job_id`` and ``model`` for a load; ``method``, ``path``,
    ``status_code``, ``client_addr`` and ``http_version`` for an access log record) and
    ``exc_info`` for a traceback."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_time(record)

    def __init__(self) -> None:
        super().__init__(
            ["asctime", "levelname", "name", "message"],
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            # uvicorn adds an ANSI-coloured copy of some messages
            reserved_attrs=[*RESERVED_ATTRS, "color_message"],
        )

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            log_data.update(zip(_ACCESS_FIELDS, record.args, strict=True))


def log_config(fmt: LogFormat | str = LogFormat.TEXT, level: str = "info") -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` configuration (as uvicorn's ``log_config``
    takes it) that sends the records of every logger, uvicorn's server and access logs
    included, through one handler on standard error in format ``fmt``, at ``level``
    (one of :data:`LOG_LEVELS`) and above.

    Raises:
        ValueError: an unknown format or level.
    """
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r} (one of {', '.join(LOG_LEVELS)})")
    name = level.upper()
    factory = f"{__name__}.{'JsonFormatter' if LogFormat(fmt) is LogFormat.JSON else 'TextFormatter'}"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"load": {"()": f"{__name__}.LoadContext"}},
        "formatters": {"default": {"()": factory}},
        "handlers": {"stderr": {"()": f"{__name__}.StderrHandler", "formatter": "default", "filters": ["load"]}},
        "loggers": {
            "uvicorn": {"handlers": [], "level": name, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": name, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": name, "propagate": True},
            "httpx": {"level": "WARNING"},
        },
        "root": {"handlers": ["stderr"], "level": name},
    }


def cli_handler(console: Any) -> logging.Handler:
    """The handler of the CLI's commands: rich's, through ``console`` (a
    :class:`rich.console.Console`, so that records never garble its progress bars) when
    that is a terminal; else a plain one in the text format, whose lines are never
    wrapped."""
    if console.is_terminal:
        from rich.logging import RichHandler

        return RichHandler(console=console, show_time=False, show_path=False, markup=False)
    handler = StderrHandler()
    handler.setFormatter(TextFormatter())
    handler.addFilter(LoadContext())
    return handler
