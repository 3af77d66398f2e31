"""The README's first command: compress the project's reference model and show what it kept.

Runs the real command line (``deepcabac encode``, ``decode``, ``report``) on
``models/digits_cnn.safetensors`` at a few quantization parameters, then evaluates the decoded
weights on the held-out digits: accuracy, agreement with the original model's predictions, and the
mean KL divergence of the softmax outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_cnn import SAFETENSORS_PATH, load_eval_set, logits  # noqa: E402

from deepcabac_py import load_checkpoint  # noqa: E402

CLI = [sys.executable, "-m", "deepcabac_py.cli.main"]


def run(*args: str) -> str:
    return subprocess.run([*CLI, *args], check=True, capture_output=True, text=True).stdout


def main() -> None:
    x, y = load_eval_set()
    original = {k: v for k, v in load_checkpoint(SAFETENSORS_PATH).tensors.items()}
    ref_logits = logits(original, x)
    ref_pred = ref_logits.argmax(1)
    size = os.path.getsize(SAFETENSORS_PATH)
    print(f"model: {SAFETENSORS_PATH.name}, {size:,} bytes, eval accuracy "
          f"{(ref_pred == y).float().mean():.4f} on {len(y)} held-out digits\n")

    print("per-tensor report at qp -32 (deepcabac report):")
    print(run("report", str(SAFETENSORS_PATH), "--qp", "-32"))

    print(f"\n{'qp':>5} {'bytes':>8} {'ratio':>7} {'bits/param':>10} {'accuracy':>9} {'agreement':>9} {'mean KL':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for qp in (-38, -32, -26, -20, -16):
            stream = Path(tmp, f"q{qp}.dcb")
            decoded_path = Path(tmp, f"q{qp}.safetensors")
            run("encode", str(SAFETENSORS_PATH), "-o", str(stream), "--qp", str(qp), "-q")
            run("decode", str(stream), "-o", str(decoded_path), "-q")
            decoded = load_checkpoint(decoded_path).tensors
            out = logits(decoded, x)
            pred = out.argmax(1)
            kl = torch.nn.functional.kl_div(out.log_softmax(1), ref_logits.log_softmax(1),
                                            log_target=True, reduction="batchmean")
            params = sum(t.numel() for t in decoded.values())
            tensor_bytes = sum(t.numel() * t.element_size() for t in decoded.values())
            nbytes = stream.stat().st_size
            # the ratio the report gives: the tensors' bytes (not the file's, header included) per stream byte
            print(f"{qp:>5} {nbytes:>8,} {tensor_bytes / nbytes:>6.2f}x {8 * nbytes / params:>10.3f} "
                  f"{(pred == y).float().mean():>9.4f} {(pred == ref_pred).float().mean():>9.4f} {kl:>9.2e}")


if __name__ == "__main__":
    main()
