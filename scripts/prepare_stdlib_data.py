#!/usr/bin/env python
"""Collect the running interpreter's standard-library sources as a code corpus.

Writes ``train.jsonl.gz`` and ``heldout.jsonl.gz`` into ``--out``, one
``{"path": <path relative to the stdlib dir>, "text": <source>}`` object per
line.  The result is deterministic for a given interpreter build:

* files are visited in sorted order of their relative (POSIX) path;
* a file is held out iff ``zlib.crc32(rel_path) % --heldout-mod == 0``
  (~5 % with the default modulus 20), so the split does not depend on which
  other files exist;
* the gzip streams carry no timestamp / file name, so reruns are byte-identical.

Test suites (``test/``, ``tests/``, ``idle_test/`` ...), ``site-packages`` and
``__pycache__`` are skipped.  Sources are decoded from raw bytes (no newline
translation) so the text is exactly what is on disk.

Usage::

    python scripts/prepare_stdlib_data.py --out data/stdlib
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import sysconfig
import tokenize
import zlib
from pathlib import Path

# Directory names that are never descended into.
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
}


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("config-")  # config-3.x-<platform>/ (build helpers)


def is_heldout(rel_path: str, modulus: int = 20) -> bool:
    """Stable split: held out iff crc32 of the relative POSIX path is 0 mod ``modulus``."""
    return zlib.crc32(rel_path.encode("utf-8")) % modulus == 0


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    try:  # honour a PEP 263 coding cookie
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return None


def collect(stdlib: Path) -> list[tuple[str, str]]:
    """Return sorted ``(rel_path, text)`` pairs of the stdlib's .py files."""
    found: list[str] = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if not _skip_dir(d))
        for f in files:
            if f.endswith(".py"):
                found.append(Path(root, f).relative_to(stdlib).as_posix())
    found.sort()
    out: list[tuple[str, str]] = []
    for rel in found:
        raw = (stdlib / rel).read_bytes()
        text = _decode(raw)
        if text is None or not text.strip():
            continue
        out.append((rel, text))
    return out


def write_jsonl_gz(path: Path, records: list[tuple[str, str]]) -> None:
    # mtime=0 and an empty embedded file name keep the output byte-identical across runs.
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        for rel, text in records:
            line = json.dumps({"path": rel, "text": text}, ensure_ascii=False) + "\n"
            gz.write(line.encode("utf-8"))


def read_jsonl_gz(path: str | os.PathLike) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--stdlib", default=None, help="stdlib dir (default: sysconfig.get_paths()['stdlib'])")
    p.add_argument("--heldout-mod", type=int, default=20, help="hold out files with crc32(path) %% MOD == 0 (default 20 = ~5%%)")
    p.add_argument(
        "--max-files",
        type=int,
        default=None,
        help="keep at most N files in total, for quick tests: the first ceil(N/MOD) held-out files "
        "(at least 1) and the first remaining train files, in sorted path order",
    )
    args = p.parse_args(argv)

    stdlib = Path(args.stdlib or sysconfig.get_paths()["stdlib"]).resolve()
    if not stdlib.is_dir():
        p.error(f"stdlib dir not found: {stdlib}")
    records = collect(stdlib)
    train = [r for r in records if not is_heldout(r[0], args.heldout_mod)]
    heldout = [r for r in records if is_heldout(r[0], args.heldout_mod)]

    if args.max_files is not None:
        n_held = max(1, -(-args.max_files // args.heldout_mod))
        n_held = min(n_held, len(heldout), max(args.max_files - 1, 0))
        heldout = heldout[:n_held]
        train = train[: max(args.max_files - n_held, 0)]

    if not train or not heldout:
        p.error(f"empty split (train={len(train)}, heldout={len(heldout)})")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(out / "train.jsonl.gz", train)
    write_jsonl_gz(out / "heldout.jsonl.gz", heldout)

    def nbytes(rs: list[tuple[str, str]]) -> int:
        return sum(len(t.encode("utf-8")) for _, t in rs)

    print(f"stdlib: {stdlib} (Python {sys.version.split()[0]})")
    print(f"train:   {len(train):5d} files  {nbytes(train) / 1e6:7.2f} MB  -> {out / 'train.jsonl.gz'}")
    print(f"heldout: {len(heldout):5d} files  {nbytes(heldout) / 1e6:7.2f} MB  -> {out / 'heldout.jsonl.gz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
