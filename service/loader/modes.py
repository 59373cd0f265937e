"""The values of the placement flags that name a mode (``-sm``, ``-lm``, ``-lzm``), with
their spellings: what the command line's choices and the API schema's enums are made of.

A module of their own, needing nothing but :mod:`service.errors`, so that building the
command line's parser does not import the planner (:mod:`service.loader.placement`
re-exports them)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Self

from service.errors import RequestError, clip


class FlagValue(StrEnum):
    """The values of one placement flag: each member's value is its canonical name (the
    name responses report), and :meth:`aliases` maps other accepted spellings to it.

    The CLI's choices and the API schema's enums are both :meth:`spellings`, so a value
    one accepts the other accepts too.
    """

    @classmethod
    def flag(cls) -> str:
        """What the flag is called in messages (``load mode``)."""
        raise NotImplementedError

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        """Other spellings -> canonical names."""
        return {}

    @classmethod
    def spellings(cls) -> tuple[str, ...]:
        """Every accepted spelling: the canonical names in order, then the aliases."""
        return (*(m.value for m in cls), *cls.aliases())

    @classmethod
    def parse(cls, value: str) -> Self:
        """The member spelled ``value`` (a canonical name or an alias).

        Raises:
            RequestError: any other value; the message lists the accepted spellings.
        """
        try:
            return cls(cls.aliases().get(value, value))
        except ValueError:
            known = ", ".join(cls.spellings())
            raise RequestError(f"unknown {cls.flag()} '{clip(str(value), 50)}' (expected one of: {known})") from None


class SplitMode(FlagValue):
    """How layers spread over several devices (``-sm``)."""

    NONE = "none"
    LAYER = "layer"
    ROW = "row"

    @classmethod
    def flag(cls) -> str:
        return "split mode"


class LoadMode(FlagValue):
    """How tensor data gets into memory (llama.cpp's ``-lm/--load-mode``); ``dio`` is
    llama.cpp's spelling of ``direct-io``."""

    AUTO = "auto"
    NONE = "none"
    MMAP = "mmap"
    MLOCK = "mlock"
    MMAP_MLOCK = "mmap+mlock"
    DIRECT_IO = "direct-io"

    @classmethod
    def flag(cls) -> str:
        return "load mode"

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        return {"dio": cls.DIRECT_IO.value}

    @classmethod
    def from_switches(cls, *, use_mmap: bool = True, use_mlock: bool = False, direct_io: bool = False) -> LoadMode:
        """The load mode that llama.cpp's former switches (``--mmap/--no-mmap``,
        ``--mlock``, ``--direct-io``; mapping on by default) stand for, combined as its
        Python binding turns ``use_mmap``/``use_mlock`` into a load mode: both ->
        ``mmap+mlock``, mlock alone -> ``mlock``, mmap alone -> ``mmap``, neither ->
        ``none``; direct I/O takes precedence over mapping."""
        if direct_io:
            return cls.DIRECT_IO
        if use_mlock:
            return cls.MMAP_MLOCK if use_mmap else cls.MLOCK
        return cls.MMAP if use_mmap else cls.NONE

    @property
    def maps(self) -> bool | None:
        """True when the mode maps the file, False when it reads, None for ``auto``."""
        if self is LoadMode.AUTO:
            return None
        return self in (LoadMode.MMAP, LoadMode.MMAP_MLOCK)


class LazyMode(FlagValue):
    """On-demand reading of the tensors llama.cpp marks for it (``-lzm/--lazy-mode``):
    ``off`` keeps them resident, ``auto`` reads those larger than 4 GiB on demand, ``on``
    all of them."""

    OFF = "off"
    AUTO = "auto"
    ON = "on"

    @classmethod
    def flag(cls) -> str:
        return "lazy mode"
