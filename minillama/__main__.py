"""``python -m minillama`` is the ``minillama`` command."""

from .cli import main

raise SystemExit(main())
