"""``lite.CSVLogger``: metrics in a CSV file, one row per value, readable with any tool."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import IO, Any, Mapping

__all__ = ["CSVLogger"]

HEADER = ("step", "name", "value")


class CSVLogger:
    """Write every logged value as a row ``step,name,value`` of one CSV file.

    One row per value (a "long" table) rather than one column per name: a name first logged
    late needs no rewrite of the header, and rows are only ever appended, so a run that fails
    leaves a valid file. ``pandas.read_csv(path).pivot(index="step", columns="name",
    values="value")`` gives the wide table. Values are written with Python's shortest
    round-trip repr, so ``float(row["value"])`` is exactly what was logged. Each row is written
    as it is logged (line-buffered).

    Args:
        path: The file. Its folder is created on the first write (on global rank 0 only).
        append: Keep the rows of an existing file (a resumed run) instead of starting it
            afresh. The same logger reused by a later launch block always appends.
    """

    def __init__(self, path: str | os.PathLike[str], append: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"CSVLogger(path={path!r}): path must be a str or os.PathLike.")
        self.path = Path(path)
        self.append = append
        self._file: IO[str] | None = None
        self._writer: Any = None

    def _open(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = self.append and self.path.exists() and self.path.stat().st_size > 0
        # Line-buffered: each row reaches the file as it is logged, so `tail -f` follows the
        # run and a killed process loses nothing; metrics are logged seldom enough for that.
        self._file = open(self.path, "a" if keep else "w", newline="", buffering=1)  # noqa: SIM115 - closed by finalize
        self._writer = csv.writer(self._file)
        if not keep:
            self._writer.writerow(HEADER)
        self.append = True  # whatever comes later continues this file
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        writer = self._writer or self._open()
        for name, value in metrics.items():
            writer.writerow((step, name, repr(float(value))))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None

    def __repr__(self) -> str:
        return f"CSVLogger({str(self.path)!r})"
