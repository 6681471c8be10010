#!/usr/bin/python3
"""Trains small tapegrad models (train_lm), loads each into the PyTorch reference model with the
lines of docs/pytorch.md, and compares PyTorch's logits with tapegrad's (dump_logits).

    check_pytorch_load.py TRAIN_LM DUMP_LOGITS DOC TORCH_GPT_DIR WORK_DIR

Exit 77 (CTest's skip) when torch or the reference model is missing; 1 on any mismatch.
"""
import os
import re
import struct
import subprocess
import sys
import json

train_lm, dump_logits, doc, ref_dir, work = sys.argv[1:6]
try:
    import torch
except ImportError:
    print("skipped: /usr/bin/python3 cannot import torch")
    sys.exit(77)
if not os.path.exists(os.path.join(ref_dir, "torch_gpt.py")):
    print(f"skipped: no torch_gpt.py in {ref_dir}")
    sys.exit(77)
sys.path.insert(0, ref_dir)
torch.set_num_threads(1)

# The documented lines themselves: the first Python block of the doc defines load_run.
code = re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)[0]
exec(code)

os.makedirs(work, exist_ok=True)
corpus = os.path.join(work, "corpus.txt")
with open(corpus, "w") as f:
    for i in range(400):
        f.write(f"ROMEO: line {i}, of a corpus small enough to train in seconds; JULIET: {i * 7 % 13}.\n")

def read_logits(path):
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    e = header["logits"]
    b, t = e["data_offsets"]
    return torch.frombuffer(bytearray(data[b:t]), dtype=torch.float32).reshape(e["shape"])

failures = 0
for arch in ("gpt", "llama"):
    for norm in ("layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"):
        out = os.path.join(work, f"{arch}_{norm}")
        subprocess.run([train_lm, "--data", corpus, "--arch", arch, "--norm", norm, "--steps", "30", "--n-layer", "2",
                        "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
                        "--eval-iters", "0", "--threads", "1", "--quiet", "--overwrite", "--out", out], check=True,
                       stdout=subprocess.DEVNULL)
        model, vocab = load_run(os.path.join(out, "model.safetensors"))
        ids = [vocab.index(c) for c in "ROMEO: line 7, JULIET"][:16]
        subprocess.run([dump_logits, os.path.join(out, "model.safetensors"), ",".join(map(str, ids)),
                        os.path.join(out, "logits.safetensors")], check=True)
        mine = read_logits(os.path.join(out, "logits.safetensors"))
        caught = []
        model.head.register_forward_hook(lambda module, inputs, output: caught.append(output))
        with torch.no_grad():
            model(torch.tensor([ids]), torch.tensor([ids]))
        diff = (caught[0] - mine).abs().max().item()
        ok = caught[0].shape == mine.shape and diff <= 1e-4
        failures += not ok
        print(f"{arch:5} {norm:9} logits {tuple(mine.shape)} max |pytorch - tapegrad| = {diff:.2e} {'ok' if ok else 'FAIL'}")
sys.exit(1 if failures else 0)
