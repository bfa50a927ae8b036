#!/usr/bin/env python
"""What a JSON-schema constraint costs: decode throughput of the same random-weight target
with and without `structured_outputs`, plain and with drafting at a forced acceptance length,
in one run. Takes `onespec bench decode`'s options (see its --help; --hf is ignored).

The target gets the bundled demo model's tokenizer (the grammar needs real token strings;
ids past its vocabulary are never allowed), and every constrained request follows SCHEMA: an
object holding at least 40 records, so no request can complete its JSON inside the timed
steps and every step decodes the whole batch, as in the unconstrained rows. One JSON line per
configuration; `cost` = 1 - constrained tok/s / unconstrained tok/s at the same batch and K.

    python bench/structured.py --batch-sizes 1,8 --ks 3 --acceptance 3      # GPU, 8B shape
    python bench/structured.py --shape tiny --device cpu --batch-sizes 1 --ks 3 \\
        --acceptance 3 --gen-len 8 --trials 1
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onespec.bench.structured import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
