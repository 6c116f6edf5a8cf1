"""Turn json/jsonl into Megatron .bin/.idx datasets (same as the `mindtrain-preprocess` command).

    python preprocess_indexed_dataset.py --input data.jsonl --output-prefix ./run_data/corpus --append-eod
"""

import sys

from mindtrain.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
