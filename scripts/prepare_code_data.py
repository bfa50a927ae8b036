#!/usr/bin/env python
"""Build the demo pair's Python code corpus: the standard library and permissively licensed
packages from PyPI, with whole packages held out for evaluation.

Writes ``train.jsonl.gz``, ``heldout.jsonl.gz``, ``head.jsonl.gz`` and ``sources.json`` into
``--out``. ``head.jsonl.gz`` is every ``--head-every``-th training file: the prompts that
``onespec train eagle3 --regenerate`` has the target continue to train the draft head. Each
jsonl line is ``{"path": "<source>/<path inside it>", "text": <source>}``; ``sources.json``
records every source with its version, licence (as pinned below and as its metadata says)
and split.

* The packages in PACKAGES are installed with pip into a scratch directory (``--no-deps``,
  wheels only, exact versions), so the corpus is the same on every machine with the same
  Python; their files are read from each wheel's ``RECORD``.
* The held-out split is whole packages (``split="heldout"`` below), never files of a package
  that is also trained on, and no training package vendors one of them.
* Test suites (``test/``, ``tests/``, ...), vendored copies (``_vendor/``, ``vendor/``) and
  ``__pycache__`` are skipped; sources are decoded from raw bytes, exactly as on disk.
* Sorted order and gzip streams without a timestamp make reruns byte-identical.

``--stdlib-only`` skips PyPI (no network needed) and holds out the standard-library
top-level modules whose crc32 is 0 modulo 20: a quick corpus for tests.

Usage::

    python scripts/prepare_code_data.py --out data/code
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import tokenize
import zlib
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

# (distribution, version, licence, split). Pure-Python wheels under permissive licences.
# Nothing here vendors another entry (pip and setuptools vendor rich, packaging and
# more-itertools, so they are left out).
PACKAGES = [
    ("requests", "2.32.3", "Apache-2.0", "train"),
    ("urllib3", "2.2.3", "MIT", "train"),
    ("idna", "3.10", "BSD-3-Clause", "train"),
    ("flask", "3.0.3", "BSD-3-Clause", "train"),
    ("werkzeug", "3.0.6", "BSD-3-Clause", "train"),
    ("jinja2", "3.1.4", "BSD-3-Clause", "train"),
    ("click", "8.1.7", "BSD-3-Clause", "train"),
    ("starlette", "0.41.3", "BSD-3-Clause", "train"),
    ("fastapi", "0.115.6", "MIT", "train"),
    ("pydantic", "2.10.3", "MIT", "train"),
    ("networkx", "3.4.2", "BSD-3-Clause", "train"),
    ("pygments", "2.18.0", "BSD-2-Clause", "train"),
    ("tornado", "6.4.2", "Apache-2.0", "train"),
    ("toolz", "1.0.0", "BSD-3-Clause", "train"),
    ("pyparsing", "3.2.0", "MIT", "train"),
    ("marshmallow", "3.23.1", "MIT", "train"),
    ("black", "24.10.0", "MIT", "train"),
    ("isort", "5.13.2", "MIT", "train"),
    ("pytest", "8.3.4", "MIT", "train"),
    ("pluggy", "1.5.0", "MIT", "train"),
    ("sqlalchemy", "2.0.36", "MIT", "train"),
    ("python-dateutil", "2.9.0.post0", "Apache-2.0 OR BSD-3-Clause", "train"),
    ("tomli", "2.2.1", "MIT", "train"),
    ("packaging", "24.2", "Apache-2.0 OR BSD-2-Clause", "train"),
    ("rich", "13.9.4", "MIT", "heldout"),
    ("httpx", "0.28.1", "BSD-3-Clause", "heldout"),
    ("attrs", "24.2.0", "MIT", "heldout"),
    ("more-itertools", "10.5.0", "MIT", "heldout"),
    ("boltons", "24.1.0", "BSD-3-Clause", "heldout"),
]

SKIP_DIRS = {
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "testing", "idle_test",
    "_vendor", "vendor", "vendored",
}
STDLIB_HELDOUT_MOD = 20


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("config-")   # config-3.x-<platform>: build helpers


def _skipped(rel: str) -> bool:
    return any(map(_skip_dir, rel.split("/")[:-1]))


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


def _read_sources(root: Path, rels: list[str], prefix: str) -> list[tuple[str, str]]:
    out = []
    for rel in sorted(set(rels)):
        if not rel.endswith(".py") or _skipped(rel):
            continue
        text = _decode((root / rel).read_bytes())
        if text is not None and text.strip():
            out.append((f"{prefix}/{rel}", text))
    return out


def stdlib_files(stdlib: Path) -> list[tuple[str, str]]:
    """(``stdlib/<rel>``, text) for the stdlib's .py files, sorted."""
    rels = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if not _skip_dir(d))
        rels += [Path(root, f).relative_to(stdlib).as_posix() for f in files if f.endswith(".py")]
    return _read_sources(stdlib, rels, "stdlib")


