"""CSVTracker: `metrics.csv` (one row per log call, a `step` column) and `hparams.yaml`, one directory per run.

>>> learn.fit(3, cbs=Tracker("csv", dir="runs", project="digits"))
>>> pd.read_csv(next(Path("runs/digits").glob("*/metrics.csv")))
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from .base import FileTracker


class CSVTracker(FileTracker):
    """Append rows to `dir/project/run_name/metrics.csv`; hyperparameters go to `hparams.yaml`.

    Columns are `step` and every name logged so far; a new name rewrites the file with the
    wider header (earlier rows leave it empty). Each row is written through at once, so the
    file is complete up to the last logged step. A resumed run drops rows logged after the
    resume point (a crashed run's tail) and appends.

    >>> learn.fit(1, cbs=Tracker(CSVTracker(run_name="baseline", dir="runs")))
    """

    name = "csv"
    marker = "metrics.csv"

    @property
    def file(self) -> Path:
        return self.log_dir / "metrics.csv"

    def start(self, step: int) -> None:
        super().start(step)
        self.columns: list[str] = ["step"]
        if self.resumed and self.file.exists():
            self.columns, rows = self._read()
            self._rewrite([r for r in rows if int(r["step"]) <= step])

    def store_init_configuration(self, config: dict[str, Any]) -> None:
        import yaml  # here, not at import: `import cadence` stays light

        (self.log_dir / "hparams.yaml").write_text(yaml.safe_dump(config, sort_keys=True))

    def log(self, values: dict[str, float], step: int) -> None:
        new = [k for k in values if k not in self.columns]
        if new or not self.file.exists():
            rows = self._read()[1] if self.file.exists() else []
            self.columns += new
            self._rewrite(rows)
        with self.file.open("a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow({"step": step, **values})

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        with self.file.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        return list(reader.fieldnames or ["step"]), rows

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.file.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.file)
