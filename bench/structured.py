#!/usr/bin/env python
"""What a JSON-schema constraint costs in decode throughput: the same code as
onespec/bench/structured.py (see its docstring; takes `onespec bench decode`'s options).
Runs from a checkout without installing onespec.

    python bench/structured.py --shape tiny --device cpu --batch-sizes 1 --ks 3 \\
        --acceptance 3 --gen-len 8 --trials 1
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onespec.bench.structured import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
