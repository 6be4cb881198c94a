"""``python -m organism``: the organisms' command line (:mod:`.cli`)."""

from .cli import main

raise SystemExit(main())
