"""``python -m compiler.cli``: the ``batchc`` command."""

import sys

from compiler.cli import main

sys.exit(main())
