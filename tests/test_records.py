"""bench/records.sh in a temporary git repository: raw records go to the orphan branch `results` and come back,
main's tree and checkout untouched, .gitignore keeping them out of main; `flame-llm report` rebuilds a paired and a
load report from restored records (fixtures copied from bench/results, see tests/fixtures/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest

from bench import cli

ROOT = Path(__file__).parent.parent
FIXTURES = ROOT / "tests/fixtures/records"
ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=ENV, check=True, capture_output=True, text=True).stdout.strip()


def records(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", "bench/records.sh", *args], cwd=repo, env=ENV, capture_output=True, text=True)
    assert not check or p.returncode == 0, p.stderr
    return p


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository holding records.sh, main's .gitignore and two runs (raw records and kept reports) on main."""
    r = tmp_path / "repo"
    (r / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench/records.sh", r / "bench/records.sh")
    shutil.copy(ROOT / ".gitignore", r / ".gitignore")
    for run in ("pairs", "load"):
        shutil.copytree(FIXTURES / run, r / "bench/results" / run)
    git(r, "init", "-q", "-b", "main")
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "main")
    return r


def raw_of(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and ("raw" in p.parts or "logs" in p.parts)
    }


def test_main_ignores_raw_records_and_keeps_reports(repo):
    tracked = git(repo, "ls-files").split()
    assert "bench/results/pairs/report.json" in tracked and "bench/results/load/load-report.json" in tracked
    assert not [p for p in tracked if "/raw/" in p or "/logs/" in p]
    (repo / "bench/results/x.json.gz").write_bytes(b"")
    (repo / "bench/results/x.log").write_text("")
    (repo / "bench/results/load/logs.tar.xz").write_bytes(b"")
    assert git(repo, "status", "--porcelain") == ""  # new raw records are not even candidates


def test_commit_list_restore_round_trip(repo):
    head, status = git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain")
    want = {run: raw_of(repo / "bench/results" / run) for run in ("pairs", "load")}
    assert want["pairs"] and want["load"]
    assert "2 files" in records(repo, "commit", "bench/results/pairs").stdout
    first = git(repo, "rev-parse", "results")
    assert git(repo, "rev-list", "--parents", "-n1", "results").split() == [first]  # an orphan: no parent
    records(repo, "commit", str(repo / "bench/results/load"))  # an absolute path works too
    assert git(repo, "rev-list", "--parents", "-n1", "results").split()[1:] == [first]
    assert "unchanged" in records(repo, "commit", "bench/results/load").stdout
    assert git(repo, "rev-parse", "HEAD") == head and git(repo, "status", "--porcelain") == status
    assert git(repo, "branch", "--show-current") == "main"

    listed = records(repo, "list").stdout.splitlines()
    assert [line.split("\t")[:2] for line in listed] == [
        ["bench/results/load", "4 files"],
        ["bench/results/pairs", "2 files"],
    ]
    assert len(records(repo, "list", "bench/results/pairs").stdout.splitlines()) == 2

    for run in ("pairs", "load"):
        shutil.rmtree(repo / "bench/results" / run / "raw")
    shutil.rmtree(repo / "bench/results/load/logs")
    assert "2 files" in records(repo, "restore", "bench/results/pairs").stdout
    assert raw_of(repo / "bench/results/pairs") == want["pairs"] and not raw_of(repo / "bench/results/load")
    records(repo, "restore")  # everything
    assert {run: raw_of(repo / "bench/results" / run) for run in want} == want
    assert git(repo, "status", "--porcelain") == status


