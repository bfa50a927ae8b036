#!/usr/bin/env python
"""Time to first token with and without a cached prefix: the same code as
onespec/bench/prefix.py (see --help). Runs from a checkout without installing onespec.

    python bench/prefix_ttft.py --prompt-len 16384 --cached-len 15360    # 8B shape, GPU
    python bench/prefix_ttft.py --shape tiny --device cpu --prompt-len 256 --cached-len 192
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onespec.bench.prefix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
