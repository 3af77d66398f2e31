"""deepcabac_py: neural-network weight compression.

A uniform quantizer (NNC's step from ``qp``) feeds a context-adaptive binary arithmetic coder
written in Numba. The public surface is small::

    data = encode_model(state_dict, qp=-32)      # bytes
    model = decode_model(data)                   # the same structure back
    levels = decode_levels(data)                 # integer levels and steps, for integer inference
    header = read_stream_header(data)            # tensors, shapes, modes, sizes: no payload decoding

Sparse weight updates (STC/SBC/top-k levels coded against their parent model)::

    msg = encode_update(new, base, density=0.01)  # bytes; names the parent by round and SHA-256
    new2 = apply_update(base, msg)               # refuses any other base
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
    "LimitExceededError": "errors",
    "OutputError": "errors",
    "OutputExistsError": "errors",
    "TruncatedStreamError": "errors",
    "step_from_qp": "quantize",
    "ErrorFeedback": "sparsify",
    "SparseTensor": "sparsify",
    "sparsify": "sparsify",
    "UpdateMismatchError": "errors",
    "UpdateSession": "updates",
    "UpdateStreamWriter": "updates",
    "apply_update": "updates",
    "decode_update": "updates",
    "encode_sparse": "updates",
    "encode_update": "updates",
    "iter_messages": "updates",
    "model_hash": "updates",
    "read_update_header": "updates",
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
    "ErrorFeedback",
    "FormatError",
    "InputError",
    "LimitExceededError",
    "OutputError",
    "OutputExistsError",
    "QuantizedTensor",
    "SparseTensor",
    "TruncatedStreamError",
    "UpdateMismatchError",
    "UpdateSession",
    "UpdateStreamWriter",
    "apply_update",
    "decode_checkpoint",
    "decode_levels",
    "decode_model",
    "decode_update",
    "encode_model",
    "encode_sparse",
    "encode_update",
    "iter_messages",
    "load_checkpoint",
    "model_hash",
    "quantize_model",
    "read_stream_header",
    "read_update_header",
    "save_checkpoint",
    "sparsify",
    "step_from_qp",
]
