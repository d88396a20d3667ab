#!/usr/bin/env python
"""Put one megatron-core release into CACHE for `make test-compat`; print its PYTHONPATH.

    python scripts/megatron_core_release.py 0.19.0 .cache

Releases up to 0.16 install for this Python with pip (`--target`, no dependencies). From 0.17
on, megatron-core's wheels require Python 3.12, so the release's wheel is downloaded for 3.12
and unpacked: its Python modules run on 3.11 (only the dataset helper it compiles is for 3.12,
and the Megatron tests do not load it). From 0.18 on, megatron-core imports `triton` when it is
imported (its MoE kernels), so TRITON goes into the cache too. Each goes into its own folder,
made once; the printed PYTHONPATH puts them before the installed megatron-core.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

TRITON = "3.9.0"  # imported, never run, by megatron-core 0.18 on in the CPU tests


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def _fetch(version: str, target: str) -> None:
    """megatron-core `version` into the empty folder `target`."""
    if _release(version) < (0, 17):
        _pip("install", "--no-deps", "--target", target, f"megatron-core=={version}")
        return
    with tempfile.TemporaryDirectory() as download:
        _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--dest", download,
             f"megatron-core=={version}")
        (wheel,) = glob.glob(os.path.join(download, "*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)


def _cached(path: str, fill) -> str:
    """`path`, filled by `fill(tmp)` into a temporary sibling first, so that an interrupted run
    leaves no half-made folder behind."""
    if not os.path.isdir(path):
        partial = f"{path}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            fill(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.rename(partial, path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="megatron-core release, e.g. 0.15.3")
    parser.add_argument("cache", help="folder for the releases (.cache)")
    args = parser.parse_args()
    if not re.fullmatch(r"\d+\.\d+\.\d+", args.version):
        parser.error(f"version must be a release such as 0.16.1, got {args.version!r}")
    try:
        paths = [_cached(os.path.join(args.cache, f"megatron-core-{args.version}"), lambda t: _fetch(args.version, t))]
    except subprocess.CalledProcessError:
        print(f"megatron-core {args.version}: pip could not install it (no such release here?)", file=sys.stderr)
        return 2
    if _release(args.version) >= (0, 18):
        paths.append(_cached(os.path.join(args.cache, f"triton-{TRITON}"),
                             lambda t: _pip("install", "--no-deps", "--target", t, f"triton=={TRITON}")))
    paths = [os.path.abspath(p) for p in paths]
    found = subprocess.run([sys.executable, "-W", "ignore", "-c", "import megatron.core as m; print(m.__version__)"],
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)}, capture_output=True, text=True)
    # 0.19 appends the git revision of the working directory as a local label (0.19.0+abc1234).
    if found.returncode or found.stdout.strip().split("+")[0] != args.version:
        print(f"megatron-core {args.version} from {paths[0]} does not import as that release: "
              f"{found.stdout.strip() or found.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    print(os.pathsep.join(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
