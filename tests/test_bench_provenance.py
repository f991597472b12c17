"""What a benchmark's JSON says about the code it measured (bench/common.machine): the tree's hash names the files
that ran even where the git metadata beside them is stale, as on the lent GPU machine."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.common import git_tree


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_the_tree_hash_names_the_files_that_ran_not_head(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("*.log\n")
    (tmp_path / "a.py").write_text("one\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "first")
    assert git_tree(tmp_path) == _git(tmp_path, "rev-parse", "HEAD^{tree}")

    (tmp_path / "a.py").write_text("two\n")  # the files of a later commit, HEAD still the first's
    (tmp_path / "b.py").write_text("new\n")
    (tmp_path / "out.log").write_text("ignored\n")
    status = _git(tmp_path, "status", "--porcelain")
    ran = git_tree(tmp_path)
    assert ran != _git(tmp_path, "rev-parse", "HEAD^{tree}")
    assert _git(tmp_path, "status", "--porcelain") == status  # the checkout's index is left alone

    _git(tmp_path, "add", "a.py", "b.py")
    _git(tmp_path, "commit", "-q", "-m", "second")
    assert ran == _git(tmp_path, "rev-parse", "HEAD^{tree}")