def stdlib_heldout(path: str) -> bool:
    """--stdlib-only split: a whole top-level module is held out iff its crc32 is 0 mod 20."""
    top = path.split("/")[1].removesuffix(".py")
    return zlib.crc32(top.encode()) % STDLIB_HELDOUT_MOD == 0


def install_packages(scratch: Path) -> None:
    specs = [f"{name}=={version}" for name, version, _, _ in PACKAGES]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
           "--no-compile", "--target", str(scratch), *specs]
    print(f"installing {len(specs)} packages into {scratch}", flush=True)
    subprocess.run(cmd, check=True)


def _dist_info(scratch: Path, name: str, version: str) -> Path:
    want = name.lower().replace("-", "_")
    for d in scratch.glob("*.dist-info"):
        dist, _, ver = d.name.removesuffix(".dist-info").rpartition("-")
        if dist.lower().replace("-", "_").replace(".", "_") == want and ver == version:
            return d
    raise SystemExit(f"{name}=={version} is not installed in {scratch}")


def _metadata_licence(meta: Message) -> str:
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier", []) if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    return ((meta.get("License") or "").strip().splitlines() or ["not stated"])[0]


def package_files(scratch: Path, name: str, version: str) -> tuple[list[tuple[str, str]], str]:
    """(``<name>/<rel>``, text) for the package's .py files, from its RECORD, and the
    licence its metadata states."""
    info = _dist_info(scratch, name, version)
    rels = [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line]
    meta = HeaderParser().parsestr((info / "METADATA").read_text(encoding="utf-8"))
    return _read_sources(scratch, rels, name), _metadata_licence(meta)


def write_jsonl_gz(path: Path, records: list[tuple[str, str]]) -> None:
    # mtime=0 and an empty embedded file name keep the output byte-identical across runs.
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        for rel, text in records:
            gz.write((json.dumps({"path": rel, "text": text}, ensure_ascii=False) + "\n").encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--stdlib-only", action="store_true",
                   help="no PyPI packages; hold out whole stdlib top-level modules (for tests)")
    p.add_argument("--head-every", type=int, default=5,
                   help="head.jsonl.gz takes every N-th training file (default 5)")
    p.add_argument("--max-files", type=int, default=None,
                   help="keep at most N files of each split, in path order (quick tests)")
    args = p.parse_args(argv)

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    records = stdlib_files(stdlib)
    sources = [{"name": "stdlib", "version": sys.version.split()[0], "licence": "PSF-2.0",
                "split": "train", "files": 0}]
    if args.stdlib_only:
        train = [r for r in records if not stdlib_heldout(r[0])]
        heldout = [r for r in records if stdlib_heldout(r[0])]
        sources[0]["split"] = f"train, and held out where crc32(top-level module) % {STDLIB_HELDOUT_MOD} == 0"
    else:
        train, heldout = list(records), []
        with tempfile.TemporaryDirectory(prefix="onespec-code-") as scratch:
            install_packages(Path(scratch))
            for name, version, licence, split in PACKAGES:
                files, stated = package_files(Path(scratch), name, version)
                (train if split == "train" else heldout).extend(files)
                sources.append({"name": name, "version": version, "licence": licence,
                                "metadata_licence": stated, "split": split, "files": len(files)})
    sources[0]["files"] = len(records)
    if args.max_files is not None:
        train, heldout = train[: args.max_files], heldout[: args.max_files]
    if not train or not heldout:
        p.error(f"empty split (train={len(train)}, heldout={len(heldout)})")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(out / "train.jsonl.gz", train)
    write_jsonl_gz(out / "heldout.jsonl.gz", heldout)
    write_jsonl_gz(out / "head.jsonl.gz", train[:: args.head_every])
    (out / "sources.json").write_text(json.dumps(sources, indent=1) + "\n")
    for s in sources:
        print(f"  {s['name']:16s} {s['version']:12s} {s['licence']:26s} {s['split']:8.8s} {s['files']:5d} files")
    for name, recs in (("train", train), ("heldout", heldout)):
        mb = sum(len(t.encode("utf-8")) for _, t in recs) / 1e6
        print(f"{name:8s} {len(recs):5d} files {mb:7.2f} MB -> {out / (name + '.jsonl.gz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
