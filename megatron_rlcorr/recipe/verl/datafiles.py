"""What the import reads from the run's data files when they are on this machine: their
data_source values (which reward verl would use) and their number of rows (how many steps
trainer.total_epochs is). A file that is missing or unreadable gives nothing, never an error: the
report then says what to set by hand."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .values import Bad, str_list


def data_sources(files: Any, max_rows: int = 100_000) -> set[str]:
    """The data_source values of the files (parquet, or JSONL's first `max_rows` lines); empty
    when a file is missing, unreadable or has no data_source."""
    try:
        paths = [Path(f) for f in str_list(files)]
    except Bad:
        return set()
    found: set[str] = set()
    try:
        for path in paths:
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                column = pq.read_table(path, columns=["data_source"]).column("data_source")
                found |= {str(v) for v in column.unique().to_pylist()}
            elif path.suffix in (".jsonl", ".json"):
                with path.open() as lines:
                    found |= {str(json.loads(line).get("data_source")) for _, line in zip(range(max_rows), lines)
                              if line.strip()}
            else:
                return set()
    except (OSError, ValueError, KeyError, AttributeError, ImportError):
        return set()
    return found


def count_rows(files: Any) -> tuple[int | None, str]:
    """(rows of all the files, '') or (None, why not): parquet rows from the file's metadata,
    JSONL rows as non-blank lines (datasets.py's rows)."""
    try:
        paths = [Path(f) for f in str_list(files)]
    except Bad:
        return None, "data.train_files is not a file path or a list of them"
    rows = 0
    for path in paths:
        try:
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                rows += pq.ParquetFile(path).metadata.num_rows
            elif path.suffix in (".jsonl", ".json"):
                with path.open("rb") as lines:
                    rows += sum(1 for line in lines if line.strip())
            else:
                return None, f"{path} is neither parquet nor JSONL"
        except FileNotFoundError:
            return None, f"{path} is not on this machine"
        except (OSError, ValueError, ImportError) as err:
            return None, f"{path} cannot be read here ({err})"
    return rows, ""
