"""``python -m minillama`` is the ``minillama`` command."""

from minillama.cli.main import main

raise SystemExit(main())
