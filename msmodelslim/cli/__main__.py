"""`python -m msmodelslim.cli quant ...` (the same as the `msmodelslim` console script)."""

import sys

from msmodelslim.cli.main import main

sys.exit(main())
