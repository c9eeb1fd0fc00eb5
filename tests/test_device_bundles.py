"""bench/device_bundles.sh check, on CPU: a call carries 64 MiB at most (the tree that travels with every call and
one chunk), so before a block of device calls the check names each chunk that no longer fits beside the tree."""
import os
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 64 * 1024 * 1024


def _repo(tmp_path, tree_bytes: int):
    (tmp_path / "bench").mkdir()
    shutil.copy(os.path.join(REPO, "bench", "device_bundles.sh"), tmp_path / "bench")
    (tmp_path / "records.bin").write_bytes(b"r" * tree_bytes)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("/.bundle*/\n")  # as device_bundles.sh leaves it
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    return tmp_path


def _check(root) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/device_bundles.sh", "check"], cwd=root, capture_output=True, text=True,
                          timeout=60)


def _chunk(root, k: int, size: int) -> None:
    d = root / f".bundle{k}"
    d.mkdir()
    with open(d / f"chunk_{k}", "wb") as f:  # sparse: the check reads the apparent size, as the device tool does
        f.truncate(size)


def test_check_passes_when_each_chunk_fits_beside_the_tree(tmp_path):
    root = _repo(tmp_path, 1_000_000)
    _chunk(root, 0, 40_000_000)
    _chunk(root, 1, 5_000_000)
    p = _check(root)
    assert p.returncode == 0 and "2 chunks, each fits" in p.stdout, p.stdout + p.stderr


def test_check_names_the_chunk_that_no_longer_fits(tmp_path):
    root = _repo(tmp_path, 2_000_000)
    _chunk(root, 0, LIMIT - 3_000_000)  # fits
    _chunk(root, 1, LIMIT - 1_000_000)  # the tree grew past what this chunk left room for
    p = _check(root)
    assert p.returncode == 1, p.stdout + p.stderr
    assert ".bundle1:" in p.stdout and ".bundle0:" not in p.stdout
    assert str(LIMIT) in p.stdout and "bash bench/device_bundles.sh" in p.stdout


def test_check_without_chunks_says_how_to_make_them(tmp_path):
    p = _check(_repo(tmp_path, 10))
    assert p.returncode == 1 and "no chunks" in p.stdout
