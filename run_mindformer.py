"""Entry point of the quick start: ``run_mindformer.py --config CONFIG.yaml --mode 1``.

A thin shim over ``mindtrain.trainer.cli`` (also installed as ``mindtrain-train``), so that
msrun can launch it by path from the repository root. A relative ``--config`` or
``--register_path`` is looked up beside this file first, as MindFormers does.
"""

import os
import sys

from mindtrain.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(base_dir=os.path.dirname(os.path.abspath(__file__))))
