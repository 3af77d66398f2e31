"""deepcabac_py: neural-network weight compression.

A uniform quantizer (NNC's step from ``qp``) feeds a context-adaptive binary arithmetic coder
written in Numba. The public surface is small::

    data = encode_model(state_dict, qp=-32)      # bytes
    model = decode_model(data)                   # the same structure back
    levels = decode_levels(data)                 # integer levels and steps, for integer inference
    header = read_stream_header(data)            # tensors, shapes, modes, sizes: no payload decoding
"""

import importlib

# Names are resolved on first use (PEP 562), so that `import deepcabac_py` and header-only work such
# as `deepcabac info` do not pay for importing torch.
_EXPORTS = {
    "QuantizedTensor": "codec",
    "decode_checkpoint": "codec",
    "decode_levels": "codec",
    "decode_model": "codec",
    "encode_model": "codec",
    "quantize_model": "codec",
    "read_stream_header": "codec",
    "Checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "CheckpointError": "errors",
    "CorruptStreamError": "errors",
    "DeepCabacError": "errors",
    "FormatError": "errors",
    "InputError": "errors",
    "OutputError": "errors",
    "OutputExistsError": "errors",
    "TruncatedStreamError": "errors",
    "step_from_qp": "quantize",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepcabac_py' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CorruptStreamError",
    "DeepCabacError",
    "FormatError",
    "InputError",
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
