"""`python -m meshforge` is the same as the `meshforge` command (torchrun needs the module form)."""

from meshforge.cli import main

raise SystemExit(main())
