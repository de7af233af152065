import sys

from cxlrt.cli import main

sys.exit(main())
