"""``python -m lowbit`` is the ``lowbit`` command."""

import sys

from lowbit.cli.main import main

sys.exit(main())
