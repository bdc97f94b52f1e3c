"""TTFT and TPOT of an exported model: ``deepspeed --num_gpus TP recipes/measure_inference.py --plan P --out O``.

Run by ``python -m ds_megatron.tune inference --empirical``.  All logic lives in ds_megatron.cli.measure_inference.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds_megatron.cli.measure_inference import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
