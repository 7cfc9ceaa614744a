"""A new sqlite MLflow store from a migrated, empty copy instead of MLflow's migrations.

MLflow makes a new sqlite store's tables by running every schema migration it has had (68 in
MLflow 3.17), in every new folder a user runs in. The
result is the same each time for one MLflow version: the tables, the schema's revision, and
one row that names no path (the default workspace). baton runs those migrations once per MLflow
version, into a cached file, and starts each new store as a copy of it; MLflow then opens the
copy as any store: it checks the schema's revision against its own and adds the Default
experiment, whose artifact folder is the one path in a store, itself.

Measured on the 2-core machine (`python benchmarks/mlflow_store.py --rounds 5`: the store's
making alone, in fresh processes with MLflow imported, medians of 5): 1.63 s of CPU through
the migrations, 0.71 s from the copy (the rest is MLflow checking the revision and adding the
experiment).

Anything unexpected (no cache folder, a read-only home, a damaged template) falls back to
MLflow's own way: the template is an optimisation, never a requirement.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Optional


def cached(folder: Optional[Path] = None) -> Optional[Path]:
    """This MLflow version's migrated, empty store, made now if it is not cached yet; None
    when it cannot be made (MLflow then migrates the new store itself)."""
    import mlflow

    folder = folder or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "baton"
    path = folder / f"mlflow-{mlflow.__version__}-empty.db"
    if path.is_file():
        return path
    part = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        import sqlalchemy
        from mlflow.store.db.utils import _initialize_tables  # what a new SqlAlchemyStore runs

        folder.mkdir(parents=True, exist_ok=True)
        engine = sqlalchemy.create_engine(f"sqlite:///{part}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(part, path)  # whole or not there: another run may be making it too
        return path
    except Exception:  # noqa: BLE001 - MLflow makes the store itself
        with contextlib.suppress(OSError):
            part.unlink()
        return None


def open_new(db: Path, template: Optional[Path]) -> None:
    """Make the new sqlite store `db` (its tables and Default experiment), from `template`
    when it is a sound sqlite database; a damaged one is removed and MLflow migrates `db`."""
    from mlflow.tracking import MlflowClient

    if template is not None and _sound(template):
        shutil.copyfile(template, db)
    elif template is not None:
        with contextlib.suppress(OSError):
            template.unlink()
    MlflowClient(tracking_uri=f"sqlite:///{db}").get_experiment("0")


def _sound(template: Path) -> bool:
    """A whole sqlite database with MLflow's schema revision in it (which revision: MLflow
    checks that on opening the copy, against its own)."""
    try:
        with contextlib.closing(sqlite3.connect(f"{template.as_uri()}?mode=ro", uri=True)) as c:
            return (c.execute("PRAGMA quick_check").fetchall() == [("ok",)]
                    and len(c.execute("SELECT version_num FROM alembic_version").fetchall()) == 1)
    except sqlite3.Error:
        return False
