import sys

from pipec.cli import main

sys.exit(main())
