"""Entry point of the quick start: ``run_mindformer.py --config CONFIG.yaml --mode 1``.

A thin shim over ``mindtrain.trainer.cli`` (also installed as ``mindtrain-train``), so that
msrun can launch it by path from the repository root.
"""

import sys

from mindtrain.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
