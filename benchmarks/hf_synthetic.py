"""A synthetic Hugging Face checkpoint directory in bf16: Llama-shaped matrices with trained-like
statistics (per-row scales, heavy tails), sharded as ``save_pretrained`` shards, with the index,
config and tokenizer files beside them. Nothing is downloaded and no weights are committed: the
benchmarks make these on the spot.

    python benchmarks/hf_synthetic.py OUT_DIR [--size 1.1GB|2.2GB|7B] [--one-file]
"""
from __future__ import annotations

import argparse
import json
import os
import struct
from pathlib import Path

import numpy as np

# (hidden, intermediate, layers): the sizes bench_scale uses; 7B is Llama-2-7B's shape
SIZES = {
    "1.1GB": (2048, 5632, 8),
    "2.2GB": (2048, 5632, 19),
    "7B": (4096, 11008, 32),
}
VOCAB = 32000
SHARD_BYTES = 1 << 30


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def tensor_specs(hidden: int, intermediate: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in the order a Llama checkpoint lists them."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (hidden, hidden)),
                (p + "self_attn.v_proj.weight", (hidden, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                (p + "mlp.gate_proj.weight", (intermediate, hidden)), (p + "mlp.up_proj.weight", (intermediate, hidden)),
                (p + "mlp.down_proj.weight", (hidden, intermediate)),
                (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (VOCAB, hidden))]
    return out


def synthetic_tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """bf16 bits of a tensor that looks trained: norms near 1, matrices Student-t-ish with a
    log-normal scale per row."""
    if len(shape) == 1:
        return _bf16((1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32))
    rows = np.exp(rng.normal(np.log(0.02), 0.3, size=(shape[0], 1))).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= 1.0 + 0.5 * np.abs(rng.standard_normal((1, shape[1]), dtype=np.float32))  # columns of unequal scale
    x *= rows
    return _bf16(x)


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...], np.ndarray]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shape, bits in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + bits.nbytes]}
        pos += bits.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, bits in tensors:
            f.write(bits.data)


def make_directory(out: str | os.PathLike, hidden: int, intermediate: int, layers: int, *, seed: int = 0,
                   shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the directory; returns its index (``weight_map``, ``total_size``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(hidden, intermediate, layers)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:  # filled in order, a new shard when the next tensor would not fit
        nbytes = 2 * int(np.prod(shape))
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = [(name, shape, synthetic_tensor(rng, shape)) for name, shape in group]
        _write_shard(out / shard, tensors)
        for name, _, bits in tensors:
            weight_map[name] = shard
            total += bits.nbytes
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
              "num_key_value_heads": hidden // 128, "vocab_size": VOCAB, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}) + "\n")
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--size", choices=sorted(SIZES), default="1.1GB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one-file", action="store_true", help="one unsharded file instead of 1 GB shards")
    args = ap.parse_args()
    index = make_directory(args.out, *SIZES[args.size], seed=args.seed,
                           shard_bytes=1 << 62 if args.one_file else SHARD_BYTES)
    print(f"{args.out}: {index['metadata']['total_size']:,} bytes of bf16 in "
          f"{len(set(index['weight_map'].values()))} shards")


if __name__ == "__main__":
    main()
