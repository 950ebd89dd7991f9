"""``python -m jobs.providers.gcp refresh-prices``: the price-refresh tool (:mod:`.refresh`)."""

import sys

from jobs.providers.gcp.refresh import main

sys.exit(main())
