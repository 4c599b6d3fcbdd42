# transformers' BertModel of all-MiniLM-L6-v2's shape (6 layers, width 384, 12 heads, MLP 1536;
# random weights), eager, with the mean pooling and L2 normalization sentence-transformers applies:
# throughput at 256 x 128 tokens and latency at 8 x 32, in bf16 and f16, timed with CUDA events
# (and wall clock for the latency): python3 benches/gpu_bert_peer.py
import time

import torch
from transformers import BertConfig, BertModel

cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, vocab_size=30522, max_position_embeddings=512)
import transformers

print("transformers", transformers.__version__, "torch", torch.__version__)
for dt in [torch.bfloat16, torch.float16]:
    for attn in ["sdpa", "eager"]:
        cfg._attn_implementation = attn
        model = BertModel(cfg, add_pooling_layer=False).cuda().to(dt).eval()
        for b, s in [(256, 128), (8, 32)]:
            ids = (1 + torch.arange(b * s, device="cuda").reshape(b, s) * 7919 % 30000)
            mask = torch.ones(b, s, device="cuda", dtype=torch.long)

            def fwd():
                h = model(input_ids=ids, attention_mask=mask).last_hidden_state
                m = mask.unsqueeze(-1).to(h.dtype)
                e = (h * m).sum(1) / m.sum(1)
                return torch.nn.functional.normalize(e.float(), dim=-1)

            with torch.no_grad():
                for _ in range(3):
                    fwd()
                torch.cuda.synchronize()
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(20):
                    fwd()
                e.record()
                torch.cuda.synchronize()
                ms = a.elapsed_time(e) / 20
                walls = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    fwd()
                    torch.cuda.synchronize()
                    walls.append((time.perf_counter() - t0) * 1e3)
                walls.sort()
            print(f"torch {attn} minilm {dt} {b}x{s}: {ms:.4f} ms ({b / ms * 1e3:.0f} sentences/s), "
                  f"wall {walls[10]:.4f} ms")
