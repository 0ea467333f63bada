"""Entry point for `ray job submit --working-dir . -- python launch/run.py CONFIG [--set ...]`.
Same arguments as `dspark run`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dspark_cluster.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
