"""Which kept-warm workers may serve another run: none whose code changed on disk."""

from __future__ import annotations

import importlib
import os
import sys
import time

from baton.workers.warm import changed_code


def test_a_module_changed_after_the_start_is_named(tmp_path, monkeypatch):
    (tmp_path / "user_model_for_warm.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    began = time.time() + 1  # as if the process had started after the file was written
    importlib.import_module("user_model_for_warm")
    try:
        assert changed_code(began) is None  # torch, ray, the standard library: not looked at
        later = began + 5
        os.utime(tmp_path / "user_model_for_warm.py", (later, later))
        assert changed_code(began) == "user_model_for_warm"
    finally:
        sys.modules.pop("user_model_for_warm")