def test_a_clone_of_main_alone_carries_the_attached_records(repo, tmp_path):
    """Only main lands (a clone of main has no `results` branch): `attach` joins the records to main's history
    with main's tree kept, so list, restore and a later commit find them from HEAD."""
    want = raw_of(repo / "bench/results/pairs")
    records(repo, "commit", "bench/results/pairs")
    tree = git(repo, "rev-parse", "HEAD^{tree}")
    assert "carries results" in records(repo, "attach").stdout
    assert git(repo, "rev-parse", "HEAD^{tree}") == tree and git(repo, "status", "--porcelain") == ""
    assert "already in HEAD's history" in records(repo, "attach").stdout
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--branch", "main", str(repo), str(clone)], check=True)
    assert "results" not in git(clone, "branch", "--list", "results")
    assert not raw_of(clone / "bench/results/pairs")
    assert [line.split("\t")[:2] for line in records(clone, "list").stdout.splitlines()] == [
        ["bench/results/pairs", "2 files"]]
    records(clone, "restore")
    assert raw_of(clone / "bench/results/pairs") == want
    shutil.copytree(repo / "bench/results/load", clone / "bench/results/load", dirs_exist_ok=True)
    records(clone, "commit", "bench/results/load")  # appends to the attached records: a branch again
    assert git(clone, "rev-list", "--parents", "-n1", "results").split()[1:] == [git(repo, "rev-parse", "results")]


def test_errors_name_the_cause(repo, tmp_path):
    assert "no branch results and no records: merge" in records(repo, "restore", check=False).stderr
    assert "no branch results" in records(repo, "list", check=False).stderr
    assert "no branch results to attach" in records(repo, "attach", check=False).stderr
    p = records(repo, "commit", "bench/results/none", check=False)
    assert p.returncode == 2 and "no directory bench/results/none" in p.stderr
    (repo / "bench/elsewhere").mkdir()
    assert "not below bench/results" in records(repo, "commit", "bench/elsewhere", check=False).stderr
    (repo / "bench/results/empty").mkdir()
    assert (
        "no raw records under bench/results/empty" in records(repo, "commit", "bench/results/empty", check=False).stderr
    )
    records(repo, "commit", "bench/results/pairs")
    assert "nothing under bench/results/nope" in records(repo, "restore", "bench/results/nope", check=False).stderr
    assert records(repo, "nonsense", check=False).returncode == 2


def test_report_rebuilt_from_restored_records(repo, tmp_path, capsys):
    records(repo, "commit", "bench/results")
    for run in ("pairs", "load"):
        shutil.rmtree(repo / "bench/results" / run / "raw")
    records(repo, "restore")
    pairs, load = repo / "bench/results/pairs", repo / "bench/results/load"

    assert cli.report(Namespace(raw_dir=str(pairs), out=str(tmp_path / "p"), systems="")) == 0
    kept, got = (json.loads(p.read_text())["traces"] for p in (pairs / "report.json", tmp_path / "p/report.json"))
    assert kept.keys() == got.keys() == {"no-reuse"}
    got, kept = got["no-reuse"], kept["no-reuse"]  # the figures kept then; reports gained fields since (provenance)
    assert got["systems"] == kept["systems"] == ["engine", "flame"]
    for lab in kept["systems"]:
        g, k_ = got["stats"][lab], kept["stats"][lab]
        assert {k: g[k] for k in k_ if k != "per_run"} == {k: v for k, v in k_.items() if k != "per_run"}, lab
        assert [(r["req_s"], r["burst_s"]) for r in g["per_run"]] == [(r["req_s"], r["burst_s"]) for r in k_["per_run"]]
    assert [{k: g[k] for k in k_} for g, k_ in zip(got["ratios"], kept["ratios"])] == kept["ratios"] != []
    assert (tmp_path / "p/report.md").is_file()

    assert cli.report(Namespace(raw_dir=str(load), out=str(tmp_path / "l"), systems="")) == 0
    kept, got = (json.loads(p.read_text()) for p in (load / "load-report.json", tmp_path / "l/load-report.json"))
    assert [r["system"] for r in got] == [r["system"] for r in kept] == ["flame", "engine"]
    for k, g in zip(kept, got):
        assert [(w["offered_rps"], w["completed"], w["ttft_s"]) for w in g["windows"]] == [
            (w["offered_rps"], w["completed"], w["ttft_s"]) for w in k["windows"]
        ]
    assert "Sustained load" in (tmp_path / "l/load-report.md").read_text()
    assert "Sustained load" in capsys.readouterr().out
