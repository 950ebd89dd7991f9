"""``python -m jobs.providers.aws refresh-prices``: see :mod:`jobs.providers.aws.refresh`."""

import sys

from jobs.providers.aws.refresh import main

sys.exit(main())
