#!/usr/bin/env python
"""Decode benchmark: the same code as `onespec bench decode` (see --help). Runs from a
checkout without installing onespec.

    python bench/decode.py                                   # Llama-3.1-8B shape on the GPU
    python bench/decode.py --shape tiny --device cpu --no-hf --gen-len 8
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onespec.bench.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
