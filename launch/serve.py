"""Entry point for `ray job submit --working-dir . -- python launch/serve.py CONFIG [--set ...] [--host ...]`.
Same arguments as `dspark serve`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dspark_cluster.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
