"""`python -m meshforge` is the same as the `meshforge` command (torchrun needs the module form).

A process that ran gloo collectives leaves without interpreter finalization: gloo's worker threads
can still hold work objects whose tensors are then destroyed while Python is being torn down,
which aborts the process ("terminate called without an active exception", SIGABRT) after all
its work is done, about once in a few hundred runs here (pytorch/pytorch#179291 describes it).
Everything the run writes is closed and flushed before this point.
"""

import os
import sys

from meshforge.cli.main import main

code = main()
if "torch.distributed" in sys.modules:
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized() and getattr(dist, "_meshforge_used", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
raise SystemExit(code)
