"""``python -m compiler.cli``: the ``batchc`` command."""

import sys

from compiler.launch import main

sys.exit(main())
