"""Train a GPT: ``deepspeed recipes/train_gpt.py --deepspeed_config ds_configs/<size>.json [flags]``.

See ``--help`` and README.md.  All logic lives in ds_megatron.cli.train.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds_megatron.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
