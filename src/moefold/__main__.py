import os

from moefold.cli import main

code = main()
if "WORLD_SIZE" in os.environ:  # a rank of a job (torchrun, moefold train --nproc)
    from moefold.parallel.launch import exit_rank

    exit_rank(code)
raise SystemExit(code)
