"""The hash of tqsdeploy's own sources that every cache key, checkpoint and frontier ledger carries: it must cover
every source of the distribution's packages, wherever this module sits (it once hashed no file at all, so a cache
survived any change of the code)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import graph_ops
import runtimes
import tiers
import tqsdeploy
from tqsdeploy.encoding import checkpoints


def test_sources_are_every_python_file_of_every_package():
    found = checkpoints.sources()
    for package in (graph_ops, runtimes, tiers, tqsdeploy):
        folder = Path(package.__file__).resolve().parent
        files = sorted(folder.rglob("*.py"))
        assert files and all(found[f"{folder.name}/{f.relative_to(folder).as_posix()}"] == f for f in files)
    assert len(found) == sum(
        len(list(Path(p.__file__).parent.rglob("*.py"))) for p in (graph_ops, runtimes, tiers, tqsdeploy)
    )
    assert "tiers/hessian.py" in found and "tqsdeploy/encoding/checkpoints.py" in found
    assert checkpoints.code_hash() != hashlib.sha256().hexdigest()  # not the hash of nothing


def test_the_hash_changes_with_a_sources_bytes_and_name(monkeypatch, tmp_path):
    source = tmp_path / "module.py"
    source.write_text("A = 1\n")

    def hashed(files):
        monkeypatch.setattr(checkpoints, "sources", lambda: files)
        checkpoints.code_hash.cache_clear()
        return checkpoints.code_hash()

    try:
        first = hashed({"pkg/module.py": source})
        assert hashed({"pkg/module.py": source}) == first
        source.write_text("A = 2\n")
        changed = hashed({"pkg/module.py": source})
        assert changed != first
        assert hashed({"pkg/moved.py": source}) != changed
    finally:
        checkpoints.code_hash.cache_clear()
