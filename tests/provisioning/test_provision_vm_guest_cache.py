"""The test VMs' bytecode cache for modules imported from zips (tests/fixtures/vm_guest/).

Run here in a Python of the guest's minor version's kind: each case is a fresh interpreter that loads the
cache module, counts the compilations it passes on, and imports a module from a zip as Ansible's AnsiballZ
does (a zip of a new name each run).
"""

from __future__ import annotations

import json
import marshal
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE_MODULE = Path(__file__).parents[1] / "fixtures" / "vm_guest" / "sarv_zipimport_cache.py"

_PROBE = """
import importlib.util, json, sys, traceback
spec = importlib.util.spec_from_file_location("sarv_zipimport_cache", sys.argv[1])
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)
cache.CACHE_DIR = sys.argv[2]
compiled = []
original = cache._compile_source
cache._compile_source = lambda path, source: compiled.append(path) or original(path, source)
sys.path.insert(0, sys.argv[3])
import sarvprobe.mod as mod
try:
    mod.fail()
except ValueError:
    where = traceback.extract_tb(sys.exc_info()[2])[-1].filename
print(json.dumps({"value": mod.VALUE, "compiled": compiled, "traceback_file": where}))
"""


def _zip(path: Path, value: int) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("sarvprobe/__init__.py", "")
        z.writestr("sarvprobe/mod.py", f"VALUE = {value}\n\ndef fail():\n    raise ValueError(VALUE)\n")
    return path


def _sources(archive: Path) -> list[str]:
    """The paths zipimport compiles from ``archive``: the package's ``__init__``, then ``mod``."""
    return [str(archive / "sarvprobe" / f) for f in ("__init__.py", "mod.py")]


def _import(cache_dir: Path, archive: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(CACHE_MODULE), str(cache_dir), str(archive)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_a_second_import_of_the_same_source_compiles_nothing_and_names_its_own_zip(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _import(cache, _zip(tmp_path / "a.zip", 1))
    assert first["value"] == 1
    # The package's __init__ and mod, each once: zipimport compiles a module twice per import (once for
    # its file name), and the second time it comes from the cache.
    assert first["compiled"] == _sources(tmp_path / "a.zip")
    assert len(list(cache.iterdir())) == 2
    assert (cache.stat().st_mode & 0o777) == 0o700

    second = _import(cache, _zip(tmp_path / "b.zip", 1))
    assert second["value"] == 1
    assert second["compiled"] == []
    # Code from the cache names the zip it was imported from this time, not the first one.
    assert second["traceback_file"] == str(tmp_path / "b.zip" / "sarvprobe" / "mod.py")


def test_a_changed_source_is_compiled_anew(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _import(cache, _zip(tmp_path / "a.zip", 1))
    changed = _import(cache, _zip(tmp_path / "b.zip", 2))
    assert changed["value"] == 2
    assert changed["compiled"] == [str(tmp_path / "b.zip" / "sarvprobe" / "mod.py")]


def test_a_cache_that_cannot_be_written_or_read_is_compiled_around(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    result = _import(blocked, _zip(tmp_path / "a.zip", 3))
    assert result["value"] == 3
    # Each compiled once: zipimport's second ask for the code comes from this process's own copy.
    assert result["compiled"] == _sources(tmp_path / "a.zip")

    cache = tmp_path / "cache"
    _import(cache, _zip(tmp_path / "b.zip", 4))
    # Entries that are not bytecode, or bytecode of something other than code.
    for garbage, name in ((b"not bytecode", "c"), (marshal.dumps(42), "e")):
        for entry in cache.iterdir():
            entry.write_bytes(garbage)
        result = _import(cache, _zip(tmp_path / f"{name}.zip", 4))
        assert result["value"] == 4
        # Each compiled once more, and the cache written anew for the next import.
        assert len(result["compiled"]) == 2  # type: ignore[arg-type]
        assert _import(cache, _zip(tmp_path / f"{name}2.zip", 4))["compiled"] == []
