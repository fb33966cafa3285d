"""`python -m client`: see `client.cli`."""

import sys

from client.cli import main

sys.exit(main())
