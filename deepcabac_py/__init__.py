"""deepcabac_py: neural-network weight compression.

A uniform quantizer (NNC's step from ``qp``) feeds a context-adaptive binary arithmetic coder
written in Numba. The subpackages are layers; each imports only those below it::

    io          checkpoints in and out (a tensor at a time), directories, dtypes, atomic output
    entropy     the level coder (CABAC kernels) and the linear prediction across columns
    quant       step of qp, nearest / RDOQ / trellis, every reconstruction
    model       model streams: settings, planning, encoder, decoder, container, data-free policies,
                files and directories
    tuning      workflows around the encoder: Fisher importance, rate control, recalibration
    updates     sparse weight updates of distributed and federated training
    matrix      entropy-bounded matrix formats (CER/CSER) and torch modules on them
    series      the checkpoints of a training run, each coded against the last
    integrations, cli

The public surface is small::

    data = encode_model(state_dict, qp=-32)      # bytes
    model = decode_model(data)                   # the same structure back
    levels = decode_levels(data)                 # integer levels and steps, for integer inference
    header = read_stream_header(data)            # tensors, shapes, modes, sizes: no payload decoding
    encode_file("m.safetensors", "m.dcb")        # a tensor at a time, bounded memory
    decode_model("m.dcb", names=["lm_head.*"])   # reads the chosen payloads only
    encode_directory("hf-dir/", "hf-dir.dcb/")   # Hugging Face shards, index and config carried

Sparse weight updates (STC/SBC/top-k levels coded against their parent model)::

    msg = encode_update(new, base, density=0.01)  # bytes; names the parent by round and SHA-256
    new2 = apply_update(base, msg)               # refuses any other base
"""

import importlib

# Names are resolved on first use (PEP 562), so that `import deepcabac_py` and header-only work such
# as `deepcabac info` do not pay for importing torch.
_EXPORTS = {
    "QuantizedTensor": "model.levels",
    "decode_checkpoint": "model.decoder",
    "decode_levels": "model.decoder",
    "decode_model": "model.decoder",
    "encode_model": "model.encoder",
    "quantize_model": "model.encoder",
    "read_stream_header": "model.decoder",
    "encode_file": "model.files",
    "decode_file": "model.files",
    "encode_directory": "model.files",
    "decode_directory": "model.files",
    "Checkpoint": "io.checkpoint",
    "load_checkpoint": "io.files",
    "save_checkpoint": "io.files",
    "CheckpointError": "errors",
    "CorruptStreamError": "errors",
    "DeepCabacError": "errors",
    "FormatError": "errors",
    "InputError": "errors",
    "LimitExceededError": "errors",
    "OutputError": "errors",
    "OutputExistsError": "errors",
    "TruncatedStreamError": "errors",
    "step_from_qp": "quant.steps",
    "ErrorFeedback": "updates.sparsify",
    "SparseTensor": "updates.sparsify",
    "sparsify": "updates.sparsify",
    "UpdateMismatchError": "errors",
    "UpdateSession": "updates.sessions",
    "UpdateStreamWriter": "updates.messages",
    "apply_update": "updates.messages",
    "decode_update": "updates.messages",
    "encode_sparse": "updates.messages",
    "encode_update": "updates.messages",
    "iter_messages": "updates.messages",
    "model_hash": "updates.parent_model",
    "read_update_header": "updates.message_format",
    "CheckpointSeries": "series.checkpoint_series",
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
    "CheckpointSeries",
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
    "decode_directory",
    "decode_file",
    "decode_levels",
    "decode_model",
    "decode_update",
    "encode_directory",
    "encode_file",
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
