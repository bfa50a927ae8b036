import sys

from onespec.cli import main

sys.exit(main())
