"""deepcabac_py: neural-network weight compression.

A uniform quantizer (NNC's step from ``qp``) feeds a context-adaptive binary arithmetic coder
written in Numba. The public surface is small::

    data = encode_model(state_dict, qp=-32)      # bytes
    model = decode_model(data)                   # the same structure back
    levels = decode_levels(data)                 # integer levels and steps, for integer inference
    header = read_stream_header(data)            # tensors, shapes, modes, sizes: no payload decoding
"""

from .codec import (
    QuantizedTensor,
    decode_checkpoint,
    decode_levels,
    decode_model,
    encode_model,
    quantize_model,
    read_stream_header,
)
from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .errors import (
    CheckpointError,
    CorruptStreamError,
    DeepCabacError,
    FormatError,
    OutputError,
    OutputExistsError,
    TruncatedStreamError,
)
from .quantize import step_from_qp

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CorruptStreamError",
    "DeepCabacError",
    "FormatError",
    "OutputError",
    "OutputExistsError",
    "QuantizedTensor",
    "TruncatedStreamError",
    "decode_checkpoint",
    "decode_levels",
    "decode_model",
    "encode_model",
    "load_checkpoint",
    "quantize_model",
    "read_stream_header",
    "save_checkpoint",
    "step_from_qp",
]
