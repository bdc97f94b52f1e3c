"""L3: training data: the built-in demo corpus and deterministic, resumable micro-batch streams."""

from ds_megatron.data.demo import BYTE_VOCAB_SIZE, EOS_BYTE_ID, builtin_corpus_bytes, byte_decode, byte_encode
from ds_megatron.data.stream import MicroBatchStream, split_train_valid

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOS_BYTE_ID",
    "MicroBatchStream",
    "builtin_corpus_bytes",
    "byte_decode",
    "byte_encode",
    "split_train_valid",
]
